"""Wire models of `POST /v1/generate`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from app.common.containers import VERSIONS_DESCRIPTION, Sample, VersionSpan
from app.common.protocol import (
    InputFields,
    RepetitionPenalty,
    RoutedExperts,
    Seed,
    ServedName,
    ShapingFields,
    Temperature,
    TopK,
    TopP,
    WireModel,
    check_exactly_one,
    field_error,
)
from app.common.sampling import GenerationAsk, Names, SamplingAsk
from app.scoring.protocol import TopLogProbs

_GENERATE_INPUTS = ("messages", "text", "tokens")
StopList = Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=16)]


class GenerateRequest(InputFields, ShapingFields):
    """Inputs plus TorchRL-standard generation parameters. Backend names (`max_tokens`, `n`,
    `stop`, `logprobs`) are accepted as aliases and win when both are given."""

    model: ServedName = "policy"
    max_new_tokens: int | None = Field(default=None, gt=0)
    max_tokens: int | None = Field(default=None, gt=0, description="Alias of max_new_tokens; wins.")
    num_return_sequences: int | None = Field(default=None, gt=0)
    n: int | None = Field(default=None, gt=0, description="Alias of num_return_sequences; wins.")
    temperature: Temperature = None
    top_p: TopP = 1.0
    top_k: TopK = None
    repetition_penalty: RepetitionPenalty = 1.0
    do_sample: bool | None = Field(
        default=None, description="Default: sample unless temperature is 0."
    )
    stop_sequences: StopList | None = None
    stop: StopList | None = Field(default=None, description="Alias of stop_sequences; wins.")
    ignore_eos: bool = Field(default=False, description="Keep generating past end-of-sequence.")
    skip_special_tokens: bool = Field(
        default=False, description="Drop special tokens from text.response (tokens keep them)."
    )
    seed: Seed | None = Field(
        default=None,
        description="Seeds each returned sequence's own random stream: results do not depend "
        "on what else is batched with the request.",
    )
    return_log_probs: bool = True
    logprobs: bool | None = Field(default=None, description="Alias of return_log_probs; wins.")
    return_prompt_log_probs: bool = Field(
        default=False, description="Also return log_probs.prompt and log_probs.full."
    )
    top_logprobs: int = Field(
        default=0,
        ge=0,
        description="At every generated token, the k most likely tokens and their raw "
        "log-probs (the server's cap: max_top_logprobs). Computed, like `entropy`, by one "
        "scoring pass over each finished sequence under the weights that generated it.",
    )
    entropy: bool = Field(
        default=False, description="At every generated token, the raw distribution's entropy."
    )
    return_routed_experts: bool = Field(
        default=False,
        description="Mixture-of-experts models: also return routed_experts, the experts each "
        "layer's router chose for every token the model was fed (to replay them in the "
        "trainer's forward, or in /v1/logprobs). transformers backend only.",
    )
    batch_invariant: bool | None = Field(
        default=None,
        description="Each row generated in a model call of its own, so its tokens and "
        "log-probs are bitwise the same whatever else is sent, and its log-probs are those "
        "/v1/logprobs gives its tokens, bitwise (a row that spans a weight update keeps the "
        "ones it was sampled with). Default: the server's batching.invariant. transformers "
        "backend only.",
    )

    @model_validator(mode="after")
    def _check(self) -> GenerateRequest:
        check_exactly_one(self, _GENERATE_INPUTS)
        if self.do_sample is False and self.temperature not in (None, 0):
            raise field_error(
                "temperature",
                f"must be 0 (or unset) when do_sample is false, got {self.temperature}",
            )
        return self

    def num_items(self) -> int:
        return len(getattr(self, self.given_inputs()[0]))

    @property
    def num_samples(self) -> int:
        return self.n or self.num_return_sequences or 1

    @property
    def wants_log_probs(self) -> bool:
        return self.return_log_probs if self.logprobs is None else self.logprobs

    def generation_ask(self) -> tuple[GenerationAsk, Names]:
        """The request's ask, and its names for its fields (an alias given wins)."""
        sampling = SamplingAsk.taken(
            self,
            max_new_tokens=self.max_tokens or self.max_new_tokens,
            stop=self.stop if self.stop is not None else self.stop_sequences,
        )
        ask = GenerationAsk(
            sampling,
            top_logprobs=self.top_logprobs,
            entropy=self.entropy,
            batch_invariant=self.batch_invariant,
        )
        return ask, Names(renamed={"max_new_tokens": "max_tokens"} if self.max_tokens else {})


class GeneratedSample(Sample):
    top_logprobs: TopLogProbs | None = Field(
        default=None, description="One row per response token (when asked)."
    )
    entropy: list[float] | None = Field(
        default=None, description="Nats, one per response token (when asked)."
    )
    finish_reason: Literal["stop", "length", "abort"]
    stop_reason: str | int | None = Field(
        default=None,
        description="The stop sequence, or the token of stop_token_ids, that ended generation, "
        "if one did.",
    )
    policy_versions: list[VersionSpan] | None = Field(
        default=None, description=VERSIONS_DESCRIPTION
    )
    routed_experts: RoutedExperts | None = Field(
        default=None,
        description="When asked (return_routed_experts): per token of tokens.full but the "
        "last, which the model was never fed, the experts each layer's router chose for it "
        "[num_hidden_layers][num_experts_per_tok], highest weight first; a dense layer's are "
        "0. Replay them with /v1/logprobs' routed_experts or rlserve_client.moe.",
    )


class GenerateResponse(WireModel):
    policy_version: int
    model: ServedName
    pad_token_id: int = Field(description="The model's padding token (for padded layouts).")
    outputs: list[list[GeneratedSample]] = Field(
        description="One list per input, with num_return_sequences samples each."
    )
