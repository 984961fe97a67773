"""What a request carries, as the core names it. A failure below the routes names the role at
fault (`app.common.failures.Failure.role`), never a request field: the engine, weights,
updates and deploy layers know no API's field names. The route that called words each role
in its own API's vocabulary (`app.common.failures.worded`); rlserve's own routes use
`app.words.NATIVE_WORDS`, and a role no table words is shown by its own name."""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    """One thing a request carries that a refusal can name."""

    MODEL = "model"
    """Which served model (or adapter, or `name@version`) a request names."""
    BATCH_INVARIANT = "batch_invariant"
    """The wish for batch-invariant sampling."""

    CHECKPOINT = "checkpoint"
    """A checkpoint (folder or file, whole or a delta) the server reads from a path."""
    UPLOAD = "upload"
    """A checkpoint or delta uploaded in the request's body."""
    PUBLISHED = "published"
    """A folder of published versions (slime's `weight_v{N:06d}`, SkyRL's deltas)."""
    SNAPSHOT_SOURCE = "snapshot.source"
    """Where a published snapshot is fetched from (a path or an HTTP(S) URL)."""
    SNAPSHOT_BASE = "snapshot.base"
    """The snapshot a delta snapshot builds on."""
    DIGEST = "digest"
    """The content digest a push expects the served weights to have."""
    VERSION = "version"
    """The version a push names for what it serves."""
    STAGED_UPDATE = "staged_update"
    """An update staged on a replica, named by its id."""
    PAUSE_MODE = "pause.mode"
    """How serving pauses (keep, wait, abort)."""
    ABORT = "abort"
    """The wish to abort what is in flight."""
    PIN_EXACT = "pin.exact"
    """The exact policy version a request pins."""
    PIN_MINIMUM = "pin.minimum"
    """The lowest policy version a request accepts."""

    TENSORS = "tensors"
    """The values of the tensors a push carries (each named in the message)."""
    TENSOR_NAMES = "tensors.names"
    """The names a transfer announces."""
    TENSOR_DTYPES = "tensors.dtypes"
    """The dtypes a transfer announces."""
    TENSOR_SHAPES = "tensors.shapes"
    """The shapes a transfer announces."""
    BUCKETS = "tensors.buckets"
    """How a transfer's tensors are packed into buckets."""
    DELTA = "delta"
    """The wish that a transfer carries a delta rather than whole tensors."""

    GROUP_SIZE = "group.size"
    """The size of a transfer group."""
    GROUP_ADDRESS = "group.address"
    """Where a transfer group rendezvous."""
    GROUP_TIMEOUT = "group.timeout"
    """How long a group's members wait for each other."""
    TRANSPORT = "group.transport"
    """The transport a transfer group uses."""

    ADAPTER = "adapter.name"
    """A LoRA adapter's name."""
    ADAPTER_SOURCE = "adapter.source"
    """Where an adapter's tensors came from (a folder, an upload, a transfer)."""
    ADAPTER_CONFIG = "adapter.config"
    """An adapter's config (PEFT's `adapter_config.json`)."""
    ADAPTER_PUSH = "adapter.push"
    """The adapter a transfer announces at its start."""
