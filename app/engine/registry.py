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
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from app.batching import BatchingConfig
from app.common.caller import UNKEYED, Caller
from app.common.failures import (
    Conflict,
    Forbidden,
    NotFound,
    NotReady,
    QuotaExceeded,
    Unsupported,
    invalid,
)
from app.common.inputs import InputPreparer
from app.config import ModelSettings, VllmSettings
from app.engine.adapter_gate import AdapterGate, AdapterGateState
from app.engine.base import Backend
from app.engine.gate import PauseMode, ServingGate
from app.engine.loader import load_backend, resolve_model, resolve_source
from app.engine.served import AdaptedModel, AdapterPair, ModelPair, ServedModel
from app.weights.lora import LoraAdapter
from app.weights.lora_layout import CONFIG, CONFIG_METADATA, read_folder, read_upload

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)
Status = Literal["loading", "ready", "failed", "stopped"]
R = TypeVar("R")


@dataclass(frozen=True)
class Origin:
    """Where a served model's weights were read from at start-up, and when reading began (a
    file changed after it no longer holds what the server started with)."""

    source: str
    read_at: float


FIRST_UPLOAD = (
    f"a first upload carries its config in the file's metadata (key '{CONFIG_METADATA}': the "
    f"text of {CONFIG}), or load it from its folder (POST /v1/adapters)"
)
"""How an upload serves an adapter not served yet (said when it cannot)."""


def check_batch_invariant(served: ServedModel, param: str) -> None:
    """Refuse batch-invariant mode (named by `param`) on an engine that cannot run it."""
    if not served.backend.capabilities.batch_invariant:
        raise Unsupported(
            f"{param}: batch-invariant mode needs the transformers backend; the "
            f"{served.backend.info.backend} engine batches requests itself (and vLLM's CPU "
            "attention has no batch-invariant kernels)",
            param=param,
        )


