"""The rules of the policy's LoRA adapters: which names may be served, whose each one is, how its
versions are numbered, and who may change, pause or unload it. The engine
(`app.engine.registry`) only builds, installs, removes and resolves them; one server applies
these rules alone (`app.updates.local`), a replica of several before it ships an adapter to every
replica (`app.deploy.replicated`).

Refusals name roles (`Role.ADAPTER`, `Role.ADAPTER_SOURCE`, `Role.ADAPTER_CONFIG`), which each
route names in its own words (`app.common.failures.worded`)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.common.caller import Caller
from app.common.failures import Conflict, Forbidden, NotFound, QuotaExceeded, TooLarge, invalid
from app.common.roles import Role
from app.engine.adapter_gate import AdapterGateState
from app.engine.gate import PauseMode
from app.engine.registry import ModelRegistry
from app.updates.service import Limit
from app.weights.lora import AdapterBuild, LoraAdapter
from app.weights.lora_layout import CONFIG, CONFIG_METADATA, read_folder, read_upload

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

FIRST_UPLOAD = (
    f"a first upload carries its config in the file's metadata (key '{CONFIG_METADATA}': the "
    f"text of {CONFIG}), or load it from its folder (POST /v1/adapters)"
)
"""How an upload serves an adapter not served yet (said when it cannot)."""
MAX_BYTES = "models.max_adapter_bytes (RLSERVE_MODELS__MAX_ADAPTER_BYTES)"
MAX_RANK = "models.max_adapter_rank (RLSERVE_MODELS__MAX_ADAPTER_RANK)"


@dataclass(frozen=True)
class Serving:
    """An adapter's next version to serve: its tensors and where they came from."""

    name: str
    tensors: dict[str, torch.Tensor]
    config: dict[str, Any] | None
    """PEFT's config (None: the one the adapter is served with)."""
    source: str
    caller: Caller
    first: str = FIRST_UPLOAD
    """How a push serves a new adapter (said when this one carries no config)."""
    version: int | None = None
    """The version a deployment's ledger counted (None: this server's own count)."""
    keep_layout: bool = True
    """Refuse other layers or shapes than the version served (a push); a load may change
    them."""


