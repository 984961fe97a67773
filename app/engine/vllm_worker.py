"""Mixed into vLLM's workers (`worker_extension_cls`): reload the model's weights in place from
safetensors files through vLLM's own reload path, which re-runs the processing (fusing,
repacking) that follows loading."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def _tensors(sources: list[tuple[str, list[str]]]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path, names in sources:
        with safe_open(path, framework="pt") as f:
            for name in names:
                yield name, f.get_tensor(name)


class WeightLoaderExtension:
    def rlserve_reload_weights(self, sources: list[tuple[str, list[str]]]) -> None:
        """`sources`: (file, tensor names to read from it); together every model tensor."""
        runner: Any = self.model_runner  # type: ignore[attr-defined]
        runner.reload_weights(weights_iterator=_tensors(sources), is_checkpoint_format=True)
