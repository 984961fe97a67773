"""The environment service and its parts, built from the `envs` and `tools` settings groups:
each part receives only the numbers it needs."""

from __future__ import annotations

from app.config_groups import EnvSettings, ToolSettings
from app.datasets.service import DatasetService
from app.engine.registry import ModelRegistry
from app.envs.engine import EpisodeEngine, ToolLimits
from app.envs.sandbox import Sandbox, SandboxLimits
from app.envs.service import EnvService
from app.envs.sessions import SessionLimits, SessionRepository
from app.envs.store import SessionStore
from app.rewards.judges import Judges


def build_sandbox(tools: ToolSettings) -> Sandbox:
    """The python tool's sandbox (not probed yet: `probe()` it off the event loop)."""
    limits = SandboxLimits(
        timeout_s=tools.timeout_s,
        cpu_seconds=max(int(tools.timeout_s), 1),
        memory_bytes=tools.max_memory_mb << 20,
        max_output_bytes=tools.max_output_bytes,
        max_processes=tools.max_processes,
        tmpfs_bytes=tools.tmpfs_mb << 20,
    )
    return Sandbox(
        limits,
        isolation=tools.isolation,
        max_concurrent=tools.max_concurrent,
        uid_base=tools.uid_base,
    )


def build_env_service(
    store: SessionStore,
    sandbox: Sandbox,
    registry: ModelRegistry,
    datasets: DatasetService,
    envs: EnvSettings,
    tools: ToolSettings,
    judges: Judges,
) -> EnvService:
    sessions = SessionRepository(
        store,
        SessionLimits(
            max_sessions=envs.max_sessions,
            max_sessions_per_key=envs.max_sessions_per_key,
            ttl_s=envs.ttl_s,
        ),
    )
    limits = ToolLimits(step_budget_s=tools.step_budget_s, max_blocks=tools.max_blocks)
    engine = EpisodeEngine(sandbox, limits)
    return EnvService(sessions, engine, registry, datasets, judges, max_turns=envs.max_turns)
