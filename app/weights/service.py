"""Weight updates: check a safetensors checkpoint against the served model, then swap it in
while all model work is paused; the version goes up only when the update succeeded."""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

from app.config import Settings
from app.engine.registry import ModelRegistry
from app.errors import APIError
from app.weights.checkpoint import check_layout, checkpoint_files, read_layout
from app.weights.protocol import LoadWeightsRequest, WeightsUpdated, WeightsVersion

logger = logging.getLogger(__name__)


class WeightsService:
    def __init__(self, registry: ModelRegistry, settings: Settings) -> None:
        self.registry = registry
        self.settings = settings

    def version(self) -> WeightsVersion:
        versions = self.registry.versions
        return WeightsVersion(
            policy_version=versions["policy"], reference_version=versions["reference"]
        )

    async def load(self, request: LoadWeightsRequest) -> WeightsUpdated:
        files = checkpoint_files(Path(request.path))
        return await self._apply(files, request.model, "path")

    async def upload(self, chunks: AsyncIterator[bytes], model: str) -> WeightsUpdated:
        """Stream the body to a file on disk (memory stays bounded), then apply it."""
        uploads = self.settings.data_dir / "uploads"
        uploads.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=uploads, suffix=".safetensors") as sink:
            size = 0
            async for chunk in chunks:
                size += len(chunk)
                if size > self.settings.max_weights_bytes:
                    raise APIError(
                        413,
                        f"body: the upload exceeds {self.settings.max_weights_bytes} bytes",
                        param="body",
                    )
                sink.write(chunk)
            sink.flush()
            if size == 0:
                raise APIError(400, "body: the upload is empty", param="body")
            return await self._apply([Path(sink.name)], model, "body")

    async def _apply(self, files: list[Path], model: str, param: str) -> WeightsUpdated:
        update = read_layout(files, param)
        served = self.registry.get(model)
        expected = served.backend.weight_layout()
        if expected is not None:
            check_layout(update, expected)
        num_bytes = sum(f.stat().st_size for f in files)
        async with self.registry.writing(model) as target:
            start = time.perf_counter()
            await target.backend.update_weights(files)
            paused = time.perf_counter() - start
        logger.info(
            "loaded %d tensors (%d bytes) into %s in %.3f s", len(update), num_bytes, model, paused
        )
        versions = self.registry.versions
        return WeightsUpdated(
            model=model,  # type: ignore[arg-type]
            policy_version=versions["policy"],
            reference_version=versions["reference"],
            num_tensors=len(update),
            num_bytes=num_bytes,
            seconds=paused,
        )
