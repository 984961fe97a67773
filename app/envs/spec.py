"""A session's configuration in domain terms: what the episode engine reads, and what the
session store keeps (as JSON, the same shape as the wire model's dump)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from app.kl.estimators import Estimator


@dataclass(frozen=True)
class KLSpec:
    coeff: float
    estimator: Estimator
    model: str | None = None
    """The policy or LoRA adapter whose KL is penalised; None: the adapter that samples the
    episodes where the server knows it (/v1/rollouts), else the policy."""


@dataclass(frozen=True)
class EnvSpec:
    """`batch_size` parallel episodes sharing one configuration (see the wire `EnvConfig`)."""

    kind: str = "chat"  # chat, text or tokens
    system_prompt: str | None = None
    batch_size: int = 1
    max_turns: int | None = None
    reward: str = "none"
    reward_options: dict[str, Any] = field(default_factory=dict)
    tools: list[str] = field(default_factory=list)
    dataset: str | None = None
    repeats: int = 1
    seed: int | None = None
    kl: KLSpec | None = None
    hashing: bool = False

    def with_max_turns(self, max_turns: int) -> EnvSpec:
        return replace(self, max_turns=max_turns)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EnvSpec:
        kl = data.get("kl")
        return cls(**{**data, "kl": None if kl is None else KLSpec(**kl)})
