"""One weight update over every replica of a Ray Serve deployment, as a transaction, with Ray
Serve's own fan-out (`DeploymentHandle.broadcast`) and the deployment's ledger
(app.deploy.ledger):

1. the replica that received the update reads the checkpoint once (so the path need only be
   readable there) and puts it in Ray's object store; it waits for the model's update lease,
   so updates never interleave;
2. every replica copies it into its own data and checks it (layout, finite values), serving
   untouched;
3. if any replica failed, every replica drops its copy and the update is refused with that
   replica's error: all stay on the old version;
4. otherwise the ledger records the checkpoint under its new version (a replica starting from
   now on catches up to it), and every replica swaps it in under that version.

Step 4 only swaps checked tensors; a replica that still fails there (its device, say) is
reported, and Ray's health check replaces it with one that catches up."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal

from app.common import failures
from app.common.failures import Conflict, Failure, InvalidInput, PeerFailed
from app.engine.gate import GateState
from app.weights.protocol import (
    PauseMode,
    TransferFinish,
    TransferInit,
    TransferState,
    TransferUpdate,
    UpdateOptions,
    WeightsUpdated,
)

if TYPE_CHECKING:
    from app.weights.service import WeightsService
    from app.weights.transfer import TransferService

logger = logging.getLogger(__name__)


class ReplicaFanout:
    def __init__(self, app_name: str, deployment: str, generation: str, wait_s: float) -> None:
        self.app_name = app_name
        self.deployment = deployment
        self.generation = generation
        self.wait_s = wait_s
        """How long an update waits for another one to finish (and holds its lease)."""

    def _handle(self) -> Any:
        from ray import serve

        return serve.get_deployment_handle(self.deployment, self.app_name)

    def _ledger(self) -> Any:
        from app.deploy.ledger import ledger

        return ledger(self.app_name, self.generation)

    async def update(
        self, files: dict[str, bytes], model: str, options: UpdateOptions, param: str
    ) -> WeightsUpdated:
        import ray

        handle = self._handle()
        shipped = ray.put(files)

        async def files_ref() -> Any:
            return shipped

        async def commit(update_id: str, chosen: dict[str, Any]) -> list[dict[str, Any]]:
            return await _everywhere(handle, "weights_commit", update_id, model, chosen)

        return await self._transaction(
            model,
            options,
            stage=lambda update_id: _everywhere(
                handle, "weights_stage", update_id, shipped, model, param
            ),
            files=files_ref,
            abort=lambda update_id, _: _everywhere(handle, "weights_abort", update_id),
            commit=commit,
        )

    async def transfer_finish(
        self, request: TransferFinish, here: TransferService
    ) -> WeightsUpdated:
        """The collective transfer's finish over every replica, as one transaction: all
        received and checked the update, then all swap it in under one version. The ledger
        keeps what this replica received (a replica that starts later was not in the group)."""
        import ray

        handle, model = self._handle(), request.model

        async def files_ref() -> Any:
            return ray.put({"model.safetensors": await here.checkpoint(model)})

        async def abandon(_: str, problem: Failure) -> list[dict[str, Any]]:
            reason = {"kind": type(problem).__name__, "message": problem.message}
            return await _everywhere(handle, "transfer_abandon", model, reason)

        async def commit(_: str, chosen: dict[str, Any]) -> list[dict[str, Any]]:
            return await _everywhere(handle, "transfer_commit", {"model": model, **chosen})

        return await self._transaction(
            model,
            request,
            stage=lambda _: _everywhere(handle, "transfer_received", model),
            files=files_ref,
            abort=abandon,
            commit=commit,
        )

    async def _transaction(
        self,
        model: str,
        options: UpdateOptions,
        *,
        stage: Callable[[str], Awaitable[list[dict[str, Any]]]],
        files: Callable[[], Awaitable[Any]],
        abort: Callable[[str, Failure], Awaitable[Any]],
        commit: Callable[[str, dict[str, Any]], Awaitable[list[dict[str, Any]]]],
    ) -> WeightsUpdated:
        """Stage on every replica (each answers the version it serves, or its error), decide
        in the ledger (with the checkpoint a later replica catches up to), then commit on
        every replica, or abort on every one; the model's lease is held throughout."""
        ledger, update_id = self._ledger(), uuid.uuid4().hex
        await self._acquire(ledger, model, update_id)
        try:
            staged = await stage(update_id)
            refused = [r for r in staged if "error" in r]
            current = max((int(r["version"]) for r in staged if "error" not in r), default=0)
            problem: Failure | None = None
            if refused:
                problem = as_failure(
                    _cause(refused), f"{len(refused)} of {len(staged)} replicas refused it"
                )
            elif options.version is not None and options.version <= current:
                problem = Conflict(
                    f"version: {options.version} is not above the current version {current} "
                    f"of '{model}'",
                    param="version",
                )
            version = options.version or current + 1
            if problem is None and not await ledger.decide.remote(
                model, update_id, version, [await files()]
            ):
                problem = Conflict(
                    f"the update of '{model}' took over {self.wait_s:g} s and lost its turn to "
                    "a later one; send it again",
                    param="model",
                )
            if problem is not None:
                await abort(update_id, problem)
                raise problem
            committed = await commit(update_id, {"version": version, "pause": options.pause})
        finally:
            await ledger.release.remote(model, update_id)
        failed = [r for r in committed if "error" in r]
        if failed:
            raise PeerFailed(
                f"{len(failed)} of {len(committed)} replicas failed to swap in version "
                f"{version} after all had checked it: {failed[0]['error']['message']}"
            )
        return WeightsUpdated.model_validate(
            next(r["updated"] for r in committed if "updated" in r)
        )

    async def _acquire(self, ledger: Any, model: str, update_id: str) -> None:
        """Wait for `model`'s update lease (another update holds it while it runs)."""
        deadline = time.monotonic() + self.wait_s
        while not await ledger.acquire.remote(model, update_id, self.wait_s):
            if time.monotonic() > deadline:
                raise Conflict(
                    f"another update of '{model}' has been running for over {self.wait_s:g} s; "
                    "try again later",
                    param="model",
                )
            await asyncio.sleep(0.2)

    async def catch_up(self, weights: WeightsService) -> None:
        """Apply what the ledger says every replica serves (a starting replica, before it
        takes traffic): each model's last committed checkpoint, and a pause in force."""
        from app.deploy.ledger import remove_earlier

        if removed := await asyncio.to_thread(remove_earlier, self.app_name, self.generation):
            logger.info("removed %d ledgers of earlier deployments", removed)
        state = await self._ledger().state.remote()
        for model, (version, [ref]) in state["models"].items():
            if weights.registry.versions.get(model, version) < version:
                await weights.adopt(model, version, await ref)
                logger.info("caught up with version %d of %s", version, model)
        if state["paused"] is not None:
            await weights.pause(state["paused"], here_only=True)
            logger.info("paused (%s), as every replica is", state["paused"])

    async def pause(self, mode: PauseMode) -> GateState:
        await self._ledger().record_pause.remote(mode)  # first: a replica starting meanwhile
        return await self._serving("serving_pause", mode)

    async def resume(self) -> GateState:
        await self._ledger().record_pause.remote(None)
        return await self._serving("serving_resume")

    # -- the collective transfer's group over every replica ---------------------------------

    async def transfer_state(self, model: str) -> TransferState:
        return _combined(model, await _everywhere(self._handle(), "transfer_state", model))

    async def transfer_init(self, request: TransferInit) -> TransferState:
        """Every replica joins the trainer's group at once, at consecutive ranks from
        `rank_offset` (in replica id order); if any cannot, every replica leaves it."""
        handle = self._handle()
        counted = await _everywhere(handle, "transfer_ranks", request.model)
        if failed := [r for r in counted if "error" in r]:
            raise as_failure(failed[0], f"{len(failed)} of {len(counted)} replicas")
        offsets, next_rank = {}, request.rank_offset
        for replica in sorted(counted, key=lambda r: r["replica"]):
            offsets[replica["replica"]] = next_rank
            next_rank += replica["ranks"]
        if next_rank > request.world_size:
            raise InvalidInput(
                f"world_size: {request.world_size} leaves no room for the "
                f"{next_rank - request.rank_offset} ranks of {len(counted)} replicas from "
                f"rank_offset {request.rank_offset} (GET /v1/weights/transfer counts them)",
                param="world_size",
            )
        joined = await _everywhere(handle, "transfer_join", request.model_dump(), offsets)
        if failed := [r for r in joined if "error" in r]:
            await _everywhere(handle, "transfer_step", "close", request.model)
            raise as_failure(
                _cause(failed), f"{len(failed)} of {len(joined)} replicas could not join"
            )
        return _combined(request.model, joined)

    async def transfer_step(
        self, step: Literal["start", "abort", "close"], model: str
    ) -> TransferState:
        """`step` on every replica; a start that fails on one is aborted on all."""
        handle = self._handle()
        states = await _everywhere(handle, "transfer_step", step, model)
        if step == "start" and any("error" in s for s in states):
            await _everywhere(handle, "transfer_step", "abort", model)
        return _combined(model, states)

    async def transfer_update(self, request: TransferUpdate) -> TransferState:
        """Announce the tensors to every replica; if one refuses, every replica drops the
        update (the trainer sends nothing after a refusal)."""
        handle = self._handle()
        states = await _everywhere(handle, "transfer_update", request.model_dump())
        if any("error" in s for s in states):
            await _everywhere(handle, "transfer_step", "abort", request.model)
        return _combined(request.model, states)

    async def _serving(self, method: str, *args: Any) -> GateState:
        states = await _everywhere(self._handle(), method, *args)
        failed = [s for s in states if "error" in s]
        if failed:
            raise as_failure(failed[0], f"{len(failed)} of {len(states)} replicas failed")
        return GateState(**states[0]["state"])


