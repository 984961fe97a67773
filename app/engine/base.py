"""The backend contract: one small async interface that every model engine implements."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from app.common.roles import Role
from app.engine.types import (
    GenerateItem,
    Generation,
    ModelInfo,
    PrefixCacheStats,
    Scores,
    ScoreSpec,
)
from app.weights.checkpoint import Layout
from app.weights.lora import AdapterBuild

if TYPE_CHECKING:
    import torch
    from rlserve_client.moe import Routing

    from app.weights.delta import Change
    from app.weights.lora import LoraAdapter
    from app.weights.transfer_engine import WeightTransfer


ScoreItem = tuple[Sequence[int], ScoreSpec]


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do, declared once; services and batching read these."""

    weight_transfer: bool = False
    """Receives weights over a collective (`Backend.transfer`)."""
    processed_log_probs: bool = False
    """Reports log-probs of the processed (temperature, top-k/p) distribution it sampled."""
    streamed_log_probs: Literal["raw", "processed"] = "raw"
    """Which log-probs a GenerateItem's sink is told as tokens are sampled."""
    continuous_batching: bool = False
    """Batches generation itself: rows go straight to the engine, one call each."""
    prompt_scores: bool = False
    """Scores a prompt (top-k, ranks) in the same engine pass that generates from it
    (`GenerateItem.prompt_asks`); otherwise the service scores prompts in a pass of their own."""
    batch_invariant: bool = False
    """A call with one row computes it as every other such call does, bitwise: the engine
    batches nothing across calls (batch-invariant mode runs each row in a call of its own)."""
    adapters: bool = False
    """Serves LoRA adapters (`Backend.build_adapter`), rows of several in one call."""
    weight_deltas: bool = False
    """Shows its live tensors and takes tensors by name (`Backend.served_tensor`,
    `write_tensors`): updates may be deltas of the served weights (`app.weights.delta`)."""
    routed_experts: bool = False
    """A mixture-of-experts model whose routing it records (`SamplingConfig.
    return_routed_experts`) and replays (`ScoreSpec.routed_experts`): `Backend.routing`."""


class ModelWeights(ABC):
    """A served model's weights as the weights control sees them (`app.updates`): their
    layout, their update by file, by tensor or over a collective transfer, their checksums,
    and the hooks a pause calls. Every served model has them: the policy, the reference and
    the judge (a `Backend`), and the reward model (`app.engine.transformers.reward`)."""

    info: ModelInfo
    capabilities: Capabilities = Capabilities()

    def weight_layout(self) -> Layout | None:
        """Names, dtypes and shapes an update may carry; None when unknown (not checked)."""
        return None

    def check_update(self, names: set[str], role: Role) -> None:  # noqa: B027
        """Raise (naming `role`) if this engine cannot apply a file update of exactly these
        tensors, beyond what the layout check covers."""

    async def update_weights(self, files: list[Path]) -> None:
        """Copy the tensors of checked safetensors files into the live model."""
        raise NotImplementedError(f"{type(self).__name__} cannot update weights")

    def served_tensor(self, name: str) -> torch.Tensor | None:
        """The live tensor a checkpoint names `name` (read, never written, by the caller);
        None when this engine cannot show its weights (then deltas and digests are not
        offered: `app.weights.delta`)."""
        return None

    def delta_base_refusal(self) -> str | None:
        """Why the served values cannot be a delta's base now, on an engine that takes deltas
        (`Capabilities.weight_deltas`); None: they can."""
        return None

    async def write_tensors(self, changes: dict[str, Change]) -> None:
        """Write checked changes (by checkpoint name) into the live model: a tensor copied
        whole, or a `Patch`'s bytes scattered (`app.weights.delta`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot write tensors")

    def weight_checksums(
        self, names: Iterable[str] | None = None, known: Mapping[str, str] | None = None
    ) -> dict[str, str] | None:
        """The checksums (`rlserve_client.weight_delta.DIGEST`) of the model's own tensors
        (its `state_dict()` names; with `names`, of those and the names tied to them, taking
        the `known` checksums as they are), or None when this engine cannot show its
        weights. Called off the event loop."""
        return None

    def transfer(self) -> WeightTransfer:
        """The server side of the collective weight transfer (when `capabilities` says so)."""
        raise NotImplementedError(f"{type(self).__name__} cannot receive weight transfers")

    # -- pausing (see app.engine.gate): only called while no new request is admitted ---------

    async def freeze(self) -> None:  # noqa: B027 - engines without generation state
        """Hold in-flight generations at their next token; return once no model call runs."""

    async def thaw(self) -> None:  # noqa: B027
        """Let frozen generations continue."""

    async def abort_generations(self) -> None:  # noqa: B027
        """End in-flight generations at their next token (finish_reason "abort")."""

    async def set_version(self, version: int, *, keep_cache: bool = False) -> None:  # noqa: B027
        """Label the tokens generated from now on with `version` (weights just committed).
        An engine with a prefix cache drops what it cached of the old weights, unless
        `keep_cache` (a snapshot loaded with the cache policy 'keep')."""

    def writes(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Held while this model's weights change, inside the gate's pause: a model whose
        calls the gate does not admit (the reward model's) holds them off here."""
        return contextlib.nullcontext()

    async def aclose(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release the model and any worker processes or threads."""


class Backend(ModelWeights):
    """A loaded language model. Methods take whole batches; batching policy lives outside."""

    tokenizer: Any
    routing: Routing | None = None
    """A mixture-of-experts model's routers (their layers, top-k and experts), when the engine
    records and replays them (`Capabilities.routed_experts`)."""

    @abstractmethod
    async def generate(self, items: Sequence[GenerateItem]) -> list[Generation]:
        """One Generation per item, in order."""

    @abstractmethod
    async def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Per sequence, log p(x_t | x_<t) for every position; position 0 is 0.0."""

    async def score_detailed(self, items: Sequence[ScoreItem]) -> list[Scores]:
        """Per (sequence, spec): the raw log-probs and the extras the spec asks for."""
        raise NotImplementedError(f"{type(self).__name__} cannot score beyond log-probs")

    def prefix_cache(self) -> PrefixCacheStats | None:
        """The hit rate and memory of the engine's own prefix cache, where rlserve keeps it
        (None: none, or the engine reports its own)."""
        return None

    def full_distribution_limit(self) -> int | None:
        """The longest sequence whose whole next-token distribution (entropy, processed
        log-probs, candidate ids) this engine scores; None: any (it works in chunks)."""
        return None

    async def check(self) -> None:
        """Raise if the engine cannot serve: by default, score a two-token sequence (a real
        forward through the model, as a readiness probe should make)."""
        await self.score([[0, 0]])

    def stepped_at(self) -> float:
        """time.monotonic() of the engine's last step inside a call still in flight (a long
        batch's last forward): as good a sign of life as a call that returned. 0.0 when the
        engine does not say."""
        return 0.0

    async def build_adapter(self, build: AdapterBuild) -> LoraAdapter:
        """A LoRA adapter (PEFT's config and tensor names) on this model, ready for rows to
        name it (`GenerateItem.adapter`, `ScoreSpec.adapter`); raise naming the role
        `Role.ADAPTER_SOURCE` if it does not fit the model."""
        raise NotImplementedError(f"{type(self).__name__} cannot serve LoRA adapters")

    def forget_adapter(self, adapter: LoraAdapter) -> None:
        """`adapter` is no longer served: drop what the engine keeps of it for later requests
        (caches built for it), so rows in flight hold its memory alone."""
