"""What every replica of one deployment must serve: the checkpoint each model last committed
(its files, in Ray's object store, owned here so they outlive the replica that received the
update) and whether serving is paused. A replica that starts (Ray restarting one, or scaling
up) applies it before it takes traffic, so it serves what the others serve.

It also orders updates: an update holds its model's lease from staging to the end of its
commit (a second one waits), and is decided here between the two phases, so a replica that
starts meanwhile catches up to it.

One ledger per deployment generation: `build` draws a generation id each time the
application is deployed, and a deploy starts from the base weights (as a restarted server
does); the first replica of a generation removes the ledgers of earlier ones."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import ray

PREFIX = "rlserve-ledger"


@ray.remote(num_cpus=0, max_restarts=0)
class WeightLedger:
    def __init__(self) -> None:
        self.latest: dict[str, tuple[int, ray.ObjectRef]] = {}
        self.leases: dict[str, tuple[str, float]] = {}  # model: (update id, expiry)
        self.paused: str | None = None

    def acquire(self, model: str, update_id: str, lease_s: float) -> bool:
        """Take `model`'s update lease, unless another live update holds it."""
        now = time.monotonic()
        held = self.leases.get(model)
        if held is not None and held[0] != update_id and held[1] > now:
            return False
        self.leases[model] = (update_id, now + lease_s)
        return True

    def decide(self, model: str, update_id: str, version: int, files: list[ray.ObjectRef]) -> bool:
        """Record `files` as `model`'s `version`, if `update_id` still holds the lease. The
        ledger keeps its own copy (the caller's object dies with the caller): the update
        merged over the ones before it, so one checkpoint replays them all."""
        held = self.leases.get(model)
        if held is None or held[0] != update_id:
            return False
        update: dict[str, bytes] = ray.get(files[0])
        if (before := self.latest.get(model)) is not None:
            update = merged(ray.get(before[1]), update)
        self.latest[model] = (version, ray.put(update))
        return True

    def release(self, model: str, update_id: str) -> None:
        if self.leases.get(model, ("",))[0] == update_id:
            del self.leases[model]

    def record_pause(self, mode: str | None) -> None:
        self.paused = mode

    def state(self) -> dict[str, Any]:
        """Each model's committed version and files (a reference, wrapped so it is not
        fetched here), and the pause mode in force (None: serving)."""
        return {
            "models": {model: (version, [ref]) for model, (version, ref) in self.latest.items()},
            "paused": self.paused,
        }


def merged(before: dict[str, bytes], update: dict[str, bytes]) -> dict[str, bytes]:
    """Checkpoint files (name to safetensors bytes) holding `before`'s tensors with
    `update`'s over them. An update that names every tensor `before` has (a whole model)
    is kept as it is; a partial one is merged into one file."""
    if tensor_names(before) <= tensor_names(update):
        return update
    from safetensors.torch import load, save

    tensors = {}
    for data in [*before.values(), *update.values()]:
        tensors.update(load(data))
    return {"model.safetensors": save(tensors)}


def tensor_names(files: dict[str, bytes]) -> set[str]:
    """The tensor names in safetensors files, from their headers (a little-endian u64
    length, then that much JSON)."""
    names: set[str] = set()
    for data in files.values():
        size = int.from_bytes(data[:8], "little")
        names |= set(json.loads(data[8 : 8 + size])) - {"__metadata__"}
    return names


def ledger(app_name: str, generation: str) -> Any:
    """This deployment generation's ledger (created by the first replica that asks)."""
    return WeightLedger.options(  # type: ignore[attr-defined]
        name=f"{PREFIX}-{app_name}-{generation}", lifetime="detached", get_if_exists=True
    ).remote()


def remove_earlier(app_name: str, generation: str) -> int:
    """Kill the ledgers earlier generations of this application left; how many."""
    namespace = ray.get_runtime_context().namespace
    ours = f"{PREFIX}-{app_name}-{generation}"
    earlier = [
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == namespace
        and actor["name"].startswith(f"{PREFIX}-{app_name}-")
        and actor["name"] != ours
    ]
    for name in earlier:
        with contextlib.suppress(ValueError):  # another replica removed it first
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    return len(earlier)
