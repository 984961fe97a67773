"""One weight update over every replica of a Ray Serve deployment, as a transaction, with Ray
Serve's own fan-out (`DeploymentHandle.broadcast`):

1. every replica copies the checkpoint into its own data and checks it (layout, finite
   values), serving untouched (a path on storage each replica reads; an upload travels once
   through Ray's object store);
2. if any replica failed, every replica drops its copy and the update is refused with that
   replica's error: all stay on the old version;
3. otherwise every replica swaps it in under the same new version.

Step 3 only swaps checked tensors; a replica that still fails there (its device, say) is
reported, and Ray's health check replaces it."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from app.common import failures
from app.common.failures import Failure, PeerFailed
from app.engine.gate import GateState
from app.weights.protocol import PauseMode, UpdateOptions, WeightsUpdated


class ReplicaFanout:
    def __init__(self, app_name: str, deployment: str) -> None:
        self.app_name = app_name
        self.deployment = deployment

    async def update(
        self, source: Path | bytes, model: str, options: UpdateOptions
    ) -> WeightsUpdated:
        import ray
        from ray import serve

        handle = serve.get_deployment_handle(self.deployment, self.app_name)
        update_id = uuid.uuid4().hex
        shipped = ray.put(source) if isinstance(source, bytes) else str(source)
        staged = await _everywhere(handle, "weights_stage", update_id, shipped, model)
        refused = [r for r in staged if "error" in r]
        if refused:
            await _everywhere(handle, "weights_abort", update_id)
            raise _failure(refused[0], f"{len(refused)} of {len(staged)} replicas refused it")
        version = options.version or max(int(r["version"]) for r in staged) + 1
        chosen = {"version": version, "pause": options.pause}
        committed = await _everywhere(handle, "weights_commit", update_id, model, chosen)
        failed = [r for r in committed if "error" in r]
        if failed:
            raise PeerFailed(
                f"{len(failed)} of {len(committed)} replicas failed to swap in version "
                f"{version} after all had checked it: {failed[0]['error']['message']}"
            )
        return WeightsUpdated.model_validate(committed[0]["updated"])

    async def pause(self, mode: PauseMode) -> GateState:
        return await self._serving("serving_pause", mode)

    async def resume(self) -> GateState:
        return await self._serving("serving_resume")

    async def _serving(self, method: str, *args: Any) -> GateState:
        from ray import serve

        handle = serve.get_deployment_handle(self.deployment, self.app_name)
        states = await _everywhere(handle, method, *args)
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
