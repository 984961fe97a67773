"""Mixed into vLLM's workers (`worker_extension_cls`): load safetensors files into the live
model through vLLM's own `load_weights`, which maps HF names onto fused layers."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class WeightLoaderExtension:
    def rlserve_load_weights(self, paths: list[str]) -> int:
        from app.weights.checkpoint import iter_tensors

        model: Any = self.get_model()  # type: ignore[attr-defined]
        loaded = model.load_weights(weights=iter_tensors([Path(p) for p in paths]))
        return len(loaded) if loaded is not None else 0
