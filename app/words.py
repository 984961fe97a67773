"""rlserve's own API's words for the core's roles (`app.common.roles`): the request field (or
header) each of its routes names when a failure below the routes names that role. A route of
another vocabulary (OpenAI's, vLLM's, SGLang's, slime's) words the roles it knows first
(`app.common.failures.worded`); what no route words is worded here (`app.errors`)."""

from __future__ import annotations

from app.common.roles import Role

PIN_MINIMUM = "X-Min-Policy-Version"
PIN_EXACT = "X-Policy-Version"
"""The request headers that pin a version (the same on every route, whatever its body's
vocabulary: `app.ops.versions`)."""

NATIVE_WORDS: dict[Role, str] = {
    Role.MODEL: "model",
    Role.BATCH_INVARIANT: "batch_invariant",
    Role.CHECKPOINT: "path",
    Role.UPLOAD: "body",
    Role.PUBLISHED: "source_dir",
    Role.SNAPSHOT_SOURCE: "source",
    Role.SNAPSHOT_BASE: "base",
    Role.DIGEST: "digest",
    Role.VERSION: "version",
    Role.STAGED_UPDATE: "update",
    Role.PAUSE_MODE: "mode",
    Role.ABORT: "abort_all",
    Role.PIN_EXACT: PIN_EXACT,
    Role.PIN_MINIMUM: PIN_MINIMUM,
    Role.TENSORS: "weights",
    Role.TENSOR_NAMES: "names",
    Role.TENSOR_DTYPES: "dtype_names",
    Role.TENSOR_SHAPES: "shapes",
    Role.BUCKETS: "buckets",
    Role.DELTA: "delta",
    Role.GROUP_SIZE: "world_size",
    Role.GROUP_ADDRESS: "master_address",
    Role.GROUP_TIMEOUT: "timeout_s",
    Role.TRANSPORT: "transport",
    Role.ADAPTER_PUSH: "adapter",
}
"""A role missing here (the adapter's: each adapter route words them) is named by itself."""
