"""Turns of a trajectory as token sequences: consecutive turns whose prompt extends everything
before it (the previous prompt and completion, token for token) form one segment; a turn whose
prompt does not (a chat template that re-renders history differently, e.g. one that drops
reasoning, or a completion cut at a stop string) starts a new segment, and the reply says
where the tokens first differ. Nothing is re-tokenized: every token is one the policy saw or
sampled.

A mixture-of-experts policy's routing, where the turns kept it, is assembled the same way: each
token's routing is that of the turn that first fed it to the model, so the tokens a turn
sampled are predicted under the routing they were sampled with."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from app.common.routed_experts import from_npy_base64
from app.trajectories.store import Turn


@dataclass
class Placed:
    """A turn's completion at positions [start, end) of its segment."""

    turn: int
    start: int
    end: int
    versions: list[tuple[int, int, int]]
    """(version, start, end) in segment positions."""
    finish_reason: str


@dataclass
class Segment:
    ids: list[int] = field(default_factory=list)
    assistant_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    turns: list[Placed] = field(default_factory=list)
    break_reason: str | None = None
    """Why this segment does not continue the previous one (None for the first)."""
    routed: list[np.ndarray] | None = field(default_factory=list)
    """Routing rows of ids[:-1], in pieces; None once a turn without routing joined."""

    @property
    def routed_experts(self) -> np.ndarray | None:
        """[len(ids) - 1, layers, top_k] expert ids, when every turn kept its routing."""
        if not self.routed:
            return None
        return np.concatenate(self.routed).astype(np.int64)

    def extend(self, index: int, turn: Turn) -> None:
        """Append `turn`, whose prompt starts with this segment's tokens."""
        if self.routed is not None:
            if turn.routed_experts is None:
                self.routed = None
            else:  # the rows of the tokens this turn fed first: from the previous last on
                fed = from_npy_base64(turn.routed_experts)
                self.routed.append(fed[max(len(self.ids) - 1, 0) :])
        new_prompt = turn.prompt_ids[len(self.ids) :]
        self.ids += new_prompt
        self.assistant_mask += [0] * len(new_prompt)
        self.log_probs += [0.0] * len(new_prompt)
        start = len(self.ids)
        self.ids += turn.completion_ids
        self.assistant_mask += [1] * len(turn.completion_ids)
        self.log_probs += turn.log_probs
        versions = [(v, start + a, start + b) for v, a, b in turn.versions]
        self.turns.append(Placed(index, start, len(self.ids), versions, turn.finish_reason))


def segments(turns: list[Turn]) -> list[Segment]:
    out: list[Segment] = []
    for index, turn in enumerate(turns):
        if out and turn.prompt_ids[: len(out[-1].ids)] == out[-1].ids:
            out[-1].extend(index, turn)
            continue
        reason = None
        if out:
            previous = out[-1]
            at = _first_difference(previous.ids, turn.prompt_ids)
            reason = (
                f"turn {index}'s prompt does not extend the tokens of turns "
                f"{previous.turns[0].turn}-{previous.turns[-1].turn}: they differ at token {at}"
            )
        segment = Segment(break_reason=reason)
        segment.extend(index, turn)
        out.append(segment)
    return out


def _first_difference(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
