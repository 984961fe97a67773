"""A weight update that a trainer drives over several calls of a dialect, as the server (or
the whole deployment) records it: SGLang's `/begin_weight_update` … `/end_weight_update`,
buckets sent while paused (committed at `/continue_generation`), and AReaL's tensors named in
one call and received in the next. `WeightsControl` keeps it where every replica reads the
same record, so a call may reach any replica of a deployment."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SessionKind = Literal["explicit", "paused"]
"""explicit: opened by a begin, committed at its end; paused: buckets sent while serving was
paused, committed when it resumes."""


@dataclass(frozen=True)
class Bucket:
    """Tensors a trainer announces for its next broadcast."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    flattened: bool
    """One broadcast of all their bytes back to back (else one per tensor)."""
    version: int | None
    """The version the update publishes (None: the next one)."""
    abort_all: bool
    """End the generations in flight before receiving."""


@dataclass(frozen=True)
class UpdateSession:
    kind: SessionKind | None = None
    """The open session's kind; None: none is open."""
    version: int | None = None
    """The version the session's buckets named last (None: the next one)."""
    announced: Bucket | None = None
    """Tensors named for the next receive (AReaL's meta call), not received yet."""
