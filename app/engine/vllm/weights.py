"""Weight updates on a vLLM engine: by files (`WeightFiles`: where every tensor's current value
lives, since vLLM reloads whole models) and over the collective transfer (`VLLMTransfer`)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from rlserve_client.weight_delta import tensor_checksum
from safetensors import safe_open
from safetensors.torch import save_file

from app.common.failures import InvalidInput
from app.common.roles import Role
from app.weights.checkpoint import Layout, checkpoint_files, read_layout
from app.weights.delta import Change, write_changes
from app.weights.staging import TransferPlan
from app.weights.transfer_engine import WeightTransfer, rendezvous_listening
from app.weights.transport import Connection

logger = logging.getLogger(__name__)


class VLLMTransfer(WeightTransfer):
    """vLLM's own weight-transfer calls on the engine, served in the workers by the "rlserve"
    engine (app.engine.vllm.worker): the data arrives while the engine keeps generating."""

    POLL_S = 0.02

    def __init__(self, engine: Any, transferred: set[str]) -> None:
        self.engine = engine
        self.ranks = int(engine.vllm_config.parallel_config.world_size)
        self.transferred = transferred
        """The backend's record of the tensors transfers set (committed updates add theirs)."""
        self._announced: set[str] = set()
        self._adapter = False

    async def init(self, connection: Connection) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await rendezvous_listening(connection)
        info = dataclasses.asdict(connection)
        await self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))

    async def start(self, *, adapter: bool = False) -> None:
        await self.engine.collective_rpc("rlserve_transfer_abort")
        self._announced, self._adapter = set(), adapter
        await self.engine.start_weight_update()

    async def update(self, plan: TransferPlan) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        request = WeightTransferUpdateRequest(update_info=plan.announcement())
        await self.engine.update_weights(request)
        self._announced |= {spec.name for spec in plan.tensors}

    async def received(self, timeout_s: float) -> None:
        """Poll the workers (a call that waited would stall the engine's loop)."""
        async with asyncio.timeout(timeout_s):
            while True:
                states = await self.engine.collective_rpc(
                    "rlserve_transfer_status", args=(not self._adapter,)
                )
                problems = [s for s in states if s is not None]
                if not problems:
                    return
                failed = [p for p in problems if p != "pending"]
                if failed:
                    if failed[0].startswith("InvalidInput: "):
                        raise InvalidInput(
                            failed[0].removeprefix("InvalidInput: "), role=Role.TENSORS
                        )
                    raise RuntimeError(failed[0])
                await asyncio.sleep(self.POLL_S)

    async def checkpoint(self) -> bytes:
        """From the first worker (every worker received every tensor whole)."""
        files = await self.engine.collective_rpc("rlserve_transfer_checkpoint")
        return next(f for f in files if f is not None)

    async def commit(self, version: int) -> None:
        await self.engine.finish_weight_update(weight_version=str(version))
        self.transferred |= self._announced

    async def abort(self) -> None:
        await self.engine.collective_rpc("rlserve_transfer_abort")

    async def close(self) -> None:
        await self.abort()
        await self.engine.shutdown_weight_transfer_engine()


