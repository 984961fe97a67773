"""Wire models of `POST /v1/kl`."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, model_validator

from app.common.containers import TokenFields
from app.common.protocol import ServedName, SplitInputFields, WireModel, field_error
from app.kl.estimators import Estimator, RewardPlacement


def _kl_schema(schema: dict[str, Any]) -> None:
    """The inputs' choice, and: whole sequences (text, tokens) count every token only when
    asked to (assistant_only: false), having no split to say which are the response's."""
    split_choices: Any = SplitInputFields.model_config.get("json_schema_extra")
    split_choices(schema)
    schema["allOf"] = [
        {
            "if": {"required": [name], "properties": {name: {"not": {"type": "null"}}}},
            "then": {
                "required": ["assistant_only"],
                "properties": {"assistant_only": {"const": False}},
            },
        }
        for name in ("text", "tokens")
    ]


class KLRequest(SplitInputFields):
    """Per-token KL between the policy (p) and the reference (q) on given sequences."""

    model_config = ConfigDict(json_schema_extra=_kl_schema)

    model: ServedName = Field(
        default="policy",
        description="The policy, or one of its LoRA adapters: then the reference is the base "
        "with the adapter off (unless a reference model is configured with ref_model).",
    )
    policy_log_probs: list[list[float]] | None = Field(
        default=None,
        description="Log-probs the client already holds (e.g. from generation), one list per "
        "sequence aligned with tokens.full; the server computes them when absent.",
    )
    estimator: Estimator = Field(
        default="k1",
        description="With d = log p - log q: k1 = d, abs = |d|, k2 = d^2/2, k3 = exp(-d) + d - 1.",
    )
    assistant_only: bool = Field(
        default=True,
        description="Count only assistant tokens (messages) or response tokens (a split). "
        "When false, every token but the first (which has no prediction) counts.",
    )
    coeff: float = Field(default=1.0, ge=0, le=1e6, description="KL penalty coefficient.")
    rewards: list[float] | None = Field(
        default=None, description="One sequence-level reward per sequence, to shape."
    )
    reward_placement: RewardPlacement = Field(
        default="last_token",
        description="last_token: reward on the last counted token and -coeff*kl on every "
        "counted token (OpenRLHF, verl). broadcast: reward - coeff*kl on every counted token "
        "(TorchRL's KLComputation).",
    )

    @model_validator(mode="after")
    def _check_counts(self) -> KLRequest:
        count = self.num_items()
        for name in ("policy_log_probs", "rewards"):
            values = getattr(self, name)
            if values is not None and len(values) != count:
                raise field_error(name, f"has {len(values)} entries for {count} sequences")
        return self


class KLSample(WireModel):
    tokens: TokenFields
    mask: list[int] = Field(description="1 where the token counts towards the KL.")
    kl: list[float]
    policy_log_probs: list[float]
    ref_log_probs: list[float]
    kl_sum: float
    kl_mean: float = Field(description="Mean over counted tokens (0.0 when none counts).")
    num_counted: int
    shaped_rewards: list[float] | None = None


class KLResponse(WireModel):
    policy_version: int
    estimator: Estimator
    outputs: list[KLSample]
