"""A reward model served beside the policy: a transformers sequence-classification model (a
decoder with a `score` head, as RLHF reward models are), its calls batched like scoring.

A row's reward is the head's output where the model's own forward pools it: its last token that
is not the pad token (`AutoModelForSequenceClassification`'s rule, so a sequence ending in an
end-of-text token that is also the pad token is read before it); the head's output at every
token comes with it (a process reward model reads those). Rows are left-padded with explicit
position ids, so a row's values do not depend on the rows beside it beyond float rounding."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from app.batching import Batcher, BatchingConfig
from app.common.inputs import InputPreparer, Prepared, naming
from app.common.lane import Lane
from app.engine.base import Capabilities, ModelWeights
from app.engine.transformers.decode import padded
from app.engine.types import ModelInfo
from app.weights.checkpoint import Layout, copy_into, layout_of_state
from app.weights.delta import Change, state_checksums, write_changes
from app.weights.expert_names import checkpoint_views
from app.weights.staging import adopt
from app.weights.transfer_engine import InProcessTransfer, WeightTransfer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rewarded:
    """One row's head outputs: at its last token (`num_labels` values), and at every token
    ([tokens, num_labels], float32 on the CPU)."""

    reward: list[float]
    values: torch.Tensor
    version: int = 0
    """The version of the weights that scored it."""


class RewardModel(ModelWeights):
    """Its weights change through the one weights control (`app.updates`), as the policy's
    do: by file, delta, snapshot or collective transfer, on every replica. Its calls are not
    admitted by the serving gate (a policy pause does not hold rewards); an update of its own
    weights holds them off instead (`writes`), so no call reads a half-written model and
    each reward carries the version of the weights that computed it."""

    capabilities = Capabilities(weight_transfer=True, weight_deltas=True)

    def __init__(
        self, model: Any, tokenizer: Any, info: ModelInfo, batching: BatchingConfig | None
    ) -> None:
        self.model = model
        self.info = info
        self.num_labels = int(model.config.num_labels)
        pad = model.config.get_text_config().pad_token_id
        self.pooling_pad: int | None = int(pad) if pad is not None else None
        """The token the head is not read at (the model config's pad token)."""
        self.preparer = InputPreparer(
            tokenizer, vocab_size=info.vocab_size, max_model_len=info.max_model_len
        )
        self.version = 0
        """Its weights' version (0 as loaded; the gate's count, `set_version`)."""
        self._lane = Lane("reward-model")
        self._writing = asyncio.Lock()
        """Held by every call and by an update of the weights (`writes`)."""
        self._transfer: InProcessTransfer | None = None
        self._batcher: Batcher[list[int], Rewarded] | None = None
        if batching is not None:
            self._batcher = Batcher("reward", self._call, len, batching)

    @classmethod
    def load(
        cls,
        source: str,
        *,
        dtype: str,
        device: str,
        max_model_len: int | None,
        trust_remote_code: bool,
        builtin: bool,
        batching: BatchingConfig | None,
    ) -> RewardModel:
        """Load it (blocking: call off the event loop). A model whose head is not a `score`
        layer on a decoder (BERT's pooler and classifier) is refused: its pooling is not the
        last token's."""
        from transformers import AutoModelForSequenceClassification

        from app.engine.transformers.backend import load_pretrained, model_info

        model, tokenizer = load_pretrained(
            AutoModelForSequenceClassification,
            source,
            dtype=dtype,
            device=device,
            trust_remote_code=trust_remote_code,
        )
        if not isinstance(getattr(model, "score", None), torch.nn.Module):
            raise ValueError(
                f"{source}: {type(model).__name__} has no `score` head on a decoder; a reward "
                "model is a causal LM's sequence-classification model (…ForSequenceClassification "
                "of Llama, Qwen2, Mistral, Gemma, ...), read at its last token"
            )
        info = model_info(
            model,
            name="reward",
            source=source,
            device=device,
            max_model_len=max_model_len,
            builtin=builtin,
        )
        return cls(model, tokenizer, info, batching)

    async def read(
        self, build: Callable[[InputPreparer], list[Prepared]], field: str, cost: float = 0.0
    ) -> tuple[list[Prepared], list[Rewarded]]:
        """The sequences `build` prepares with the reward model's tokenizer (off the event
        loop), each checked against its vocabulary and length (refusals name `field[i]`), and
        their head outputs."""

        def checked() -> list[Prepared]:
            with naming(field):  # (unless `build` names each item itself)
                items = build(self.preparer)
            self.preparer.check(items, field)
            return items

        items = await self.preparer.off_loop(checked, cost=cost)
        sequences = [item.ids for item in items]
        scored = await self.score(sequences)
        for _ in range(2):  # (a load landed between two calls of its rows: once more, whole)
            if len({values.version for values in scored}) <= 1:
                break
            scored = await self.score(sequences)
        return items, scored

    async def score(self, sequences: Sequence[list[int]]) -> list[Rewarded]:
        """Each sequence's head outputs (batched with other requests' rows when batching is
        on)."""
        if self._batcher is not None:
            return await self._batcher.submit(list(sequences))
        return await self._call(list(sequences))

    async def _call(self, sequences: list[list[int]]) -> list[Rewarded]:
        async with self._writing:
            return await self._lane.run(self._forward, sequences)

    @torch.inference_mode()
    def _forward(self, sequences: list[list[int]]) -> list[Rewarded]:
        model, version = self.model, self.version  # (loads run on this lane too)
        device = next(model.parameters()).device
        width = max(len(ids) for ids in sequences)
        ids, mask = padded(sequences, self.preparer.pad_token_id, device, left=True)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        base = getattr(model, model.base_model_prefix)
        hidden = base(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
        values = model.score(hidden).float().cpu()
        rows = [values[row, width - len(sequence) :] for row, sequence in enumerate(sequences)]
        return [
            Rewarded(row[self._pooled(sequence)].tolist(), row, version)
            for row, sequence in zip(rows, sequences, strict=True)
        ]

    def _pooled(self, sequence: list[int]) -> int:
        """Where the model's forward reads a sequence's reward: its last token that is not the
        pad token (the first token when every one is)."""
        if self.pooling_pad is None:
            return len(sequence) - 1
        return max((i for i, t in enumerate(sequence) if t != self.pooling_pad), default=0)

    # -- its weights (`ModelWeights`): changed under `writes`, so between two of its calls --

    def weight_layout(self) -> Layout:
        return layout_of_state(checkpoint_views(self.model))

    async def update_weights(self, files: list[Path]) -> None:
        await self._lane.run(copy_into, checkpoint_views(self.model), files)

    def served_tensor(self, name: str) -> torch.Tensor | None:
        return checkpoint_views(self.model).get(name)

    async def write_tensors(self, changes: dict[str, Change]) -> None:
        await self._lane.run(write_changes, checkpoint_views(self.model), changes)

    def weight_checksums(
        self, names: Iterable[str] | None = None, known: Mapping[str, str] | None = None
    ) -> dict[str, str] | None:
        return state_checksums(self.model.state_dict(), names, known)

    def transfer(self) -> WeightTransfer:
        if self._transfer is None:
            self._transfer = InProcessTransfer(self.model.device, partial(adopt, self.model))
        return self._transfer

    async def set_version(self, version: int, *, keep_cache: bool = False) -> None:
        self.version = version

    @contextlib.asynccontextmanager
    async def _held(self) -> AsyncIterator[None]:
        async with self._writing:
            yield

    def writes(self) -> contextlib.AbstractAsyncContextManager[None]:
        return self._held()

    async def aclose(self) -> None:
        if self._batcher is not None:
            await self._batcher.aclose()
        self._lane.close(wait=False)
        self.preparer.close()
