"""Load-gated session affinity for Ray Serve replicas (`rlserve serve --replicas N
--sticky-sessions`).

A session's requests (one `x-session-id` header: an environment's, a trajectory's or an
agent's id) go to the replica its id hashes to on Ray's consistent-hash ring, where the
replica's prefix cache holds the session so far, while that replica has fewer than
`load_threshold` requests in flight. Past it, the request goes to the least loaded of the
replicas the ring ranks for the session (the owner and its successors), so one loaded
replica does not hold back the sessions that hash to it while others idle. Correctness
never depends on the route: any replica serves any session (the sessions live in the shared
store), a replica without the prefix prefills it.

The load is Ray's own count of a replica's requests in flight: the router's running count
while it is under the threshold, else each ranked replica's answer to a probe."""

from __future__ import annotations

from typing import Any

from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter

DEFAULT_LOAD_THRESHOLD = 32
"""Requests in flight on a session's replica past which it may go elsewhere: one full batch
of the engine (`batching.max_batch_size`'s default)."""


class LoadGatedAffinity(ConsistentHashRouter):
    """Ray's consistent-hash router, its affinity gated by the owner's load (see the module)."""

    def initialize_state(self, **kwargs: Any) -> None:
        threshold = kwargs.pop("load_threshold", DEFAULT_LOAD_THRESHOLD)
        if not isinstance(threshold, int) or threshold <= 0:
            raise ValueError(f"load_threshold must be a positive int, got {threshold!r}")
        self.load_threshold = threshold
        super().initialize_state(**kwargs)

    async def loads(self, replicas: list[RunningReplica]) -> dict[Any, int]:
        """Each replica's requests in flight, as it answers a probe now (those that do not
        answer in time are left out)."""
        probed = await self._probe_queue_lens(replicas, 0)
        return {r.replica_id: int(n) for r, n in probed if n is not None}

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        ranks = await super().choose_replicas(candidate_replicas, pending_request)
        sticky = pending_request is not None and bool(pending_request.metadata.session_id)
        if not sticky or len(ranks) < 2 or any(len(rank) != 1 for rank in ranks):
            return ranks
        owner = ranks[0][0]
        # The router's running count (one more at each send, one less at each answer) is
        # trusted under the threshold; at or past it (where it can run ahead of the replica,
        # or be missing), every ranked replica is asked.
        cached = self._replica_queue_len_cache.get(owner.replica_id)
        if cached is not None and cached < self.load_threshold:
            return ranks
        loads = await self.loads([r for (r,) in ranks])
        if loads.get(owner.replica_id, self.load_threshold) < self.load_threshold:
            return ranks
        # Loaded: the least loaded first (the ring's order among equals, the owner first);
        # one that did not answer last.
        order = sorted(
            range(len(ranks)),
            key=lambda i: (loads.get(ranks[i][0].replica_id, float("inf")), i),
        )
        return [ranks[i] for i in order]
