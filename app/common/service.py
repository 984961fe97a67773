"""The preamble every model route shares, in one base class (vLLM's `OpenAIServing` plays this
part): find the model, bound the number of items, check the generation length, and prepare
the inputs on the model's tokenizer thread, never on the event loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.common.constraints import sampling_constraints
from app.common.failures import invalid
from app.common.inputs import InputPreparer, Prepared, check_num_items, text_volume
from app.common.routed_experts import routing_of
from app.common.sampling import OWN_NAMES, Names, SamplingAsk
from app.config_groups import LimitSettings
from app.engine.registry import ModelRegistry, check_batch_invariant
from app.engine.served import ServedModel
from app.engine.types import SamplingConfig


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
            check_batch_invariant(served, "batch_invariant")
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

    def sampling(
        self, ask: SamplingAsk, model: str = "policy", names: Names = OWN_NAMES
    ) -> SamplingConfig:
        """The one resolver of sampling parameters, whatever the route (`app.common.sampling`):
        the server's default and limit of new tokens, the greedy rule (greedy rows score at
        temperature 1 without top-k, top-p or min-p, as vLLM treats them), the constraints
        checked against the model's vocabulary, and whether the model can record routing.
        A refusal names the caller's field (`names`)."""
        max_new = self.max_new_tokens(ask.max_new_tokens, names("max_new_tokens"))
        served = self.served(model)
        if ask.return_routed_experts:
            routing_of(served.backend, model, names("return_routed_experts"))
        return SamplingConfig.resolve(
            max_new,
            greedy=ask.greedy,
            temperature=ask.temperature,
            stops=list(ask.stop or ()),
            top_p=ask.top_p,
            top_k=ask.top_k_or_none,
            min_p=ask.min_p,
            repetition_penalty=ask.repetition_penalty,
            ignore_eos=ask.ignore_eos,
            return_prompt_log_probs=ask.return_prompt_log_probs,
            return_routed_experts=ask.return_routed_experts,
            **sampling_constraints(served, ask, max_new, names),
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
