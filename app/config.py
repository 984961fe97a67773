"""Service settings: one pydantic-settings class of groups, one per capability (vLLM's
`ModelConfig`, `CacheConfig`, ... inside one `VllmConfig`: the groups are
`app.config_groups`'); each component receives only its group. A field is read from
`RLSERVE_<GROUP>__<FIELD>` (e.g. `RLSERVE_TOOLS__TIMEOUT_S`); a field named without its group
is never silently ignored: `Settings(port=...)` is an error and `RLSERVE_PORT` a warning, each
naming the grouped name."""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping
from typing import Any

from pydantic import Field, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from app.config_groups import (
    NO_KEY,
    AuthSettings,
    BatchingSettings,
    DatasetSettings,
    EnvSettings,
    Group,
    HttpSettings,
    LimitSettings,
    ModelSettings,
    ProbeSettings,
    RewardSettings,
    StorageSettings,
    ToolSettings,
    TrajectorySettings,
    VllmSettings,
    WeightSettings,
)

_logger = logging.getLogger(__name__)
PREFIX = "RLSERVE_"
DELIMITER = "__"


def nest(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Overrides with `group.field` keys (`serve run ... storage.session_store=redis://...`)
    as nested groups; other keys as they are (old flat names warn in `Settings`)."""
    nested: dict[str, Any] = {}
    for key, value in overrides.items():
        group, dot, name = key.partition(".")
        if dot:
            nested.setdefault(group, {})[name] = value
        elif isinstance(value, dict) and isinstance(nested.get(key), dict):
            nested[key] = {**value, **nested[key]}
        else:
            nested[key] = value
    return nested


class _GroupEnvSource(EnvSettingsSource):
    """`RLSERVE_<GROUP>__<FIELD>` only: a bare `RLSERVE_<GROUP>` is never a whole group."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        _, key, is_complex = super().get_field_value(field, field_name)
        return None, key, is_complex


TOOL_VARIABLES = frozenset(
    {
        # the Python client's
        "RLSERVE_URL",
        "RLSERVE_API_KEY",
        # the compose file's (published host ports, replicas, image build)
        "RLSERVE_PORT",
        "RLSERVE_CPU_PORT",
        "RLSERVE_RAY_PORT",
        "RLSERVE_REPLICAS",
        "RLSERVE_BASE_IMAGE",
        "RLSERVE_APT_MIRROR",
        "RLSERVE_ENV_FILE",
        # the scripts' (scripts/*.sh: what they install, where)
        "RLSERVE_TORCH",
        "RLSERVE_VLLM",
        "RLSERVE_TORCHRL",
        "RLSERVE_GPU_PYTHON_VERSION",
        "RLSERVE_VENV",
        "RLSERVE_VLLM_VENV",
        "RLSERVE_TORCHRL_VENV",
        "RLSERVE_TRAINERS_VENV",
        "RLSERVE_SKYRL_VENV",
        "RLSERVE_ART_VENV",
        # the test suites' (scripts/test.sh, tests/)
        "RLSERVE_TEST_VLLM",
        "RLSERVE_TEST_TORCHRL",
        "RLSERVE_TEST_TRAINERS",
        "RLSERVE_TEST_DOCKER",
        "RLSERVE_TEST_DEADLINE_S",
        "RLSERVE_FUZZ_EXAMPLES",
        "RLSERVE_FUZZ_RANDOM",
        "RLSERVE_TRAINERS_SUITE",
        "RLSERVE_DOCKER_SMOKE_REPORT",
        "RLSERVE_SKYRL_030",
        "RLSERVE_TRAIN_CLIENT_KEY",
    }
)
"""`RLSERVE_*` names that rlserve's own tools read and the server does not: beside its
settings (`RLSERVE_<GROUP>__<FIELD>`), the only `RLSERVE_*` names a server starts beside.
Each is listed by its whole name (no prefix or suffix passes), so a test suite's or a
script's name never hides an operator's typo."""


class SettingsNameError(ValueError):
    """An `RLSERVE_*` variable the server does not read: the start stops, naming it."""


def _tool_variable(name: str) -> bool:
    return name in TOOL_VARIABLES


class _UnreadEnvSource(PydanticBaseSettingsSource):
    """Reads nothing: stops the start on an `RLSERVE_*` variable that is neither a setting
    nor one of rlserve's own tools' (`TOOL_VARIABLES`), with the name the server reads where
    there is one: an operator who set `RLSERVE_API_KEYS` must not get a server without keys.
    A tool's variable that looks like a setting (the compose file's `RLSERVE_PORT`) is a
    warning naming the setting, unless that setting is set too."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        problems = []
        for name in sorted(os.environ):
            upper = name.upper()
            if not upper.startswith(PREFIX):
                continue
            if _tool_variable(upper):
                grouped = [
                    _env_name(g, f) for g, f in _grouped_names(upper.removeprefix(PREFIX).lower())
                ]
                # (beside the setting it looks like, it is plainly not meant for the server:
                # the images set RLSERVE_HTTP__PORT, compose's .env RLSERVE_PORT)
                if grouped and not any(n in os.environ for n in grouped):
                    names = " or ".join(grouped)
                    _logger.warning("%s is not read by the server, which reads %s", name, names)
            elif (problem := _unread(upper)) is not None:
                problems.append(f"{name} is not read: {problem}")
        if problems:
            raise SettingsNameError(
                "; ".join(problems) + ". Set the name the server reads, or unset the variable."
            )
        return {}


def _unread(name: str) -> str | None:
    """Why the server does not read the variable `name` (upper case), with the name it reads;
    None for a setting's name."""
    groups = {
        group: info.annotation
        for group, info in Settings.model_fields.items()
        if isinstance(info.annotation, type) and issubclass(info.annotation, Group)
    }
    rest = name.removeprefix(PREFIX).lower()
    group, delimiter, field = rest.partition(DELIMITER.lower())
    if delimiter:
        if group not in groups:
            near = difflib.get_close_matches(group, list(groups), n=1)
            hint = f" (did you mean {PREFIX}{near[0].upper()}{DELIMITER}…?)" if near else ""
            return f"there is no settings group {group!r}{hint}"
        if field in groups[group].model_fields:
            return None
        near = difflib.get_close_matches(field, list(groups[group].model_fields), n=1)
        hint = f" (did you mean {_env_name(group, near[0])}?)" if near else ""
        return f"the {group} group has no field {field!r}{hint}"
    if rest in groups:
        return f"a group's fields are {name}{DELIMITER}<FIELD>"
    if grouped := _grouped_names(rest):
        return (
            f"settings are grouped, the server reads {' or '.join(_env_name(*g) for g in grouped)}"
        )
    return f"the server's settings are {PREFIX}<GROUP>{DELIMITER}<FIELD>"


def _env_name(group: str, field: str) -> str:
    return f"{PREFIX}{group.upper()}{DELIMITER}{field.upper()}"


def _grouped_names(field: str) -> list[tuple[str, str]]:
    """(group, field) of every group that has a field named `field`."""
    return [
        (group, field)
        for group, info in Settings.model_fields.items()
        if isinstance(info.annotation, type)
        and issubclass(info.annotation, Group)
        and field in info.annotation.model_fields
    ]


class Settings(BaseSettings):
    """Everything the service reads at start-up; validated before any model is loaded."""

    model_config = SettingsConfigDict(
        env_prefix="RLSERVE_",
        env_nested_delimiter="__",
        extra="ignore",
        # An empty variable is an unset one (compose passes `NAME=` lines of .env as ""):
        # the setting's default, except the API keys (below).
        env_ignore_empty=True,
    )

    models: ModelSettings = Field(default_factory=ModelSettings)
    vllm: VllmSettings = Field(default_factory=VllmSettings)
    http: HttpSettings = Field(default_factory=HttpSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    storage: StorageSettings = Field(default_factory=StorageSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    envs: EnvSettings = Field(default_factory=EnvSettings)
    tools: ToolSettings = Field(default_factory=ToolSettings)
    rewards: RewardSettings = Field(default_factory=RewardSettings)
    datasets: DatasetSettings = Field(default_factory=DatasetSettings)
    trajectories: TrajectorySettings = Field(default_factory=TrajectorySettings)
    weights: WeightSettings = Field(default_factory=WeightSettings)
    probe: ProbeSettings = Field(default_factory=ProbeSettings)
    batching: BatchingSettings = Field(default_factory=BatchingSettings)

    def __init__(self, **values: Any) -> None:
        for key in values:
            if key not in type(self).model_fields:
                grouped = " or ".join(f"{g}={{{f!r}: ...}}" for g, f in _grouped_names(key))
                hint = f"use Settings({grouped})" if grouped else "not a settings group"
                raise TypeError(f"Settings({key}=...): {hint}")
        super().__init__(**values)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (
            init_settings,
            _GroupEnvSource(settings_cls),
            _UnreadEnvSource(settings_cls),
            dotenv_settings,
            file_secret_settings,
        )

    @model_validator(mode="after")
    def _client_key_without_server_keys(self) -> Settings:
        """`RLSERVE_API_KEY` is the client's key: set where the server would start without
        keys, it most likely meant the server's, so the start stops rather than serve open."""
        client_key = next((n for n in os.environ if n.upper() == "RLSERVE_API_KEY"), None)
        if client_key and not (self.auth.api_keys or self.auth.admin_api_keys):
            raise SettingsNameError(
                f"{client_key} is the Python client's key, and the server has no API keys: "
                "the server reads RLSERVE_AUTH__API_KEYS (set it to require keys, or unset "
                f"{client_key} to start a server without keys)"
            )
        return self

    @model_validator(mode="after")
    def _keys_set_empty(self) -> Settings:
        """An API-key variable that is set but empty (`RLSERVE_AUTH__API_KEYS=`) never means
        "serve without keys": the start stops (the variables are read as empty when unset)."""
        for field in ("api_keys", "admin_api_keys"):
            name = _env_name("auth", field)
            present = [n for n in os.environ if n.upper() == name]
            if present and not os.environ[present[0]].strip():
                raise SettingsNameError(f"{present[0]} {NO_KEY}")
        return self

    def replace(self, **groups: dict[str, Any]) -> Settings:
        """A copy with some fields of some groups changed, validated again (the environment
        is not read again): `settings.replace(tools={"timeout_s": 3})`."""
        data = self.model_dump()
        for group, updates in groups.items():
            if group not in type(self).model_fields:
                raise ValueError(f"no settings group {group!r}")
            data[group].update(updates)
        return type(self).model_validate(data)
