"""The served models by name, their load state and the policy version."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

from app.batching import BatchingConfig
from app.common.failures import NotFound, NotReady, Unsupported, invalid
from app.common.inputs import InputPreparer
from app.common.roles import Role
from app.config_groups import ModelSettings, VllmSettings
from app.engine.adapter_registry import AdapterRegistry
from app.engine.base import Backend, ModelWeights
from app.engine.digests import Digests
from app.engine.gate import Commit, ServingGate
from app.engine.loader import checkpoint_dtype, load_backend, resolve_model, resolve_source
from app.engine.served import AdaptedModel, AdapterPair, ModelPair, ServedModel

if TYPE_CHECKING:
    from app.engine.transformers.reward import RewardModel

logger = logging.getLogger(__name__)
Status = Literal["loading", "ready", "failed", "stopped"]
R = TypeVar("R")


@dataclass(frozen=True)
class Origin:
    """Where a served model's weights were read from at start-up, and when reading began (a
    file changed after it no longer holds what the server started with)."""

    source: str
    read_at: float


def check_batch_invariant(served: ServedModel, role: Role) -> None:
    """Refuse batch-invariant mode (named by `role`) on an engine that cannot run it."""
    if not served.backend.capabilities.batch_invariant:
        raise Unsupported(
            f"batch-invariant mode needs the transformers backend; the "
            f"{served.backend.info.backend} engine batches requests itself (and vLLM's CPU "
            "attention has no batch-invariant kernels)",
            role=role,
        )


class ModelRegistry(AdapterRegistry):
    """`state_dir`: where vLLM engines keep their weight-update state (one folder each). The
    policy's LoRA adapters: `AdapterRegistry` (`app.engine.adapter_registry`)."""

    def __init__(
        self,
        models: ModelSettings,
        vllm: VllmSettings,
        *,
        batching: BatchingConfig | None,
        state_dir: Path,
        invariant: bool = False,
        paused_wait_s: float | None = None,
        version_wait_s: float = 0.0,
    ) -> None:
        super().__init__(paused_wait_s)
        self.model_settings = models
        self.vllm = vllm
        self.batching = batching
        self.invariant = invariant
        """Batch-invariant mode by default (`batching.invariant`; requests may override)."""
        self.state_dir = state_dir
        self.models: dict[str, ServedModel] = {}
        self.origins: dict[str, Origin] = {}
        self.status: Status = "loading"
        self.loaded_at = 0.0  # time.time() when the models were ready
        self.error: str | None = None
        self.pair: ModelPair | None = None
        self.reward: RewardModel | None = None
        """The reward model (`models.reward_model`), when one is served."""
        self.snapshots: dict[str, str | None] = {}
        """The identity of the published snapshot each model serves (None: not one)."""
        self.digests = Digests()
        """Each model's weight digest (`app.engine.digests`), kept with its version."""
        self.gate = ServingGate(
            self.weighted,
            paused_wait_s=paused_wait_s,
            version_wait_s=version_wait_s,
        )

    @property
    def versions(self) -> dict[str, int]:
        return self.gate.versions

    @property
    def policy_version(self) -> int:
        return self.versions["policy"]

    @contextlib.asynccontextmanager
    async def reading(self, served: ServedModel | None = None) -> AsyncIterator[int]:
        """Scoring work (with `served`, when it is an adapter, admitted by the adapter's gate
        too): never spans a weight update. Yields the policy version it runs on."""
        async with self._adapter_admitted(served, None), self.gate.admitted("score") as version:
            yield version

    @contextlib.asynccontextmanager
    async def generating(
        self, served: ServedModel | None = None, stop: threading.Event | None = None
    ) -> AsyncIterator[int]:
        """Generation work: may be frozen across an update (its tokens carry their versions).
        With `served`, when it is an adapter, admitted by the adapter's gate too, whose abort
        pause sets `stop`. Yields the policy version it starts on."""
        async with self._adapter_admitted(served, stop), self.gate.admitted("generate") as v:
            yield v

    def _adapter_admitted(
        self, served: ServedModel | None, stop: threading.Event | None
    ) -> contextlib.AbstractAsyncContextManager[None]:
        if isinstance(served, AdaptedModel):
            return served.gate.admitted(stop)
        return contextlib.nullcontext()

    async def unless_aborted(self, work: Awaitable[R]) -> R | None:
        """What a generation scores after its tokens, or None if an abort pause cut it short
        (see `ServingGate.unless_aborted`)."""
        return await self.gate.unless_aborted(work)

    @contextlib.asynccontextmanager
    async def writing(
        self, name: str, commit: Commit | None = None
    ) -> AsyncIterator[tuple[ModelWeights, int]]:
        """Serving paused while `name`'s weights change; yields the model's weights and the
        version they get if the block returns (`commit`: `ServingGate.updating`)."""
        served, commit = self.weights(name), commit or Commit()
        async with served.writes(), self.gate.updating(name, commit) as new_version:
            yield served, new_version
            self.snapshots[name] = commit.snapshot

    async def load(self) -> None:
        """Load the policy, the reference, the judge and the reward model off the event loop;
        failures are kept for /ready."""
        try:
            source, builtin = await asyncio.to_thread(resolve_source, self.model_settings)
            settings = self.model_settings
            num_engines = 1 + bool(settings.load_reference) + bool(settings.judge_model)
            policy = await self._load("policy", source, builtin, num_engines)
            self.add(policy)
            if self.model_settings.load_reference:
                # By default the reference is a frozen copy of the policy as loaded.
                ref_source, ref_builtin = source, builtin
                if self.model_settings.ref_model:
                    ref_source, ref_builtin = await asyncio.to_thread(
                        resolve_model, self.model_settings, self.model_settings.ref_model
                    )
                reference = await self._load("reference", ref_source, ref_builtin, num_engines)
                check_same_vocabulary(policy, reference)
                self.add(reference)
                self.pair = ModelPair(
                    self.models["policy"], self.models["reference"], self.batching
                )
            if self.model_settings.judge_model:  # a third model, for judges
                judge_source, judge_builtin = await asyncio.to_thread(
                    resolve_model, self.model_settings, self.model_settings.judge_model
                )
                self.add(await self._load("judge", judge_source, judge_builtin, num_engines))
            if self.model_settings.reward_model:
                self.reward = await self._load_reward(self.model_settings.reward_model)
                self.gate.serve("reward")
            if self.invariant:
                for served in self.models.values():
                    check_batch_invariant(served, Role.BATCH_INVARIANT)
            for name, weights in self.weighted().items():
                await self.digests.record_all(name, weights)
            self.status, self.loaded_at = "ready", time.time()
            logger.info(
                "loaded %s", "; ".join(m.backend.info.summary() for m in self.models.values())
            )
        except Exception as exc:
            logger.exception("model loading failed")
            self.status, self.error = "failed", f"{type(exc).__name__}: {exc}"

    async def _load(self, name: str, source: str, builtin: bool, num_engines: int) -> Backend:
        self.origins[name] = Origin(source, time.time())
        return await load_backend(
            self.model_settings,
            self.vllm,
            name=name,
            source=source,
            builtin=builtin,
            state_dir=self.state_dir / name,
            num_engines=num_engines,
        )

    async def _load_reward(self, model: str) -> RewardModel:
        settings = self.model_settings
        source, builtin = await asyncio.to_thread(resolve_model, settings, model)
        self.origins["reward"] = Origin(source, time.time())
        from app.engine.transformers.reward import RewardModel

        dtype = await checkpoint_dtype(settings, source)
        logger.info("loading reward model from %s (dtype=%s)", source, dtype)
        return await asyncio.to_thread(
            RewardModel.load,
            source,
            dtype=dtype,
            device=settings.device,
            max_model_len=settings.max_model_len,
            trust_remote_code=settings.trust_remote_code,
            builtin=builtin,
            batching=self.batching,
        )

    def reward_names(self) -> list[str]:
        """The names the reward model answers to: 'reward', and the source it was started
        with (`models.reward_model`, as verl's reward loop names it)."""
        if self.reward is None:
            return []
        return sorted({"reward", str(self.model_settings.reward_model)})

    def get_reward(self, name: str, role: Role = Role.MODEL) -> RewardModel:
        """The reward model, named `name` (refused naming `role` for another name, and
        NotFound naming the setting when no reward model is served)."""
        if (reason := self.not_ready_reason()) is not None:
            raise NotReady(reason)
        if self.reward is None:
            raise NotFound(
                "no reward model is served (start the server with --reward-model "
                "PATH, or RLSERVE_MODELS__REWARD_MODEL)",
                role=role,
            )
        if name not in self.reward_names():
            names = ", ".join(self.reward_names())
            if self.serves(name):
                raise invalid(role, f"'{name}' is not the reward model (its names: {names})")
            raise NotFound(
                f"the model '{name}' does not exist (the reward model's names: {names})",
                role=role,
            )
        return self.reward

    def weighted(self) -> dict[str, ModelWeights]:
        """Every served model's weights by name: the language models' and the reward
        model's ('reward')."""
        held: dict[str, ModelWeights] = {name: m.backend for name, m in self.models.items()}
        if self.reward is not None:
            held["reward"] = self.reward
        return held

    def weights(self, name: str, role: Role = Role.MODEL) -> ModelWeights:
        """The weights of the served model `name` (a language model's name or alias, or one
        of the reward model's names), which the weights control changes; refused naming
        `role` for any other name (a LoRA adapter's weights are its own: `app.updates.
        adapters`)."""
        if (reason := self.not_ready_reason()) is not None:
            raise NotReady(reason)
        if name in self.reward_names():
            return self.get_reward(name, role)
        canonical = self.canonical(name)
        if canonical is None:
            if name in self.adapters:
                raise invalid(
                    role, f"'{name}' is a LoRA adapter (its weights load with /v1/adapters)"
                )
            raise self._unknown(name, role)
        return self.models[canonical].backend

    def add(self, backend: Backend) -> ServedModel:
        preparer = InputPreparer(
            backend.tokenizer,
            vocab_size=backend.info.vocab_size,
            max_model_len=backend.info.max_model_len,
        )
        served = ServedModel(backend, preparer, self.batching, invariant=self.invariant)
        self.models[served.name] = served
        self.gate.serve(served.name)
        return served

    def get_pair(self, model: str = "policy", role: Role = Role.MODEL) -> ModelPair | AdapterPair:
        """The policy (or `model`, one of its LoRA adapters) and its reference, for KL. An
        adapter's reference is its base with the adapter off, unless a reference model of
        its own is configured (`ref_model`). An unfit `model` is refused naming `role`."""
        served = self.get(model, role)
        if isinstance(served, AdaptedModel):
            separate = self.model_settings.ref_model and "reference" in self.models
            return AdapterPair(served, self.models["reference"] if separate else served.base)
        if served.name != "policy":
            raise invalid(role, f"'{model}' is not the policy or one of its adapters")
        if self.pair is None:
            raise Unsupported(
                "no reference model is served (start with RLSERVE_MODELS__LOAD_REFERENCE=true)",
                role=role,
            )
        return self.pair

    def not_ready_reason(self) -> str | None:
        """Why models cannot be used now (None once they are loaded)."""
        if self.status == "ready":
            return None
        detail = f": {self.error}" if self.error else ""
        return f"model is {self.status}{detail}"

    @property
    def aliases(self) -> dict[str, str]:
        """The names clients may use besides 'policy' and 'reference' (--served-model-name),
        each to the model it names."""
        names = {alias: "policy" for alias in self.model_settings.served_model_name}
        names |= {alias: "reference" for alias in self.model_settings.ref_served_model_name}
        return names

    def canonical(self, name: str) -> str | None:
        """The served model ('policy', 'reference', 'judge') a name or alias names; None for
        any other name."""
        if name in self.models:
            return name
        target = self.aliases.get(name)
        return target if target in self.models else None

    def names(self) -> list[str]:
        """Every name a request may give: the models, their aliases, the LoRA adapters (and
        `NAME@VERSION` of the policy's and the adapters', see `get`)."""
        return sorted([*self.models, *self.aliases, *self.adapters])

    def serves(self, name: str) -> bool:
        """Whether `name` is a served model, an alias or a LoRA adapter, or one of their
        versions (`NAME@VERSION`: refused by `get` when that version is not resident)."""
        if self.canonical(name) is not None or name in self.adapters:
            return True
        split = _at_version(name)
        return split is not None and (
            split[0] in self.adapters or self.canonical(split[0]) == "policy"
        )

    def get(self, name: str, role: Role = Role.MODEL) -> ServedModel:
        """The served model, alias or LoRA adapter `name` (an adapter: its current version);
        `NAME@VERSION`, vLLM's per-version names as ART serves each training step: the
        adapter NAME at that version while it is resident, or the policy (NAME one of its
        names) while it serves that version, in its trainer's count (else NotFound, naming
        the versions resident). An unknown name is refused naming `role`."""
        if (reason := self.not_ready_reason()) is not None:
            raise NotReady(reason)
        canonical = self.canonical(name)
        if canonical is not None:
            return self.models[canonical]
        adapter = self.adapters.get(name)
        if adapter is not None:
            return AdaptedModel(self.models["policy"], adapter, self.adapter_gates[name])
        if (split := _at_version(name)) is not None:
            served = self._at_version(*split, role)
            if served is not None:
                return served
        raise self._unknown(name, role)

    def _unknown(self, name: str, role: Role = Role.MODEL) -> NotFound:
        """The refusal of a model name nothing is served as (404 on every route, as vLLM's
        and OpenAI's servers answer), naming what is served and how the policy gets more
        names."""
        return NotFound(
            f"the model '{name}' does not exist (served: {', '.join(self.names())}; "
            "rlserve serve --served-model-name, or RLSERVE_MODELS__SERVED_MODEL_NAME, gives the "
            "policy more names)",
            role=role,
        )

    def name_of(self, served: ServedModel) -> str:
        """The name that gets `served` again: its model's, its adapter's, or `NAME@VERSION`
        for an adapter's version before its current one."""
        if (
            isinstance(served, AdaptedModel)
            and self.adapters.get(served.name) is not served.adapter
        ):
            return f"{served.name}@{served.adapter.version}"
        return served.name

    def _at_version(self, base: str, version: int, role: Role) -> ServedModel | None:
        """`base` at `version` (None when `base` names neither an adapter nor the policy)."""
        if base in self.adapters:
            resident = [self.adapters[base], *self._older.get(base, [])]
            for adapter in resident:
                if adapter.version == version:
                    return AdaptedModel(self.models["policy"], adapter, self.adapter_gates[base])
            have = sorted(a.version for a in resident)
            raise NotFound(
                f"adapter '{base}' has no version {version} resident (resident: "
                f"{have}; models.resident_adapter_versions keeps that many)",
                role=role,
            )
        if self.canonical(base) == "policy":
            current = self.gate.label("policy", self.versions["policy"])
            if version == current:
                return self.models["policy"]
            raise NotFound(
                f"'{base}' serves version {current} of the policy, not {version} (a "
                "model's weights have one version resident)",
                role=role,
            )
        return None

    def version_of(self, served: ServedModel) -> int:
        """The version `served` answers with: an adapter's own, or its model's weights'."""
        if isinstance(served, AdaptedModel):
            return served.adapter.version
        return self.versions[served.name]

    @staticmethod
    def answered(served: ServedModel, policy_version: int) -> int:
        """The version an answer of `served` reports: an adapter's own version, otherwise
        the policy version its work was admitted at."""
        return served.adapter.version if isinstance(served, AdaptedModel) else policy_version

    def origin(self, name: str) -> Origin:
        """Where the served model `name` (or an alias, or a name of the reward model)
        started from."""
        self.weights(name)  # (an unknown name is refused)
        return self.origins["reward" if name in self.reward_names() else self.get(name).name]

    async def aclose(self) -> None:
        self.status = "stopped"
        if self.pair is not None:
            await self.pair.aclose()
        for served in self.models.values():
            await served.aclose()
        if self.reward is not None:
            await self.reward.aclose()


def _at_version(name: str) -> tuple[str, int] | None:
    """`NAME@VERSION` as (NAME, VERSION); None for a name of another form."""
    base, at, version = name.rpartition("@")
    if not at or not base or not (version.isascii() and version.isdigit()) or len(version) > 18:
        return None
    return base, int(version)


def check_same_vocabulary(policy: Backend, reference: Backend) -> None:
    """KL compares the two models token by token: they must share one tokenizer."""
    if policy.tokenizer.get_vocab() != reference.tokenizer.get_vocab():
        raise ValueError(
            f"the reference model ({reference.info.source}) does not share the policy's "
            f"tokenizer ({policy.info.source})"
        )
