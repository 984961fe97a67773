"""FastAPI dependency shortcuts: everything routes need comes from `app.state`."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.config import Settings
from app.engine.registry import ModelRegistry
from app.envs.service import EnvService
from app.generation.serving import GenerationService
from app.kl.serving import KLService
from app.rollouts.serving import RolloutService
from app.scoring.serving import ScoringService
from app.weights.service import WeightsService


def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def _registry(request: Request) -> ModelRegistry:
    registry: ModelRegistry = request.app.state.registry
    return registry


def _generation(request: Request) -> GenerationService:
    return GenerationService(_registry(request), _settings(request))


def _scoring(request: Request) -> ScoringService:
    return ScoringService(_registry(request), _settings(request))


def _kl(request: Request) -> KLService:
    return KLService(_registry(request), _settings(request))


def _envs(request: Request) -> EnvService:
    envs: EnvService = request.app.state.envs
    return envs


def _rollouts(request: Request) -> RolloutService:
    return RolloutService(_envs(request), _generation(request))


def _weights(request: Request) -> WeightsService:
    return WeightsService(_registry(request), _settings(request))


SettingsDep = Annotated[Settings, Depends(_settings)]
RegistryDep = Annotated[ModelRegistry, Depends(_registry)]
GenerationDep = Annotated[GenerationService, Depends(_generation)]
ScoringDep = Annotated[ScoringService, Depends(_scoring)]
KLDep = Annotated[KLService, Depends(_kl)]
EnvsDep = Annotated[EnvService, Depends(_envs)]
RolloutsDep = Annotated[RolloutService, Depends(_rollouts)]
WeightsDep = Annotated[WeightsService, Depends(_weights)]
