"""The weight routes as `Call` builders (loads, uploads, snapshots, restores, LoRA adapters,
pauses and the collective transfer's steps): methods of both `Client` and `AsyncClient`,
as `_routes`' are."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

from rlserve_client import types
from rlserve_client._base import NOT_GIVEN, Call, Retry, Timeout, _given


def load_reward_weights(
    *, path: str, version: int | None = None, timeout: Timeout = NOT_GIVEN
) -> Call[types.RewardWeightsLoaded]:
    """Load a safetensors checkpoint (any subset of the reward model's parameters) from a path
    the server can read, as reward version `version` (default: the current one plus one).
    Admin key."""
    return Call(
        "POST",
        "/v1/rewards/weights",
        types.RewardWeightsLoaded,
        json=_given(path=path, version=version),
        timeout=timeout,
        retry=Retry.UNSENT,
    )


def weights_version(*, timeout: Timeout = NOT_GIVEN) -> Call[types.WeightsVersion]:
    return Call("GET", "/v1/weights/version", types.WeightsVersion, timeout=timeout)


def load_weights(
    *,
    path: str,
    model: str = "policy",
    version: int | None = None,
    pause: str = "keep",
    timeout: Timeout = NOT_GIVEN,
) -> Call[types.WeightsUpdated]:
    """Load a safetensors checkpoint from a path the server can read. `version`: the version
    to publish (above the current one); `pause`: wait, abort or keep in-flight generations."""
    body = _given(path=path, model=model, version=version, pause=pause)
    return Call(
        "POST",
        "/v1/weights/load",
        types.WeightsUpdated,
        json=body,
        timeout=timeout,
        retry=Retry.UNSENT,
    )


def load_snapshot(
    *,
    identity: str,
    source: str,
    base: str | None = None,
    model: str = "policy",
    cache: str = "reset",
    pause: str = "keep",
    digest: str | None = None,
    timeout: Timeout = NOT_GIVEN,
) -> Call[types.WeightsUpdated]:
    """Serve published snapshot `identity` from `source` (a path the server reads, or an
    http(s) URL of one file): a whole checkpoint, or a delta of snapshot `base`. Checked and
    staged while serving goes on (against `digest` too, when given), then committed on every
    replica; a bad one leaves the current snapshot served. Admin key."""
    body = _given(
        identity=identity,
        source=source,
        base=base,
        model=model,
        cache=cache,
        pause=pause,
        digest=digest,
    )
    return Call(
        "POST",
        "/v1/weights/snapshots",
        types.WeightsUpdated,
        json=body,
        timeout=timeout,
        retry=Retry.UNSENT,
    )


def snapshots(
    *, model: str = "policy", timeout: Timeout = NOT_GIVEN
) -> Call[types.ServedSnapshots]:
    """What each replica serves of `model` (version, digest, snapshot) and where its last
    snapshot load stands. Admin key."""
    return Call(
        "GET",
        "/v1/weights/snapshots",
        types.ServedSnapshots,
        params={"model": model},
        timeout=timeout,
    )


def restore_weights(
    *,
    model: str = "policy",
    version: int | None = None,
    pause: str = "keep",
    timeout: Timeout = NOT_GIVEN,
) -> Call[types.WeightsUpdated]:
    """Serve again the weights `model` started with (read from where the server loaded them),
    as a new version: undo what a run pushed without restarting the server. Admin key."""
    body = _given(model=model, version=version, pause=pause)
    return Call(
        "POST",
        "/v1/weights/restore",
        types.WeightsUpdated,
        json=body,
        timeout=timeout,
        retry=Retry.UNSENT,
    )


def load_adapter(
    *, name: str, path: str | Path, timeout: Timeout = NOT_GIVEN
) -> Call[types.Adapter]:
    """Serve the LoRA adapter in folder `path` (PEFT's `save_pretrained` layout, readable by
    the server) as `name`; every model route then takes `model=name`. Loading a served name
    again serves the folder as its next version. Admin key."""
    return Call(
        "POST",
        "/v1/adapters",
        types.Adapter,
        json={"name": name, "path": str(path)},
        timeout=timeout,
        retry=Retry.UNSENT,
    )


def push_adapter(
    *, name: str, payload: bytes | Path, timeout: Timeout = NOT_GIVEN
) -> Call[types.Adapter]:
    """A training step's adapter: its tensors as one safetensors file (bytes or a path), with
    PEFT's names; `rlserve_client.lora.adapter_file(peft_model)` makes one, with the adapter's
    config in its metadata. The server serves them as the adapter's next version at once,
    without pausing. A file with its config serves a new name (owned by this client's key);
    without one, the adapter must be served already. Its owner's key or an admin key."""
    return Call(
        "PUT",
        _adapter_path(name),
        types.Adapter,
        content=payload,
        timeout=timeout,
        retry=Retry.UNSENT,
    )


def adapters(*, timeout: Timeout = NOT_GIVEN) -> Call[types.Adapters]:
    return Call("GET", "/v1/adapters", types.Adapters, timeout=timeout)


def pause_adapter(
    *,
    name: str,
    mode: Literal["wait", "abort", "keep"] = "wait",
    timeout: Timeout = NOT_GIVEN,
) -> Call[types.Adapter]:
    """Hold back new requests naming adapter `name` until `resume_adapter`; returns once its
    requests inside met `mode` ('wait': finished; 'abort': generations ended at their next
    token; 'keep': at once, they go on with their version). The policy and other adapters
    serve on. Its owner's key or an admin key."""
    return Call(
        "POST", _adapter_path(name) + "/pause", types.Adapter, json={"mode": mode}, timeout=timeout
    )


def resume_adapter(*, name: str, timeout: Timeout = NOT_GIVEN) -> Call[types.Adapter]:
    return Call("POST", _adapter_path(name) + "/resume", types.Adapter, timeout=timeout)


def unload_adapter(*, name: str, timeout: Timeout = NOT_GIVEN) -> Call[types.Adapter]:
    """New requests can no longer name it; those in flight finish with it. Its owner's key or
    an admin key."""
    return Call("DELETE", _adapter_path(name), types.Adapter, timeout=timeout)


def _adapter_path(name: str) -> str:
    return f"/v1/adapters/{quote(name, safe='/@:+')}"


def upload_weights(
    *,
    payload: bytes | Path,
    model: str = "policy",
    version: int | None = None,
    pause: str = "keep",
    progress: bool | None = None,
    timeout: Timeout = NOT_GIVEN,
) -> Call[types.WeightsUpdated]:
    """Upload a safetensors file (its bytes, or its path: streamed from disk, never read
    whole); any subset of the parameters. `progress`: a progress bar; None shows one when
    stderr is a terminal."""
    return Call(
        "PUT",
        "/v1/weights",
        types.WeightsUpdated,
        params=_given(model=model, version=version, pause=pause),
        content=payload,
        progress=progress,
        timeout=timeout,
        retry=Retry.UNSENT,
    )


def pause(*, mode: str = "keep", timeout: Timeout = NOT_GIVEN) -> Call[types.ServingState]:
    """Hold new requests until `resume`; in-flight work meets `mode` (wait, abort, keep)."""
    return Call(
        "POST",
        "/v1/pause",
        types.ServingState,
        json={"mode": mode},
        timeout=timeout,
        retry=Retry.UNSENT,
    )


def resume(*, timeout: Timeout = NOT_GIVEN) -> Call[types.ServingState]:
    return Call("POST", "/v1/resume", types.ServingState, timeout=timeout, retry=Retry.UNSENT)


def serving_state(*, timeout: Timeout = NOT_GIVEN) -> Call[types.ServingState]:
    return Call("GET", "/v1/serving", types.ServingState, timeout=timeout)


def transfer_state(
    *, model: str = "policy", timeout: Timeout = NOT_GIVEN
) -> Call[types.TransferState]:
    """The collective transfer's state; the trainer's world size is 1 + `server_ranks`."""
    return Call(
        "GET",
        "/v1/weights/transfer",
        types.TransferState,
        params={"model": model},
        timeout=timeout,
    )


def transfer_step(
    *, step: str, body: dict[str, Any], timeout: Timeout = NOT_GIVEN
) -> Call[types.TransferState]:
    """One step of the transfer protocol (init, start, update, abort, close): what
    `Client.weight_transfer` drives."""
    return Call(
        "POST",
        f"/v1/weights/transfer/{step}",
        types.TransferState,
        json=body,
        timeout=timeout,
        retry=Retry.UNSENT,
    )


def transfer_finish(
    *,
    model: str = "policy",
    version: int | None = None,
    pause: str = "keep",
    timeout: Timeout = NOT_GIVEN,
) -> Call[types.WeightsUpdated]:
    body = _given(model=model, version=version, pause=pause)
    return Call(
        "POST",
        "/v1/weights/transfer/finish",
        types.WeightsUpdated,
        json=body,
        timeout=timeout,
        retry=Retry.UNSENT,
    )
