"""A vLLM engine's LoRA adapters: each served version is a PEFT folder of its own and a LoRA id
of its own (vLLM's LoRA layers, with RLSERVE_VLLM__MAX_LORAS), so requests in flight keep the
version they started with; the folder and the id go when nothing holds the version any more."""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

import torch

from app.common.failures import Unsupported, invalid
from app.common.roles import Role
from app.weights.lora import AdapterBuild, LoraAdapter
from app.weights.lora_layout import CONFIG, WEIGHTS, parse_adapter


class VLLMLoras:
    def __init__(self, engine: Any, rank: int | None, folder: Path | None = None) -> None:
        self.engine = engine
        self.rank = rank
        """The largest adapter rank the engine's LoRA layers take; None: LoRA off."""
        self.folder = Path()
        """One PEFT folder per adapter version, as vLLM loads LoRA (cleared at start: ids
        count from 1 again)."""
        if rank is not None:
            self.folder = folder or Path(tempfile.mkdtemp(prefix="rlserve-adapters-"))
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder.mkdir(parents=True)
        self._requests: weakref.WeakKeyDictionary[LoraAdapter, Any] = weakref.WeakKeyDictionary()
        """Each served adapter version's vLLM LoRARequest, while anything holds the version."""
        self._ids = itertools.count(1)
        self._released: list[int] = []
        """LoRA ids of versions no longer held (appended by their finalizers, from any thread):
        removed from the engine at the next adapter's load."""

    def request_of(self, adapter: LoraAdapter) -> Any:
        """The LoRARequest a row naming `adapter` runs with."""
        return self._requests[adapter]

    async def build(self, build: AdapterBuild) -> LoraAdapter:
        """One version of an adapter as vLLM loads LoRA: a PEFT folder of its own (vLLM checks
        it against the model as it loads it, here, before any request names it) and a LoRA id
        of its own, so requests in flight keep the version they started with. The folder and
        the id go when nothing holds the version any more."""
        from vllm.lora.request import LoRARequest

        role = Role.ADAPTER_SOURCE
        if self.rank is None:
            raise Unsupported(
                "this vLLM engine serves no LoRA adapters; start it with "
                "RLSERVE_VLLM__MAX_LORAS (how many adapters one batch may mix)",
                role=role,
            )
        adapter = parse_adapter(build, None)
        if adapter.rank > self.rank:
            raise Unsupported(
                f"the adapter's rank {adapter.rank} is above this engine's largest, "
                f"RLSERVE_VLLM__MAX_LORA_RANK={self.rank}",
                role=role,
            )
        for released in self._released[:]:
            self._released.remove(released)
            await self.engine.remove_lora(released)
        lora_id = next(self._ids)
        folder = self.folder / str(lora_id)
        await asyncio.to_thread(_write_peft_folder, folder, build.config, build.tensors)
        request = LoRARequest(
            lora_name=f"{build.name}@{build.version}", lora_int_id=lora_id, lora_path=str(folder)
        )
        try:
            await self.engine.add_lora(request)
        except Exception as exc:
            shutil.rmtree(folder, ignore_errors=True)
            raise invalid(role, f"vLLM did not load the adapter: {exc}") from exc
        self._requests[adapter] = request
        weakref.finalize(adapter, _release, self._released, lora_id, folder)
        return adapter


def _write_peft_folder(
    folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> None:
    """An adapter in PEFT's layout, as vLLM reads one (blocking: call in a thread)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / CONFIG).write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / WEIGHTS))


def _release(released: list[int], lora_id: int, folder: Path) -> None:
    """A version nothing holds any more (a finalizer, on any thread): its folder goes now, its
    LoRA id at the engine's next adapter load."""
    released.append(lora_id)
    shutil.rmtree(folder, ignore_errors=True)
