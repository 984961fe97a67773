"""FastAPI dependency shortcuts: everything routes need comes from `app.state`."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.common.caller import Caller
from app.config import Settings
from app.datasets.service import DatasetService
from app.engine.health import EngineProbe
from app.engine.registry import ModelRegistry
from app.envs.service import EnvService
from app.generation.service import GenerationService
from app.kl.service import KLService
from app.ops.metrics import Metrics
from app.rewards.service import RewardService
from app.rollouts.service import RolloutService
from app.scoring.service import ScoringService
from app.trajectories.service import TrajectoryService
from app.updates.control import WeightsControl
from app.updates.driven import DrivenUpdates


async def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def _owner(request: Request) -> str:
    """Who is calling: the middleware's id for the request's API key ("" without keys)."""
    owner: str = getattr(request.state, "owner", "")
    return owner


async def _caller(request: Request) -> Caller:
    """The request's owner, and whether it may change what other keys own (an admin key, or
    any caller of a server without keys)."""
    owner: str = getattr(request.state, "owner", "")
    admin: bool = getattr(request.state, "admin", True)
    return Caller(owner, admin)


async def _probe(request: Request) -> EngineProbe:
    probe: EngineProbe = request.app.state.probe
    return probe


async def _registry(request: Request) -> ModelRegistry:
    registry: ModelRegistry = request.app.state.registry
    return registry


async def _generation(request: Request) -> GenerationService:
    generation: GenerationService = request.app.state.generation
    return generation


async def _scoring(request: Request) -> ScoringService:
    scoring: ScoringService = request.app.state.scoring
    return scoring


async def _kl(request: Request) -> KLService:
    kl: KLService = request.app.state.kl
    return kl


async def _rewards(request: Request) -> RewardService:
    rewards: RewardService = request.app.state.rewards
    return rewards


async def _envs(request: Request) -> EnvService:
    envs: EnvService = request.app.state.envs
    return envs


async def _datasets(request: Request) -> DatasetService:
    datasets: DatasetService = request.app.state.datasets
    return datasets


async def _rollouts(request: Request) -> RolloutService:
    rollouts: RolloutService = request.app.state.rollouts
    return rollouts


async def _weights(request: Request) -> WeightsControl:
    weights: WeightsControl = request.app.state.weights
    return weights


async def _driven_updates(request: Request) -> DrivenUpdates:
    session: DrivenUpdates = request.app.state.driven_updates
    return session


async def _metrics(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


async def _trajectories(request: Request) -> TrajectoryService:
    trajectories: TrajectoryService = request.app.state.trajectories
    return trajectories


OwnerDep = Annotated[str, Depends(_owner)]
CallerDep = Annotated[Caller, Depends(_caller)]
SettingsDep = Annotated[Settings, Depends(_settings)]
ProbeDep = Annotated[EngineProbe, Depends(_probe)]
RegistryDep = Annotated[ModelRegistry, Depends(_registry)]
GenerationDep = Annotated[GenerationService, Depends(_generation)]
ScoringDep = Annotated[ScoringService, Depends(_scoring)]
KLDep = Annotated[KLService, Depends(_kl)]
RewardsDep = Annotated[RewardService, Depends(_rewards)]
EnvsDep = Annotated[EnvService, Depends(_envs)]
DatasetsDep = Annotated[DatasetService, Depends(_datasets)]
RolloutsDep = Annotated[RolloutService, Depends(_rollouts)]
WeightsDep = Annotated[WeightsControl, Depends(_weights)]
MetricsDep = Annotated[Metrics, Depends(_metrics)]
TrajectoriesDep = Annotated[TrajectoryService, Depends(_trajectories)]
DrivenUpdatesDep = Annotated[DrivenUpdates, Depends(_driven_updates)]
"""The update session of this server's SGLang-speaking trainer (AReaL's vLLM routes share it)."""