class WeightFiles:
    """Where the current value of every tensor lives: the served checkpoint's files, or kept
    copies of later updates. vLLM reloads whole models (it repacks layers after loading), so a
    partial update is completed with the current values of the other tensors; and since the
    model's own tensors live in vLLM's processes, these files are what the server shows of
    them (a delta's base, the digest)."""

    def __init__(self, location: dict[str, Path], layout: Layout, directory: Path) -> None:
        self.location = location
        self.layout = layout
        self.directory = directory
        self._staged: tuple[dict[str, Path], list[Path]] | None = None

    @classmethod
    def of_source(cls, source: str, directory: Path) -> WeightFiles | None:
        path = Path(source)
        if not path.is_dir():
            logger.warning("%s is not a local directory: weight updates are refused", source)
            return None
        location: dict[str, Path] = {}
        layout: Layout = {}
        for file in checkpoint_files(path):
            file_layout = read_layout([file], Role.MODEL)
            layout |= file_layout
            location |= dict.fromkeys(file_layout, file)
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True, exist_ok=True)
        return cls(location, layout, directory)

    def tensor(self, name: str) -> torch.Tensor | None:
        """The current value of tensor `name`, read from its file (None: no file has it)."""
        file = self.location.get(name)
        if file is None:
            return None
        with safe_open(str(file), framework="pt") as f:
            tensor: torch.Tensor = f.get_tensor(name)
        return tensor

    def stored_name(self, name: str, *, tied: bool) -> str:
        """The name `name`'s value is stored under in its file (a tied output head that no
        file holds: the embedding's)."""
        if tied and name == "lm_head.weight" and name not in self.location:
            return "model.embed_tokens.weight"
        return name

    def stored_names(
        self, layout: Iterable[str], *, tied: bool, names: Iterable[str] | None = None
    ) -> dict[str, str]:
        """Each tensor of `layout` (all, or `names` and those tied to them) to the name its
        file stores it under (`stored_name`)."""
        stored = {name: self.stored_name(name, tied=tied) for name in layout}
        if names is None:
            return stored
        wanted = {stored.get(name, name) for name in names}
        return {name: s for name, s in stored.items() if s in wanted}

    def changed_file(self, changes: dict[str, Change]) -> Path:
        """A checkpoint of the changed tensors, each rebuilt from its current value, in the
        kept files' folder (blocking: call in a thread); `stage(..., move=True)` takes it."""
        state: dict[str, torch.Tensor] = {}
        patches: dict[str, Change] = {}
        for name, change in changes.items():
            if isinstance(change, torch.Tensor):
                state[name] = change
                continue
            base = self.tensor(name)
            assert base is not None  # (staged against it)
            state[name], patches[name] = base.clone(), change
        write_changes(state, patches)
        path = self.directory / f"delta-{uuid.uuid4().hex}.safetensors"
        save_file({name: t.contiguous() for name, t in state.items()}, str(path))
        return path

    def checksums(
        self, names: dict[str, str], known: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        """The checksum (`rlserve_client.weight_delta.DIGEST`) of each name's tensor, by the
        name whose file holds it (`names`: a name to the one its file stores it under), taking
        the `known` checksums as they are; each tensor read once, a file opened once."""
        known = known or {}
        by_file: dict[Path, set[str]] = {}
        for stored in set(names.values()):
            if stored not in known:
                by_file.setdefault(self.location[stored], set()).add(stored)
        found = {stored: known[stored] for stored in names.values() if stored in known}
        for file, stored_names in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for stored in stored_names:
                    found[stored] = tensor_checksum(f.get_tensor(stored))
        return {name: known.get(name) or found[stored] for name, stored in names.items()}

    def stage(self, files: list[Path], *, move: bool = False) -> list[tuple[str, list[str]]]:
        """Keep `files` (copies; with `move`, the files themselves); return (file, names)
        covering every tensor."""
        location = dict(self.location)
        copies = []
        for file in files:
            copy = self.directory / f"{uuid.uuid4().hex}.safetensors"
            if move:
                file.replace(copy)
            else:
                shutil.copyfile(file, copy)
            copies.append(copy)
            location |= dict.fromkeys(read_layout([copy], Role.TENSORS), copy)
        self._staged = (location, copies)
        by_file: dict[Path, list[str]] = {}
        for name, file in location.items():
            by_file.setdefault(file, []).append(name)
        return [(str(file), names) for file, names in by_file.items()]

    def commit(self) -> None:
        assert self._staged is not None
        self.location, _ = self._staged
        self._staged = None
        used = set(self.location.values())
        for kept in self.directory.glob("*.safetensors"):
            if kept not in used:
                kept.unlink()

    def rollback(self) -> None:
        if self._staged is not None:
            for copy in self._staged[1]:
                copy.unlink(missing_ok=True)
        self._staged = None
