"""A delta over the collective transfer. Where both sides hold the base, the trainer
broadcasts the bytes of a delta of the served weights (rlserve's format,
`rlserve_client.weight_delta`) as one uint8 tensor, `TRANSFER_NAME`, instead of every tensor.
Each receiver (every replica, at its own rank) stages it against its own weights and checks it
as an uploaded delta is, in the first phase of finish, so a wrong base, a checksum mismatch or
a NaN refuses the version on every replica before any commits; the commit then writes the
staged changes under the usual pause."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import safetensors.torch
from rlserve_client.weight_delta import TRANSFER_NAME, DeltaHeader

from app.common.failures import TooLarge, invalid
from app.common.roles import Role
from app.updates.service import WeightsService
from app.updates.types import Announcement
from app.weights.delta import Staged
from app.weights.transfer_engine import WeightTransfer

ROLE = Role.TENSOR_NAMES
"""What a received delta's refusals name: the update's announced tensor."""


@dataclass(frozen=True)
class ReceivedDelta:
    """A delta received and staged: its bytes (what a replica starting later replays) and
    its checked changes."""

    blob: bytes
    staged: Staged
    header: DeltaHeader


def check_announced(announced: Announcement, files: WeightsService) -> None:
    """A delta's announcement: one uint8 tensor of one dimension named `TRANSFER_NAME`, no
    larger than an upload may be."""
    shapes, dtypes = announced.shapes, announced.dtype_names
    if announced.names != [TRANSFER_NAME] or dtypes != ["uint8"] or len(shapes[0]) != 1:
        raise invalid(
            ROLE,
            f"a delta travels as one uint8 tensor of one dimension named '{TRANSFER_NAME}' "
            f"(announced: {announced.names[:3]} of {dtypes[:3]})",
        )
    limit = files.upload_limit()
    if shapes[0][0] > limit.bytes:
        raise TooLarge(
            f"the delta ({shapes[0][0]} bytes) exceeds {limit.setting} {limit.bytes}",
            role=ROLE,
        )


async def stage_received(
    engine: WeightTransfer, files: WeightsService, model: str
) -> ReceivedDelta:
    """The delta `engine` received, staged against `model`'s served weights."""
    data = await engine.checkpoint()
    tensor = (await asyncio.to_thread(safetensors.torch.load, data))[TRANSFER_NAME]
    blob = tensor.numpy().tobytes()
    staged, header = await files.stage_delta_bytes(blob, model, ROLE)
    return ReceivedDelta(blob, staged, header)
