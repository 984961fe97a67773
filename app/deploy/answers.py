"""The replicas' answers to one step, read as one: the results, or the refusal that says
why (as the failure it was on its replica, with how many refused)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import TypeVar

from app.common.failures import TimedOut
from app.deploy.replica import Refusal
from app.engine.gate import GateState
from app.updates.types import TransferStatus

T = TypeVar("T")


def of_kind(results: list[T | Refusal], kind: type[T]) -> list[T]:
    """The answers that are not refusals."""
    return [r for r in results if isinstance(r, kind)]


def serving(states: list[GateState | Refusal]) -> GateState:
    if failed := [s for s in states if isinstance(s, Refusal)]:
        raise failed[0].failure(f"{len(failed)} of {len(states)} replicas failed")
    return of_kind(states, GateState)[0]


def cause(refused: list[Refusal]) -> Refusal:
    """The refusal that says why: the first that is not a replica timing out (which the
    others waiting on a failed one do)."""
    return next((r for r in refused if not isinstance(r.raised, TimedOut)), refused[0])


_STATES = ("idle", "joined", "updating")


def combined(model: str, answers: list[TransferStatus | Refusal]) -> TransferStatus:
    """The replicas' transfer states as one: the least advanced state, every replica's
    ranks, and why the replicas disagree when they do (one started after the group
    formed, and is not in it)."""
    if failed := [a for a in answers if isinstance(a, Refusal)]:
        raise cause(failed).failure(f"{len(failed)} of {len(answers)} replicas")
    states = of_kind(answers, TransferStatus)
    least = min(states, key=lambda s: _STATES.index(s.state))
    counts = Counter(s.state for s in states)
    last_error = next((s.last_error for s in states if s.last_error), None)
    if len(counts) > 1:
        described = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
        last_error = (
            f"the replicas disagree ({described}): one that started after init is not in the "
            "group; close it and init again"
        )
    joined = next((s for s in states if s.state != "idle"), least)
    return replace(
        least,
        server_ranks=sum(s.server_ranks for s in states),
        transport=joined.transport,
        world_size=joined.world_size,
        packing=joined.packing,
        last_error=last_error,
        replicas=len(states),
    )
