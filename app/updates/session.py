"""A weight update that a trainer drives over several calls of a dialect, as the server (or
the whole deployment) records it: SGLang's `/begin_weight_update` … `/end_weight_update`,
buckets sent while paused (committed at `/continue_generation`), and AReaL's tensors named in
one call and received in the next. `WeightsControl` keeps it where every replica reads the
same record, so a call may reach any replica of a deployment; `app.updates.driven` runs the
flow on it."""

from __future__ import annotations

from dataclasses import dataclass, replace
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
    serial: int = 0
    """The writes the record has taken: a write names the serial it read (`SessionRecord`)."""
    opened: int | None = None
    """The serial at which the open session opened: its identity (None: none is open)."""
    published: bool = False
    """The trainer publishes its versions to a folder (SkyRL's checkpoint-delta backend, set
    at its init): an update loads the version it names, pulled there; the start and finish
    of vLLM's update change nothing."""


class SessionRecord:
    """The one session record of a server, or of a whole deployment (in its ledger), written
    by compare-and-set only: calls that reach two replicas at once each read the record, and a
    write that another write overtook is refused instead of undoing it."""

    def __init__(self) -> None:
        self.current = UpdateSession()

    def swap(self, serial: int, new: UpdateSession) -> UpdateSession | None:
        """`new` in place of the record read at `serial`: the record written, or None when
        another write came first. The record numbers the writes and keeps the identity of
        the session open (a kind after none opens one; no kind closes it)."""
        if serial != self.current.serial:
            return None
        if new.kind is None:
            opened = None
        elif self.current.kind is None:
            opened = serial + 1
        else:
            opened = self.current.opened
        self.current = replace(new, serial=serial + 1, opened=opened)
        return self.current

    def reset(self) -> None:
        """No session open, nothing announced (the trainer's group is gone): a write that
        read the record before this one is refused."""
        self.current = UpdateSession(serial=self.current.serial + 1)
