"""The preamble every model route shares, in one base class (vLLM's `OpenAIServing` plays this
part): find the model, bound the number of items, check the generation length, and prepare
the inputs on the model's tokenizer thread, never on the event loop."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from app.common.constraints import sampling_constraints
from app.common.failures import TooLarge, invalid
from app.common.inputs import InputPreparer, Prepared, check_num_items, text_volume
from app.common.roles import Role
from app.common.routed_experts import check_prompt_start, routing_of
from app.common.sampling import OWN_NAMES, GenerationAsk, Names
from app.config_groups import LimitSettings
from app.engine.registry import ModelRegistry, check_batch_invariant
from app.engine.served import ServedModel
from app.engine.types import SamplingConfig, ScoreSpec


@dataclass(frozen=True)
class Resolved:
    """A generation's ask, resolved for one served model: how every row samples, what is
    scored along each generated token (`asks`) and each prompt (`prompt_asks`), and whether
    rows run alone (None: the model's default, for a caller that asked nothing)."""

    config: SamplingConfig
    asks: ScoreSpec | None = None
    prompt_asks: ScoreSpec | None = None
    alone: bool | None = None


@dataclass(frozen=True)
class Inputs:
    """A request's inputs, checked and prepared for one served model."""

    served: ServedModel
    field: str
    """The request field the inputs came from (errors name it)."""
    items: list[Prepared]

    @property
    def preparer(self) -> InputPreparer:
        return self.served.preparer


class ModelServing:
    def __init__(self, registry: ModelRegistry, limits: LimitSettings) -> None:
        self.registry = registry
        self.limits = limits

    def served(self, model: str) -> ServedModel:
        return self.registry.get(model)

    def alone(self, requested: bool | None, served: ServedModel) -> bool:
        """Whether this request's rows run batch-invariant (each in a model call of its own):
        its `batch_invariant`, else the server's `batching.invariant`."""
        invariant = self.registry.invariant if requested is None else requested
        if invariant:
            check_batch_invariant(served, Role.BATCH_INVARIANT)
        return invariant

    def max_new_tokens(self, requested: int | None, field: str = "max_new_tokens") -> int:
        value = requested or self.limits.default_max_new_tokens
        limit = self.limits.max_new_tokens
        if value > limit:
            raise invalid(
                field,
                f"{value} exceeds the server's limit of {limit} (RLSERVE_LIMITS__MAX_NEW_TOKENS "
                "raises it)",
            )
        return value

    def resolve(
        self,
        ask: GenerationAsk,
        model: str = "policy",
        names: Names = OWN_NAMES,
        prompts: Sequence[Sequence[int]] | None = None,
    ) -> Resolved:
        """The one resolver of a generation's ask, whatever the route (`app.common.sampling`):
        the server's default and limit of new tokens, the greedy rule (greedy rows score at
        temperature 1 without top-k, top-p or min-p, as vLLM treats them), the constraints
        checked against the model's vocabulary, the routing the model can record, the limits
        of what is scored along, and batch invariance; the checks that need the prompts' lengths
        run when `prompts` are given. A refusal names the caller's field (`names`)."""
        sampling = ask.sampling
        max_new = self.max_new_tokens(sampling.max_new_tokens, names("max_new_tokens"))
        served = self.served(model)
        backend = served.backend
        routed = sampling.return_routed_experts
        if routed:
            routing_of(backend, model, names("return_routed_experts"))
        elif ask.routing_where_recorded and backend.routing is not None:
            routed = True
            lengths = [len(p) for p in prompts or ()]
            check_prompt_start(ask.routing_start, lengths, names("routed_experts_prompt_start"))
        if ask.top_logprobs:
            self.top_logprobs(ask.top_logprobs, names("top_logprobs"))
        if ask.prompt_top_logprobs is not None:
            self.top_logprobs(ask.prompt_top_logprobs, names("prompt_top_logprobs"))
        limit = backend.full_distribution_limit()
        if ask.entropy and limit is not None and prompts:
            longest = max(len(p) for p in prompts) + max_new
            if longest > limit:
                raise TooLarge(
                    f"{names('entropy')}: needs the whole vocabulary at every "
                    f"position, which this backend scores for at most {limit} tokens per "
                    f"sequence; prompt and max_new_tokens reach {longest}",
                    param=names("entropy"),
                )
        config = SamplingConfig.resolve(
            max_new,
            greedy=sampling.greedy,
            temperature=sampling.temperature,
            stops=list(sampling.stop or ()),
            top_p=sampling.top_p,
            top_k=sampling.top_k_or_none,
            min_p=sampling.min_p,
            repetition_penalty=sampling.repetition_penalty,
            ignore_eos=sampling.ignore_eos,
            return_prompt_log_probs=sampling.return_prompt_log_probs,
            return_routed_experts=routed,
            **sampling_constraints(served, sampling, max_new, names),
        )
        scored = ask.top_logprobs or ask.entropy or ask.ranks
        prompt_k = ask.prompt_top_logprobs
        return Resolved(
            config,
            ScoreSpec(top_logprobs=ask.top_logprobs, entropy=ask.entropy, ranks=ask.ranks)
            if scored
            else None,
            None if prompt_k is None else ScoreSpec(top_logprobs=prompt_k, ranks=True),
            self.alone(ask.batch_invariant, served),
        )

    def top_logprobs(self, k: int, field: str) -> int:
        """`k` most likely tokens a request asks for at each position, within the server's
        limit."""
        if k > self.limits.max_top_logprobs:
            raise invalid(
                field,
                f"at most {self.limits.max_top_logprobs} (the server's limit: "
                "RLSERVE_LIMITS__MAX_TOP_LOGPROBS)",
            )
        return k

    def check_num_items(self, num_items: int, field: str) -> None:
        check_num_items(num_items, self.limits.max_items_per_request, field)

    async def prompts(
        self, request: Any, model: str, *, max_new_tokens: int, per_item: int = 1
    ) -> Inputs:
        """The prompts of a generation request (messages, text or tokens), `per_item`
        generations each counted against the item limit."""
        served = self.served(model)
        field = request.given_inputs()[0]
        self.check_num_items(request.num_items() * per_item, field)
        preparer = served.preparer
        items = await preparer.off_loop(
            preparer.checked_prompts,
            request,
            field,
            max_new_tokens=max_new_tokens,
            cost=text_volume(request),
        )
        return Inputs(served, field, items)

    async def sequences(self, request: Any, model: str) -> Inputs:
        """The whole sequences of a scoring request (messages, text, tokens or splits)."""
        served = self.served(model)
        field = request.given_inputs()[0]
        self.check_num_items(request.num_items(), field)
        preparer = served.preparer
        items = await preparer.off_loop(
            preparer.checked_sequences, request, field, cost=text_volume(request)
        )
        return Inputs(served, field, items)