class AdapterCatalog:
    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry
        self._owners: dict[str, str] = {}
        """Each served adapter's owner: the id of the key that first served it ("" without
        keys)."""
        self._last: dict[str, int] = {}
        """Each name's last version, kept across an unload: a name unloaded and loaded again
        (verl's way of refreshing one) goes on counting, never back to 0."""
        self._lock = asyncio.Lock()

    def owner(self, name: str) -> str | None:
        """Served adapter `name`'s owner (None when it is not served)."""
        return self._owners.get(name) if name in self.registry.adapters else None

    # -- the rules -------------------------------------------------------------------------

    def check_push(self, name: str, caller: Caller) -> None:
        """Before the tensors of a push arrive: the policy serves adapters, `name` names no
        model, `caller` may change it, and a new name fits the bounds."""
        registry = self.registry
        registry.adapter_base()
        if registry.canonical(name) is not None:
            raise Conflict(f"'{name}' names a served model, not an adapter", role=Role.ADAPTER)
        self._check_owner(name, caller)
        self._check_room(name, caller)

    def check_change(self, name: str, caller: Caller) -> None:
        """Adapter `name` is served, and `caller` may unload or pause it."""
        self.registry.adapter_gate(name)
        self._check_owner(name, caller)

    def _check_owner(self, name: str, caller: Caller) -> None:
        owner = self.owner(name)
        if owner is not None and not caller.may_change(owner):
            raise Forbidden(
                f"adapter '{name}' belongs to another API key (only its owner, or an "
                "admin key, may change it)",
                role=Role.ADAPTER,
            )

    def _check_room(self, name: str, caller: Caller) -> None:
        """A name not served yet fits the bounds on adapter names (`models.max_adapters`,
        and `models.max_adapters_per_key` for a key that is not an admin's)."""
        served = self.registry.adapters
        if name in served:
            return
        settings = self.registry.model_settings
        if len(served) >= settings.max_adapters:
            raise QuotaExceeded(
                f"the server serves {len(served)} adapters, the most "
                "models.max_adapters (RLSERVE_MODELS__MAX_ADAPTERS) allows; unload one "
                "(DELETE /v1/adapters/NAME) before serving another name",
                role=Role.ADAPTER,
            )
        owned = sum(self.owner(other) == caller.owner for other in served)
        if owned >= settings.max_adapters_per_key and not (caller.admin and caller.owner):
            raise QuotaExceeded(
                f"this API key serves {owned} adapters, the most "
                "models.max_adapters_per_key (RLSERVE_MODELS__MAX_ADAPTERS_PER_KEY) allows; "
                "unload one of them (DELETE /v1/adapters/NAME) before serving another name",
                role=Role.ADAPTER,
            )

    # -- how large ---------------------------------------------------------------------------

    def upload_limit(self) -> Limit:
        """The most bytes an adapter's upload may hold."""
        return Limit(self.registry.model_settings.max_adapter_bytes, MAX_BYTES)

    def check_size(self, num_bytes: int, role: Role = Role.ADAPTER_SOURCE) -> None:
        """An adapter of `num_bytes` bytes of tensors fits `models.max_adapter_bytes`."""
        most = self.registry.model_settings.max_adapter_bytes
        if num_bytes > most:
            raise TooLarge(
                f"the adapter's tensors hold {num_bytes} bytes, more than "
                f"{MAX_BYTES} allows ({most})",
                role=role,
            )

    def _check_shape(self, tensors: dict[str, torch.Tensor]) -> None:
        """Its bytes, and its rank: `models.max_adapter_rank` (each lora_A's rows)."""
        self.check_size(sum(t.numel() * t.element_size() for t in tensors.values()))
        most = self.registry.model_settings.max_adapter_rank
        ranks = [t.shape[0] for k, t in tensors.items() if ".lora_A." in k and t.dim() == 2]
        if ranks and max(ranks) > most:
            raise TooLarge(
                f"the adapter has rank {max(ranks)}, more than {MAX_RANK} allows ({most})",
                role=Role.ADAPTER_SOURCE,
            )

    # -- serving ---------------------------------------------------------------------------

    async def load(self, name: str, path: Path, caller: Caller) -> LoraAdapter:
        """Serve the adapter in PEFT's folder `path` as `name`: a new name at version 0
        (owned by `caller`), a name served before as its next version (its layout may
        change)."""
        self.check_push(name, caller)
        config, tensors = await asyncio.to_thread(read_folder, path, Role.ADAPTER_SOURCE)
        return await self.serve(
            Serving(name, tensors, config, str(path), caller, keep_layout=False)
        )

    async def push(self, name: str, file: Path, caller: Caller) -> LoraAdapter:
        """New tensors for adapter `name` (a safetensors file, PEFT's tensor names) as its
        next version: with its layers and shapes, and its config unless the file's metadata
        gives one (`CONFIG_METADATA`). A name not served needs that config, and is then
        served at version 0, owned by `caller`."""
        self.check_push(name, caller)
        config, tensors = await asyncio.to_thread(read_upload, file, Role.ADAPTER_SOURCE)
        return await self.serve(Serving(name, tensors, config, "upload", caller))

    async def serve(self, step: Serving) -> LoraAdapter:
        """`step`'s tensors as its adapter's next version (or `step.version`), once
        `check_push` passed (checked again here: the adapter may have changed hands, or
        others filled the server, meanwhile)."""
        name = step.name
        self._check_shape(step.tensors)
        async with self._lock:
            current = self.registry.adapters.get(name)
            if current is None and step.config is None:
                raise NotFound(
                    f"no adapter '{name}' is served; {step.first}",
                    role=Role.ADAPTER_CONFIG,
                )
            self.check_push(name, step.caller)
            version = step.version
            if version is None:
                last = self._last.get(name)
                version = last + 1 if last is not None else 0
            config = step.config if step.config is not None else current.config  # type: ignore[union-attr]
            build = AdapterBuild(config, step.tensors, name, version, step.source)
            adapter = await self.registry.build_adapter(build)
            if step.keep_layout and current is not None and not adapter.same_layout(current):
                raise invalid(
                    Role.ADAPTER_SOURCE,
                    f"the tensors adapt other layers, or have other shapes, than adapter "
                    f"'{name}' (version {current.version}); load a folder to change its layout",
                )
            self.registry.install(adapter)
            self._owners.setdefault(name, step.caller.owner)
            self._last[name] = version
        return adapter

    def unload(self, name: str, caller: Caller) -> LoraAdapter:
        """Stop serving adapter `name` to new requests (rows in flight finish with it)."""
        self.check_change(name, caller)
        adapter = self.registry.remove(name)
        del self._owners[name]
        return adapter

    # -- pauses ----------------------------------------------------------------------------

    async def pause(
        self, name: str, mode: PauseMode, caller: Caller
    ) -> tuple[LoraAdapter, AdapterGateState]:
        """Pause adapter `name` alone (`app.engine.adapter_gate`); its version now, and its
        state once paused."""
        self.check_change(name, caller)
        adapter = self.registry.adapters[name]
        state = await self.registry.adapter_gate(name).pause(mode)
        logger.info("adapter %s paused (%s)", name, mode)
        return adapter, state

    async def resume(self, name: str, caller: Caller) -> tuple[LoraAdapter, AdapterGateState]:
        self.check_change(name, caller)
        adapter = self.registry.adapters[name]
        state = await self.registry.adapter_gate(name).resume()
        logger.info("adapter %s resumed", name)
        return adapter, state
