"""Weights pushed over HTTP as deltas: `WeightPusher` sends the first push whole, keeps what it
sent (the server's base from then on) and sends each later push as the change from it
(`weight_delta`), falling back to a whole push when the server serves something else (another
trainer pushed, the server restarted). Needs the `[torch]` extra."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rlserve_client._client import Client
from rlserve_client._exceptions import ConflictError
from rlserve_client.types import WeightsUpdated
from rlserve_client.weight_delta import DeltaEncoder, weights_digest

logger = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Pushed:
    """One push: the server's answer and what it cost."""

    updated: WeightsUpdated
    delta: bool
    """Sent as a delta (False: whole)."""
    sent_bytes: int
    full_bytes: int
    """What a whole push of the same tensors sends."""
    changed_share: float
    """The share of bytes that changed (1.0 for a whole push)."""
    encode_s: float
    send_s: float
    digest_ok: bool | None
    """Whether the served digest equals that of the pushed tensors (None: the server shows
    none). It says the server serves exactly them when they are all the model's (a
    `state_dict()`); a push of some tensors leaves the others in the served digest."""

    @property
    def saved(self) -> float:
        """The share of a whole push's bytes this push did not send."""
        return 1.0 - self.sent_bytes / max(self.full_bytes, 1)


class WeightPusher:
    """Pushes `model`'s weights to `client`'s server, as deltas of its last push when it can.
    `state` tensors are cast to the served dtype (read from the server's model card unless
    `dtype` is given) before anything is compared or sent. It keeps a host copy of the last
    push, the base of the next delta."""

    def __init__(
        self,
        client: Client,
        *,
        model: str = "policy",
        dtype: torch.dtype | None = None,
        encoding: str = "auto",
    ) -> None:
        self.client = client
        self.model = model
        self.dtype = dtype
        self.encoder = DeltaEncoder(encoding=encoding)

    def _served_dtype(self) -> torch.dtype:
        if self.dtype is None:
            self.dtype = served_dtype(self.client, self.model)
        return self.dtype

    def push(
        self,
        state: Mapping[str, torch.Tensor],
        *,
        version: int | None = None,
        pause: str = "keep",
    ) -> Pushed:
        every, cast = host_copies(state, self._served_dtype())
        full_bytes = sum(t.numel() * t.element_size() for t in cast.values())
        if self.encoder.covers(cast):
            try:
                return self._send(cast, every, full_bytes, version, pause, delta=True)
            except ConflictError as exc:  # not the base it was built on: push whole
                logger.warning("the delta was refused (%s); pushing the whole weights", exc)
        return self._send(cast, every, full_bytes, version, pause, delta=False)

    def _send(
        self,
        cast: dict[str, torch.Tensor],
        every: dict[str, torch.Tensor],
        full_bytes: int,
        version: int | None,
        pause: str,
        *,
        delta: bool,
    ) -> Pushed:
        """`cast` encoded as a delta of the last push (or whole: one safetensors file), sent
        and remembered as the next base; `every` is it under each of its names."""
        from safetensors.torch import save

        started = time.perf_counter()
        if delta:
            encoded = self.encoder.encode(cast, version)
            blob, share = encoded.blob, encoded.changed_share
        else:
            blob, share = save({name: t.contiguous() for name, t in cast.items()}), 1.0
        encoded_at = time.perf_counter()
        updated = self.client.upload_weights(
            payload=blob, model=self.model, version=version, pause=pause, progress=False
        )
        sent_at = time.perf_counter()
        ok = self._remember(cast, every, updated)
        return Pushed(
            updated,
            delta,
            len(blob),
            full_bytes,
            share,
            encoded_at - started,
            sent_at - encoded_at,
            ok,
        )

    def _remember(
        self,
        cast: dict[str, torch.Tensor],
        every: dict[str, torch.Tensor],
        updated: WeightsUpdated,
    ) -> bool | None:
        self.encoder.remember(cast, served_version(updated, self.model), updated.digest)
        return None if updated.digest is None else weights_digest(every) == updated.digest


def served_dtype(client: Any, model: str) -> torch.dtype:
    """The dtype `client`'s server serves `model` in (its model card's)."""
    cards = client.models().models
    card = next((c for c in cards if c.name == model), cards[0])
    return _DTYPES.get(card.dtype, torch.float32)


def host_copies(
    state: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """`state` on the host in `dtype` (floating-point tensors cast) under every name, and
    under each tensor's first name only (a tensor under two names, as tied embeddings are,
    travels once: the server writes both)."""
    every = {
        name: (t.detach().to(dtype) if t.is_floating_point() else t.detach()).cpu()
        for name, t in state.items()
    }
    return every, {name: every[name] for name in _first_names(state)}


def served_version(updated: WeightsUpdated, model: str) -> int:
    """The version `model` serves after `updated` (a server that names only the policy's
    and the reference's: theirs)."""
    if updated.version is not None:
        return updated.version
    return updated.policy_version if model == "policy" else updated.reference_version


def _first_names(state: Mapping[str, torch.Tensor]) -> list[str]:
    """Each tensor's first name (a tensor under several names, as tied embeddings are, once)."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    names = []
    for name, tensor in state.items():
        key = (
            tensor.untyped_storage().data_ptr(),
            int(tensor.storage_offset()),
            tuple(tensor.shape),
        )
        if key not in seen:
            seen.add(key)
            names.append(name)
    return names
