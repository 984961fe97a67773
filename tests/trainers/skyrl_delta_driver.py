"""Drives SkyRL 0.4.0's checkpoint-delta weight sync, its own code unmodified, against the
server at argv[1]: its `DeltaTrainerWeightTransferEngine` (`trainer_init`, then `send_weights`
each step) publishes each step's weights with its `DeltaCheckpointPublisher` as XOR deltas
under a folder (argv[3]) and drives the server with its `SkyrlWeightSyncClient`:
/init_weight_transfer_engine, /fetch_weights, /pause, /reset_prefix_cache,
/start_weight_update, /update_weights, /finish_weight_update, /resume. The policy's folder
(argv[2]) is its base, as `base_model_path`. After each step it scores a sequence on the
server and with its own forward, and prints both as JSON for tests/trainers/test_skyrl.py.

vLLM is not installed (SkyRL's engine subclasses two of vLLM's classes, and its sender module
imports two of vLLM's names): those are stubbed here as vLLM defines them (the base engine
keeps the client, the source and whether it sends; `is_sender` is rank 0), nothing of SkyRL's.
Runs in .venv-skyrl (SkyRL needs Python 3.12)."""

from __future__ import annotations

import dataclasses
import json
import sys
import types
import urllib.request
from pathlib import Path
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def stub_vllm() -> None:
    """`vllm.distributed.weight_transfer.base` and `.packed_tensor`, the names SkyRL imports."""

    @dataclasses.dataclass
    class TrainerInitInfo:
        rank: int = dataclasses.field(default=0, kw_only=True)

        @property
        def is_sender(self) -> bool:
            return self.rank == 0

    class TrainerWeightTransferEngine(Generic[T]):
        def __init__(self, *, client: Any, source: Any, is_sender: bool) -> None:
            self.client, self.source, self.is_sender = client, source, is_sender

    base = types.ModuleType("vllm.distributed.weight_transfer.base")
    base.TrainerInitInfo = TrainerInitInfo  # type: ignore[attr-defined]
    base.TrainerWeightTransferEngine = TrainerWeightTransferEngine  # type: ignore[attr-defined]
    base.VLLMWeightSyncClient = object  # type: ignore[attr-defined]
    base.WeightSource = object  # type: ignore[attr-defined]
    packed = types.ModuleType("vllm.distributed.weight_transfer.packed_tensor")
    packed.DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules[base.__name__] = base
    sys.modules[packed.__name__] = packed


def scored(url: str, sequence: list[int]) -> list[float]:
    body = json.dumps({"tokens": [sequence]}).encode()
    request = urllib.request.Request(
        f"{url}/v1/logprobs", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request) as answer:
        return list(json.load(answer)["outputs"][0]["log_probs"]["full"][1:])


def main(url: str, source: str, sync_dir: str) -> dict[str, Any]:
    stub_vllm()
    import torch
    from skyrl.backends.skyrl_train.weight_sync.control_plane import SkyrlWeightSyncClient
    from skyrl.backends.skyrl_train.weight_sync.delta.trainer import (
        DeltaTrainerInitInfo,
        DeltaTrainerWeightTransferEngine,
    )
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    folder = Path(sync_dir)
    info = DeltaTrainerInitInfo(
        base_model_path=source,
        sync_dir=str(folder / "published"),
        local_checkpoint_dir=str(folder / "trainer-local"),
        publish_staging_dir=str(folder / "staging"),
        rank=0,
    )
    client = SkyrlWeightSyncClient([url])
    engine = DeltaTrainerWeightTransferEngine.trainer_init(info, client=client, source=[])
    engine.skyrl_set_reset_prefix_cache(True)
    sequence = [5, 6, 7, 8, 9, 10, 11, 12]
    steps = []
    for step in range(3):
        with torch.no_grad():  # a sparse step, as an optimizer's looks in bfloat16
            for parameter in model.parameters():
                moved = torch.rand(parameter.shape) < 0.05
                parameter.add_(torch.randn(parameter.shape) * 0.01 * moved)
            logits = model(torch.tensor([sequence])).logits[0, :-1]
            own = logits.log_softmax(-1).gather(-1, torch.tensor(sequence[1:])[:, None])
        engine.source = list(model.state_dict().items())
        engine.send_weights()
        steps.append({"step": step, "served": scored(url, sequence), "own": own[:, 0].tolist()})
    published = sorted(p.name for p in (folder / "published").iterdir())
    return {"steps": steps, "published": published}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3])))
