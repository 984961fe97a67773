"""The LoRA adapters the policy serves, by name and version: the part of `ModelRegistry` that
installs, pauses and removes them (who may change an adapter, and its versions' numbering, are
`app.updates.adapters`' rules; the engine builds them)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from app.common.failures import NotFound, NotReady, Unsupported
from app.common.roles import Role
from app.engine.adapter_gate import AdapterGate, AdapterGateState
from app.engine.served import ServedModel
from app.weights.lora import AdapterBuild, LoraAdapter

if TYPE_CHECKING:
    from app.config_groups import ModelSettings

logger = logging.getLogger(__name__)


class AdapterRegistry:
    model_settings: ModelSettings

    def __init__(self, paused_wait_s: float | None) -> None:
        self.adapters: dict[str, LoraAdapter] = {}
        """LoRA adapters on the policy by name, each the version new requests get."""
        self._older: dict[str, list[LoraAdapter]] = {}
        """Each adapter's versions before its current one still resident (newest first): a
        request names one as `NAME@VERSION` (`models.resident_adapter_versions`)."""
        self.adapter_gates: dict[str, AdapterGate] = {}
        """Each served adapter's own pause (`app.engine.adapter_gate`)."""
        self.paused_wait_s = paused_wait_s
        """How long a request waits for a paused model or adapter (None: no limit)."""

    if TYPE_CHECKING:

        def get(self, name: str, role: Role = Role.MODEL) -> ServedModel: ...

        def not_ready_reason(self) -> str | None: ...

    def adapter_base(self) -> ServedModel:
        """The policy, when its engine serves LoRA adapters."""
        base = self.get("policy")
        if not base.backend.capabilities.adapters:
            raise Unsupported(
                f"the {base.backend.info.backend} backend serves no LoRA "
                "adapters here (the transformers backend does; a vLLM engine does when started "
                "with RLSERVE_VLLM__MAX_LORAS)",
                role=Role.ADAPTER_SOURCE,
            )
        return base

    async def build_adapter(self, build: AdapterBuild) -> LoraAdapter:
        """`build` as an adapter fit to the policy (refused naming the role `Role.ADAPTER_SOURCE`),
        not served yet (`install`)."""
        return await self.adapter_base().backend.build_adapter(build)

    def install(self, adapter: LoraAdapter) -> None:
        """Serve `adapter` to new requests under its name (rows in flight keep the version
        they started with; `models.resident_adapter_versions` stay resident by version)."""
        name = adapter.name
        if (previous := self.adapters.get(name)) is not None:
            kept = self.model_settings.resident_adapter_versions - 1
            resident = [previous, *self._older.get(name, [])]
            self._older[name] = resident[:kept]
            self._forget(resident[kept:])
        self.adapters[name] = adapter
        if name not in self.adapter_gates:
            self.adapter_gates[name] = AdapterGate(name, paused_wait_s=self.paused_wait_s)
        logger.info(
            "adapter %s v%d served from %s (rank %d, %d layers)",
            name,
            adapter.version,
            adapter.source,
            adapter.rank,
            len(adapter.modules),
        )

    def adapter_gate(self, name: str) -> AdapterGate:
        """Served adapter `name`'s gate (refused naming the role `Role.ADAPTER` when none is)."""
        if (reason := self.not_ready_reason()) is not None:
            raise NotReady(reason)
        gate = self.adapter_gates.get(name)
        if gate is None:
            raise NotFound(
                f"no adapter '{name}' is served (have {sorted(self.adapters)})",
                role=Role.ADAPTER,
            )
        return gate

    def remove(self, name: str) -> LoraAdapter:
        """Stop serving adapter `name` to new requests (rows in flight finish with it;
        requests waiting on its pause are refused)."""
        gate = self.adapter_gate(name)
        adapter = self.adapters.pop(name)
        self._forget([adapter, *self._older.pop(name, [])])
        del self.adapter_gates[name]
        gate.close()
        logger.info("adapter %s unloaded", name)
        return adapter

    def _forget(self, versions: list[LoraAdapter]) -> None:
        """Versions no longer served: the engine keeps nothing of them beyond the rows in
        flight that still use them, so their memory goes with the last such row."""
        backend = self.get("policy").backend
        for adapter in versions:
            backend.forget_adapter(adapter)

    def adapter_state(self, name: str) -> AdapterGateState | None:
        """Served adapter `name`'s pause state (None once unloaded)."""
        gate = self.adapter_gates.get(name)
        return None if gate is None else gate.state()