class ModelRegistry:
    """`state_dir`: where vLLM engines keep their weight-update state (one folder each)."""

    def __init__(
        self,
        models: ModelSettings,
        vllm: VllmSettings,
        *,
        batching: BatchingConfig | None,
        state_dir: Path,
        invariant: bool = False,
        paused_wait_s: float | None = None,
    ) -> None:
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
        self.adapters: dict[str, LoraAdapter] = {}
        """LoRA adapters on the policy by name, each the version new requests get."""
        self._older: dict[str, list[LoraAdapter]] = {}
        """Each adapter's versions before its current one still resident (newest first): a
        request names one as `NAME@VERSION` (`models.resident_adapter_versions`)."""
        self.adapter_gates: dict[str, AdapterGate] = {}
        """Each served adapter's own pause and owner."""
        self._adapter_lock = asyncio.Lock()
        self._adapter_versions: dict[str, int] = {}
        """Each adapter name's last version, kept across an unload: a name unloaded and
        loaded again (verl's way of refreshing one) goes on counting, never back to 0."""
        self.paused_wait_s = paused_wait_s
        """How long a request waits for a paused model or adapter (None: no limit)."""
        self.gate = ServingGate(
            lambda: {name: m.backend for name, m in self.models.items()},
            paused_wait_s=paused_wait_s,
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
        self,
        name: str,
        *,
        mode: PauseMode = "keep",
        version: int | None = None,
        restartable: bool = False,
        lineage_named: int | None = None,
    ) -> AsyncIterator[tuple[ServedModel, int]]:
        """Serving paused (`mode`) while `name`'s weights change; yields the model and the
        version it gets if the block returns (`version` if given: it must be higher, unless
        `restartable`; see `ServingGate.updating`)."""
        served = self.get(name)
        async with self.gate.updating(
            name,
            mode=mode,
            version=version,
            restartable=restartable,
            lineage_named=lineage_named,
        ) as new_version:
            yield served, new_version

    async def load(self) -> None:
        """Load the policy and the reference off the event loop; failures are kept for /ready."""
        try:
            source, builtin = await asyncio.to_thread(resolve_source, self.model_settings)
            num_engines = 2 if self.model_settings.load_reference else 1
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
            if self.invariant:
                for served in self.models.values():
                    check_batch_invariant(served, "batching.invariant")
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

    def add(self, backend: Backend) -> ServedModel:
        preparer = InputPreparer(
            backend.tokenizer,
            vocab_size=backend.info.vocab_size,
            max_model_len=backend.info.max_model_len,
        )
        served = ServedModel(backend, preparer, self.batching, invariant=self.invariant)
        self.models[served.name] = served
        return served

    def get_pair(self, model: str = "policy", param: str = "model") -> ModelPair | AdapterPair:
        """The policy (or `model`, one of its LoRA adapters) and its reference, for KL. An
        adapter's reference is its base with the adapter off, unless a reference model of
        its own is configured (`ref_model`). An unfit `model` is refused naming `param`."""
        served = self.get(model, param)
        if isinstance(served, AdaptedModel):
            separate = self.model_settings.ref_model and "reference" in self.models
            return AdapterPair(served, self.models["reference"] if separate else served.base)
        if served.name != "policy":
            raise invalid(param, f"'{model}' is not the policy or one of its adapters")
        if self.pair is None:
            raise Unsupported(
                f"{param}: no reference model is served "
                "(start with RLSERVE_MODELS__LOAD_REFERENCE=true)",
                param=param,
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
        """'policy' or 'reference' for a served name or alias; None for any other name."""
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

    def get(self, name: str, param: str = "model") -> ServedModel:
        """The served model, alias or LoRA adapter `name` (an adapter: its current version);
        `NAME@VERSION`, vLLM's per-version names as ART serves each training step: the
        adapter NAME at that version while it is resident, or the policy (NAME one of its
        names) while it serves that version, in its trainer's count (else NotFound, naming
        the versions resident). An unknown name is refused naming `param`."""
        if (reason := self.not_ready_reason()) is not None:
            raise NotReady(reason)
        canonical = self.canonical(name)
        if canonical is not None:
            return self.models[canonical]
        adapter = self.adapters.get(name)
        if adapter is not None:
            return AdaptedModel(self.models["policy"], adapter, self.adapter_gates[name])
        if (split := _at_version(name)) is not None:
            served = self._at_version(*split, param)
            if served is not None:
                return served
        raise invalid(
            param,
            f"'{name}' is not served (have {', '.join(self.names())}; rlserve serve "
            "--served-model-name, or RLSERVE_MODELS__SERVED_MODEL_NAME, gives the policy more "
            "names)",
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

    def _at_version(self, base: str, version: int, param: str) -> ServedModel | None:
        """`base` at `version` (None when `base` names neither an adapter nor the policy)."""
        if base in self.adapters:
            resident = [self.adapters[base], *self._older.get(base, [])]
            for adapter in resident:
                if adapter.version == version:
                    return AdaptedModel(self.models["policy"], adapter, self.adapter_gates[base])
            have = sorted(a.version for a in resident)
            raise NotFound(
                f"{param}: adapter '{base}' has no version {version} resident (resident: "
                f"{have}; models.resident_adapter_versions keeps that many)",
                param=param,
            )
        if self.canonical(base) == "policy":
            current = self.gate.label("policy", self.versions["policy"])
            if version == current:
                return self.models["policy"]
            raise NotFound(
                f"{param}: '{base}' serves version {current} of the policy, not {version} (a "
                "model's weights have one version resident)",
                param=param,
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

    async def load_adapter(
        self,
        name: str,
        path: Path,
        *,
        param: str,
        name_param: str = "name",
        caller: Caller = UNKEYED,
    ) -> LoraAdapter:
        """Serve the LoRA adapter in folder `path` on the policy as `name`: a new name at
        version 0 (owned by `caller`), a name served before as its next version (rows in
        flight keep the version they started with; only its owner or an admin may)."""
        base = self._adapter_base(param)
        self.check_adapter_push(name, caller, name_param=name_param, param=param)
        config, tensors = await asyncio.to_thread(read_folder, path, param)
        return await self._serve_adapter(
            base, name, config, tensors, str(path), param, caller=caller, name_param=name_param
        )

    async def push_adapter(
        self, name: str, file: Path, *, param: str, caller: Caller = UNKEYED
    ) -> LoraAdapter:
        """New tensors for adapter `name` (a safetensors file, PEFT's tensor names), served as
        its next version: with the layers and shapes it has, and its config unless the file's
        metadata gives one (`CONFIG_METADATA`). A name not served needs that config, and is
        then served at version 0, owned by `caller`."""
        self.check_adapter_push(name, caller, name_param="name", param=param)
        config, tensors = await asyncio.to_thread(read_upload, file, param)
        return await self.push_adapter_tensors(
            name, tensors, config, source="upload", param=param, caller=caller, first=FIRST_UPLOAD
        )

    def check_adapter_push(self, name: str, caller: Caller, *, name_param: str, param: str) -> None:
        """Before the tensors of a push arrive: the policy serves adapters, `name` names no
        model, and `caller` may change it (refusals name `name_param`, or `param`)."""
        self._adapter_base(param)
        if self.canonical(name) is not None:
            raise Conflict(
                f"{name_param}: '{name}' names a served model, not an adapter", param=name_param
            )
        self._check_owner(name, caller, name_param)
        self._check_room(name, caller, name_param)

    def _check_room(self, name: str, caller: Caller, param: str) -> None:
        """A name not served yet fits the bounds on adapter names (`models.max_adapters`,
        and `models.max_adapters_per_key` for a key that is not an admin's)."""
        if name in self.adapters:
            return
        settings = self.model_settings
        if len(self.adapters) >= settings.max_adapters:
            raise QuotaExceeded(
                f"{param}: the server serves {len(self.adapters)} adapters, the most "
                "models.max_adapters (RLSERVE_MODELS__MAX_ADAPTERS) allows; unload one "
                "(DELETE /v1/adapters/NAME) before serving another name",
                param=param,
            )
        owned = sum(gate.owner == caller.owner for gate in self.adapter_gates.values())
        if owned >= settings.max_adapters_per_key and not (caller.admin and caller.owner):
            raise QuotaExceeded(
                f"{param}: this API key serves {owned} adapters, the most "
                "models.max_adapters_per_key (RLSERVE_MODELS__MAX_ADAPTERS_PER_KEY) allows; "
                "unload one of them (DELETE /v1/adapters/NAME) before serving another name",
                param=param,
            )

    async def push_adapter_tensors(
        self,
        name: str,
        tensors: dict[str, torch.Tensor],
        config: dict[str, Any] | None,
        *,
        source: str,
        param: str,
        caller: Caller,
        first: str,
        name_param: str = "name",
        version: int | None = None,
        keep_layout: bool = True,
    ) -> LoraAdapter:
        """`tensors` (PEFT's names) as adapter `name`'s next version (`push_adapter`), once
        `check_adapter_push` passed (the owner is checked again as it is served); `first` says
        how a push serves a new adapter, when this one cannot. `version`: the one a
        deployment's ledger counted (default: this server's count); `keep_layout=False`
        serves another layout too, as a folder's load does."""
        current = self.adapters.get(name)
        if current is None and config is None:
            raise NotFound(
                f"{name_param}: no adapter '{name}' is served; {first}", param=name_param
            )
        return await self._serve_adapter(
            self._adapter_base(param),
            name,
            config if config is not None else current.config,  # type: ignore[union-attr]
            tensors,
            source,
            param,
            caller=caller,
            name_param=name_param,
            layout_of=current if keep_layout else None,
            version=version,
        )

    def _adapter_base(self, param: str) -> ServedModel:
        base = self.get("policy")
        if not base.backend.capabilities.adapters:
            raise Unsupported(
                f"{param}: the {base.backend.info.backend} backend serves no LoRA adapters "
                "here (the transformers backend does; a vLLM engine does when started with "
                "RLSERVE_VLLM__MAX_LORAS)",
                param=param,
            )
        return base

    def _check_owner(self, name: str, caller: Caller, param: str) -> None:
        gate = self.adapter_gates.get(name)
        if gate is not None and not caller.may_change(gate.owner):
            raise Forbidden(
                f"{param}: adapter '{name}' belongs to another API key (only its owner, or an "
                "admin key, may change it)",
                param=param,
            )

    async def _serve_adapter(
        self,
        base: ServedModel,
        name: str,
        config: dict[str, Any],
        tensors: dict[str, torch.Tensor],
        source: str,
        param: str,
        *,
        caller: Caller,
        name_param: str = "name",
        layout_of: LoraAdapter | None = None,
        version: int | None = None,
    ) -> LoraAdapter:
        """`name`'s next version (or `version`); with `layout_of`, refused unless it has that
        one's layout."""
        async with self._adapter_lock:
            self._check_owner(name, caller, name_param)  # (again: it may have changed hands)
            self._check_room(name, caller, name_param)  # (and others may have filled it)
            if layout_of is not None:  # the latest version (another push may have come first)
                layout_of = self.adapters.get(name)
            if version is None:
                last = self._adapter_versions.get(name)
                version = last + 1 if last is not None else 0
            adapter = await base.backend.build_adapter(
                config, tensors, name=name, version=version, source=source, param=param
            )
            if layout_of is not None and not adapter.same_layout(layout_of):
                raise invalid(
                    param,
                    f"the tensors adapt other layers, or have other shapes, than adapter "
                    f"'{name}' (version {layout_of.version}); load a folder to change its layout",
                )
            if (previous := self.adapters.get(name)) is not None:
                kept = self.model_settings.resident_adapter_versions - 1
                self._older[name] = [previous, *self._older.get(name, [])][:kept]
            self.adapters[name] = adapter
            self._adapter_versions[name] = version
            if name not in self.adapter_gates:
                self.adapter_gates[name] = AdapterGate(
                    name, caller.owner, paused_wait_s=self.paused_wait_s
                )
        logger.info(
            "adapter %s v%d served from %s (rank %d, %d layers)",
            name,
            version,
            source,
            adapter.rank,
            len(adapter.modules),
        )
        return adapter

    def _gate_of(self, name: str, caller: Caller, param: str) -> AdapterGate:
        """Served adapter `name`'s gate, when `caller` may change it."""
        if (reason := self.not_ready_reason()) is not None:
            raise NotReady(reason)
        gate = self.adapter_gates.get(name)
        if gate is None:
            raise NotFound(
                f"{param}: no adapter '{name}' is served (have {sorted(self.adapters)})",
                param=param,
            )
        self._check_owner(name, caller, param)
        return gate

    def check_adapter_change(self, name: str, caller: Caller, param: str) -> None:
        """Adapter `name` is served, and `caller` may unload or pause it (else refused,
        naming `param`)."""
        self._gate_of(name, caller, param)

    def unload_adapter(self, name: str, *, param: str, caller: Caller = UNKEYED) -> LoraAdapter:
        """Stop serving adapter `name` to new requests (rows in flight finish with it; requests
        waiting on its pause are refused)."""
        gate = self._gate_of(name, caller, param)
        adapter = self.adapters.pop(name)
        self._older.pop(name, None)
        del self.adapter_gates[name]
        gate.close()
        logger.info("adapter %s unloaded", name)
        return adapter

    async def pause_adapter(
        self, name: str, mode: PauseMode, *, caller: Caller = UNKEYED
    ) -> tuple[LoraAdapter, AdapterGateState]:
        """Pause adapter `name` alone (`app.engine.adapter_gate`); its version now, and its
        state once paused."""
        gate = self._gate_of(name, caller, "name")
        adapter = self.adapters[name]
        state = await gate.pause(mode)
        logger.info("adapter %s paused (%s)", name, mode)
        return adapter, state

    async def resume_adapter(
        self, name: str, *, caller: Caller = UNKEYED
    ) -> tuple[LoraAdapter, AdapterGateState]:
        gate = self._gate_of(name, caller, "name")
        adapter = self.adapters[name]
        state = await gate.resume()
        logger.info("adapter %s resumed", name)
        return adapter, state

    def adapter_state(self, name: str) -> AdapterGateState | None:
        """Served adapter `name`'s pause state (None once unloaded)."""
        gate = self.adapter_gates.get(name)
        return None if gate is None else gate.state()

    def origin(self, name: str) -> Origin:
        """Where the served model `name` (or an alias) started from."""
        return self.origins[self.get(name).name]

    async def aclose(self) -> None:
        self.status = "stopped"
        if self.pair is not None:
            await self.pair.aclose()
        for served in self.models.values():
            await served.aclose()


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
