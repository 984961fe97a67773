"""Code that runs inside vLLM's worker processes.

- `WeightLoaderExtension` (mixed into the workers through `worker_extension_cls`): reload the
  weights in place from safetensors files through vLLM's own reload path, which re-runs the
  processing (fusing, repacking) that follows loading; and the two calls vLLM's transfer
  protocol lacks: how the reception stands, and dropping it.
- `StagedTransferEngine`: rlserve's weight-transfer engine, registered in vLLM's engine
  registry as "rlserve" (importing this module registers it, and vLLM imports it in every
  worker before the model loads). It follows vLLM's protocol (init → start → update → finish)
  over the same collective the transformers backend uses (gloo on CPU, NCCL on GPUs), but
  stages what it receives and loads it only at finish: vLLM's own engines load each bucket as
  it arrives, so a trainer lost mid-transfer would leave a half-updated model.
- `carry_raw_log_probs` (app.engine.vllm.raw_log_probs): in processed mode, each sampling step
  also carries the sampled tokens' raw log-probs (applied when this module is imported).
- `fix_lora_ops`: two fixes to vLLM's LoRA (applied when this module is imported, so in
  every worker before the model runs)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from app.engine.vllm.raw_log_probs import carry_raw_log_probs
from app.weights.checkpoint import to_safetensors
from app.weights.staging import Reception, TransferPlan
from app.weights.transport import Connection, Group, open_group

logger = logging.getLogger(__name__)
ENGINE_NAME = "rlserve"


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

    def rlserve_transfer_status(self, of_model: bool = True) -> str | None:
        """None once every announced tensor arrived; "pending" before; else the error.
        `of_model`: they are the model's (else an adapter's, which the model's fused
        parameters do not constrain)."""
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, StagedTransferEngine):
            return "this worker has no rlserve weight-transfer engine"
        return engine.status(of_model)

    def rlserve_transfer_checkpoint(self) -> bytes | None:
        """The staged tensors as one safetensors file, from the first worker only."""
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, StagedTransferEngine) or engine.reception is None:
            raise RuntimeError("no weight update was received here")
        if getattr(self, "rank", 0) != 0:
            return None
        return to_safetensors(engine.reception.result(0))

    def rlserve_transfer_abort(self) -> None:
        """Drop the staged update and end the worker's update session."""
        engine = getattr(self, "weight_transfer_engine", None)
        if isinstance(engine, StagedTransferEngine):
            engine.drop()
        self._weight_update_active = False


@dataclass
class StagedUpdateInfo:
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    buckets: list[int] | None = None
    in_band: bool = False


def _engine_class() -> type:
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    class StagedTransferEngine(WeightTransferEngine[Any, Any]):
        init_info_cls = Connection  # what the backend's init sends, field for field
        update_info_cls = StagedUpdateInfo

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.group: Group | None = None
            self.bucket_bytes = 0
            self.reception: Reception | None = None

        def init_transfer_engine(self, init_info: Connection) -> None:
            self.group = open_group(init_info, self.parallel_config.rank, self.device)
            self.bucket_bytes = init_info.bucket_bytes

        def start_weight_update(self) -> None:
            if self.group is None:
                raise RuntimeError("no weight-transfer group: init first")
            self.drop()
            # Buckets arrive on the model's device and are kept in host memory: a GPU has no
            # room for a second copy of the model next to its KV cache.
            self.reception = Reception(self.group.receive, self.device, torch.device("cpu"))

        def update_weights(self, update_info: dict[str, Any]) -> None:
            """Start receiving in the background and return: the engine keeps serving."""
            if self.reception is None:
                raise RuntimeError("no weight update in progress: start first")
            info = self.parse_update_info(update_info)
            if info.in_band:
                plan = TransferPlan.in_band_plan(None)  # (checked as the model loads it)
            else:
                plan = TransferPlan.parse(
                    info.names, info.dtype_names, info.shapes, info.buckets, self.bucket_bytes
                )
            self.reception.add(plan)

        def receive_weights(self, update_info: Any) -> None:
            raise NotImplementedError("weights arrive through update_weights")

        def status(self, of_model: bool = True) -> str | None:
            if self.reception is None:
                return "no weight update in progress"
            if (status := self.reception.status()) is not None:
                return status
            names = set(self.reception.result(0))
            if of_model and (missing := _unfused(self.model, names)) is not None:
                return f"InvalidInput: {missing}"
            return None

        def finish_weight_update(self) -> None:
            """Load the staged tensors through vLLM's layerwise reload (the model's own
            loaders, then the processing that follows loading: fusing, tying). Modules the
            update does not touch keep their values."""
            from vllm.model_executor.model_loader.reload import (
                finalize_layerwise_reload,
                initialize_layerwise_reload,
            )

            if self.reception is None:
                raise RuntimeError("no weight update in progress")
            staged = self.reception.result(0)
            initialize_layerwise_reload(self.model)
            self.model.load_weights(iter(staged.items()))
            finalize_layerwise_reload(self.model, self.model_config)
            self.drop()

        def drop(self) -> None:
            reception, self.reception = self.reception, None
            if reception is not None:
                reception.close()

        def shutdown(self) -> None:
            self.drop()
            group, self.group = self.group, None
            if group is not None:
                group.close()

    return StagedTransferEngine


