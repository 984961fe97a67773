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
from typing import TYPE_CHECKING, Any

from app.common import failures
from app.common.failures import Conflict, Failure, PeerFailed
from app.engine.gate import GateState
from app.weights.protocol import PauseMode, UpdateOptions, WeightsUpdated

if TYPE_CHECKING:
    from app.weights.service import WeightsService

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

        ledger, update_id = self._ledger(), uuid.uuid4().hex
        await self._acquire(ledger, model, update_id)
        try:
            shipped = ray.put(files)
            handle = self._handle()
            staged = await _everywhere(handle, "weights_stage", update_id, shipped, model, param)
            refused = [r for r in staged if "error" in r]
            current = max((int(r["version"]) for r in staged if "error" not in r), default=0)
            problem: Failure | None = None
            if refused:
                problem = _failure(
                    refused[0], f"{len(refused)} of {len(staged)} replicas refused it"
                )
            elif options.version is not None and options.version <= current:
                problem = Conflict(
                    f"version: {options.version} is not above the current version {current} "
                    f"of '{model}'",
                    param="version",
                )
            version = options.version or current + 1
            if problem is None and not await ledger.decide.remote(
                model, update_id, version, [shipped]
            ):
                problem = Conflict(
                    f"the update of '{model}' took over {self.wait_s:g} s and lost its turn to "
                    "a later one; send it again",
                    param="model",
                )
            if problem is not None:
                await _everywhere(handle, "weights_abort", update_id)
                raise problem
            chosen = {"version": version, "pause": options.pause}
            committed = await _everywhere(handle, "weights_commit", update_id, model, chosen)
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

    async def _serving(self, method: str, *args: Any) -> GateState:
        states = await _everywhere(self._handle(), method, *args)
        failed = [s for s in states if "error" in s]
        if failed:
            raise _failure(failed[0], f"{len(failed)} of {len(states)} replicas failed")
        return GateState(**states[0]["state"])


async def _everywhere(handle: Any, method: str, *args: Any) -> list[dict[str, Any]]:
    """`method` on every replica; a replica that could not answer counts as an error."""
    results = await handle.broadcast(method, *args).results_async(return_exceptions=True)
    return [
        r if isinstance(r, dict) else {"error": {"kind": "PeerFailed", "message": str(r)}}
        for r in results
    ]


def _failure(result: dict[str, Any], context: str) -> Failure:
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