async def _everywhere(handle: Any, method: str, *args: Any) -> list[dict[str, Any]]:
    """`method` on every replica; a replica that could not answer counts as an error."""
    results = await handle.broadcast(method, *args).results_async(return_exceptions=True)
    return [
        r if isinstance(r, dict) else {"error": {"kind": "PeerFailed", "message": str(r)}}
        for r in results
    ]


def _cause(failed: list[dict[str, Any]]) -> dict[str, Any]:
    """The failure that says why: the first that is not a replica timing out (which the
    others waiting on a failed one do)."""
    return next((r for r in failed if r["error"]["kind"] != "TimedOut"), failed[0])


_STATES = ("idle", "joined", "updating")


def _combined(model: str, answers: list[dict[str, Any]]) -> TransferState:
    """The replicas' transfer states as one: the least advanced state, every replica's
    ranks, and why the replicas disagree when they do (one started after the group
    formed, and is not in it)."""
    if failed := [a for a in answers if "error" in a]:
        raise as_failure(_cause(failed), f"{len(failed)} of {len(answers)} replicas")
    states = [TransferState.model_validate(a["state"]) for a in answers]
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
    return least.model_copy(
        update={
            "server_ranks": sum(s.server_ranks for s in states),
            "transport": joined.transport,
            "world_size": joined.world_size,
            "last_error": last_error,
            "replicas": len(states),
        }
    )


def as_failure(result: dict[str, Any], context: str) -> Failure:
    """A replica's refusal as the failure it raised there (same status, same field)."""
    error = result["error"]
    kind = getattr(failures, error["kind"], None)
    if not (isinstance(kind, type) and issubclass(kind, Failure)):
        kind = PeerFailed
    return kind(f"{error['message']} ({context})", param=error.get("param"))


def outcome(work: Any) -> Any:
    """A replica's side of one step: its result as a dict, or its failure as data (so the
    error crosses process boundaries intact)."""

    async def run() -> dict[str, Any]:
        try:
            return {"ok": True, **(await work)}
        except Failure as exc:
            return {
                "error": {"kind": type(exc).__name__, "message": exc.message, "param": exc.param}
            }

    return run()
