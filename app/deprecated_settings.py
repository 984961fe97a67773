"""The old flat settings names (`RLSERVE_TOOL_TIMEOUT_S`, `Settings(tool_timeout_s=...)`), each
mapped to its group and field; they still work, with a `DeprecationWarning` (and a log line
once per process) that names the new one."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

logger = logging.getLogger(__name__)

PREFIX = "RLSERVE_"
DELIMITER = "__"


def _same(value: Any) -> Any:
    return value


def _ms_to_s(value: Any) -> Any:
    try:
        return float(value) / 1000
    except (TypeError, ValueError):
        return value  # the field's own validation names the problem


@dataclass(frozen=True)
class Renamed:
    group: str
    field: str
    convert: Callable[[Any], Any] = _same

    @property
    def env(self) -> str:
        return f"{PREFIX}{self.group.upper()}{DELIMITER}{self.field.upper()}"


# Old flat field name -> its group and field (the old env name is RLSERVE_ + it, upper case).
RENAMED: dict[str, Renamed] = {
    # models
    "model": Renamed("models", "model"),
    "ref_model": Renamed("models", "ref_model"),
    "load_reference": Renamed("models", "load_reference"),
    "backend": Renamed("models", "backend"),
    "dtype": Renamed("models", "dtype"),
    "device": Renamed("models", "device"),
    "trust_remote_code": Renamed("models", "trust_remote_code"),
    "max_model_len": Renamed("models", "max_model_len"),
    "cache_dir": Renamed("models", "cache_dir"),
    "exit_on_load_failure": Renamed("models", "exit_on_load_failure"),
    "builtin_hidden_size": Renamed("models", "builtin_hidden_size"),
    "builtin_num_layers": Renamed("models", "builtin_num_layers"),
    "builtin_seed": Renamed("models", "builtin_seed"),
    # vllm
    "gpu_memory_utilization": Renamed("vllm", "gpu_memory_utilization"),
    "kv_cache_memory_bytes": Renamed("vllm", "kv_cache_memory_bytes"),
    "tensor_parallel_size": Renamed("vllm", "tensor_parallel_size"),
    "enable_prefix_caching": Renamed("vllm", "enable_prefix_caching"),
    "enforce_eager": Renamed("vllm", "enforce_eager"),
    "vllm_processed_log_probs": Renamed("vllm", "processed_log_probs"),
    # http
    "host": Renamed("http", "host"),
    "port": Renamed("http", "port"),
    "log_level": Renamed("http", "log_level"),
    "log_format": Renamed("http", "log_format"),
    "keep_alive_timeout_s": Renamed("http", "keep_alive_timeout_s"),
    "shutdown_timeout_s": Renamed("http", "shutdown_timeout_s"),
    "cors_origins": Renamed("http", "cors_origins"),
    "max_body_bytes": Renamed("http", "max_body_bytes"),
    # auth
    "api_keys": Renamed("auth", "api_keys"),
    "admin_api_keys": Renamed("auth", "admin_api_keys"),
    "metrics_auth": Renamed("auth", "metrics_auth"),
    # storage
    "data_dir": Renamed("storage", "data_dir"),
    "session_store": Renamed("storage", "session_store"),
    "replica_id": Renamed("storage", "replica_id"),
    # limits
    "max_items_per_request": Renamed("limits", "max_items_per_request"),
    "max_new_tokens_limit": Renamed("limits", "max_new_tokens"),
    "default_max_new_tokens": Renamed("limits", "default_max_new_tokens"),
    "max_top_logprobs": Renamed("limits", "max_top_logprobs"),
    "max_candidate_ids": Renamed("limits", "max_candidate_ids"),
    "max_rollout_turns": Renamed("limits", "max_rollout_turns"),
    # envs
    "env_ttl_s": Renamed("envs", "ttl_s"),
    "max_env_sessions": Renamed("envs", "max_sessions"),
    "max_env_sessions_per_key": Renamed("envs", "max_sessions_per_key"),
    "env_max_turns": Renamed("envs", "max_turns"),
    # tools
    "tool_timeout_s": Renamed("tools", "timeout_s"),
    "tool_memory_mb": Renamed("tools", "max_memory_mb"),
    "tool_max_output_bytes": Renamed("tools", "max_output_bytes"),
    "tool_isolation": Renamed("tools", "isolation"),
    "tool_max_concurrent": Renamed("tools", "max_concurrent"),
    "tool_max_processes": Renamed("tools", "max_processes"),
    "tool_tmpfs_mb": Renamed("tools", "tmpfs_mb"),
    "tool_step_budget_s": Renamed("tools", "step_budget_s"),
    "tool_max_blocks": Renamed("tools", "max_blocks"),
    "tool_uid_base": Renamed("tools", "uid_base"),
    # datasets
    "dataset_max_bytes": Renamed("datasets", "max_bytes"),
    "dataset_max_rows": Renamed("datasets", "max_rows"),
    "max_datasets_per_key": Renamed("datasets", "max_per_key"),
    "dataset_import_dir": Renamed("datasets", "import_dir"),
    # trajectories
    "trajectory_ttl_s": Renamed("trajectories", "ttl_s"),
    "trajectory_max_turns": Renamed("trajectories", "max_turns"),
    # weights
    "max_weights_bytes": Renamed("weights", "max_bytes"),
    "weights_io_timeout_s": Renamed("weights", "io_timeout_s"),
    "weights_snapshot_loads": Renamed("weights", "snapshot_loads"),
    # probe
    "ready_probe_interval_s": Renamed("probe", "interval_s"),
    "ready_probe_timeout_s": Renamed("probe", "timeout_s"),
    # batching
    "batching": Renamed("batching", "enabled"),
    "min_batch_size": Renamed("batching", "min_batch_size"),
    "max_batch_size": Renamed("batching", "max_batch_size"),
    "batching_timeout_ms": Renamed("batching", "timeout_s", _ms_to_s),
    "max_batch_tokens": Renamed("batching", "max_batch_tokens"),
    "max_queue": Renamed("batching", "max_queue"),
}

_logged: set[str] = set()


def _warn(old: str, new: str) -> None:
    message = f"{old} is deprecated: use {new}"
    warnings.warn(message, DeprecationWarning, stacklevel=4)
    if old not in _logged:  # once per process, at start-up
        _logged.add(old)
        logger.warning(message)


def deprecated_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The nested settings the old `RLSERVE_*` names in `environ` (default os.environ) set."""
    environ = os.environ if environ is None else environ
    upper = {name.upper(): value for name, value in environ.items()}
    nested: dict[str, dict[str, Any]] = {}
    for old, renamed in RENAMED.items():
        name = PREFIX + old.upper()
        if name not in upper:
            continue
        _warn(name, renamed.env)
        nested.setdefault(renamed.group, {})[renamed.field] = renamed.convert(upper[name])
    return nested


def _is_old(key: str, value: Any) -> bool:
    renamed = RENAMED.get(key)
    # `batching` is both the old switch (a bool) and the new group.
    return renamed is not None and (key != renamed.group or isinstance(value, bool))


def deprecated_kwargs(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with the old flat keywords moved into their groups (a group's own value for
    the same field wins)."""
    moved = {key: value for key, value in values.items() if not _is_old(key, value)}
    for key, value in values.items():
        if not _is_old(key, value):
            continue
        renamed = RENAMED[key]
        _warn(
            f"Settings({key}=...)",
            f"Settings({renamed.group}={{{renamed.field!r}: ...}}) or {renamed.env}",
        )
        group = moved.get(renamed.group) or {}
        if isinstance(group, BaseModel):
            group = group.model_dump(exclude_unset=True)
        group = dict(group)
        group.setdefault(renamed.field, renamed.convert(value))
        moved[renamed.group] = group
    return moved