def _unfused(model: Any, names: set[str]) -> str | None:
    """vLLM fuses some checkpoint tensors into one parameter (q, k and v into qkv): an update
    must carry all of them or none. Why it does not, or None."""
    mapping: dict[str, list[str]] = getattr(model, "packed_modules_mapping", {}) or {}
    for name in names:
        for parts in mapping.values():
            for part in parts:
                token = f".{part}."
                if token not in name:
                    continue
                for sibling in parts:
                    other = name.replace(token, f".{sibling}.")
                    if other not in names:
                        return f"'{name}' is fused with '{other}' by vLLM: send them together"
    return None


def fix_lora_ops() -> None:
    """Two fixes to vLLM's LoRA (0.32), which rlserve's adapter tests found:

    - Its CPU ops pick each token's adapter by its slot index, and a token of no adapter has
      index -1, which in PyTorch's indexing picks the last slot's adapter: rows of the policy
      batched with rows of an adapter got an adapter's term added (vLLM's GPU kernels skip
      such tokens). Patched so their first LoRA product is zero, and with it their whole LoRA
      term (every later product is of that zero).
    - Its LoRA on the output head maps rows by the sampled rows, so prompt log-probs (the
      scoring pass) with LoRA on fail on a size mismatch (vLLM issues #16668, #29955). rlserve
      serves no adapter of the output head (`app.weights.lora_layout` refuses one), so that
      term is always zero: it is skipped, on every platform."""
    try:
        from vllm.lora.ops.torch_ops import lora_ops
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:
        return
    original = lora_ops.bgmv_shrink
    if getattr(original, "masks_tokens_without_lora", False):
        return

    def bgmv_shrink(
        inputs: torch.Tensor,
        lora_b_weights: torch.Tensor,
        output_tensor: torch.Tensor,
        lora_indices_tensor: torch.Tensor,
        scaling: float = 1.0,
    ) -> None:
        original(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling)
        without = lora_indices_tensor < 0
        output_tensor[: without.shape[0]][without] = 0

    bgmv_shrink.masks_tokens_without_lora = True  # type: ignore[attr-defined]
    lora_ops.bgmv_shrink = bgmv_shrink  # what sgmv_shrink (prefill) calls
    punica_cpu.bgmv_shrink = bgmv_shrink  # (decode)

    def no_output_head_lora(self: Any, y: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return y  # the logits as they are (updated in place or returned, by platform)

    punica_cpu.PunicaWrapperCPU.add_lora_logits = no_output_head_lora
    try:
        from vllm.lora.punica_wrapper import punica_gpu
    except ImportError:  # (no GPU kernels in this build)
        return
    punica_gpu.PunicaWrapperGPU.add_lora_logits = no_output_head_lora


def register() -> None:
    """Register the engine in vLLM's registry (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if ENGINE_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(ENGINE_NAME, StagedTransferEngine)


try:
    StagedTransferEngine: Any = _engine_class()
except ImportError:  # no vLLM here: the transformers backend needs none of this
    StagedTransferEngine = None
else:
    register()
    fix_lora_ops()
    carry_raw_log_probs()
