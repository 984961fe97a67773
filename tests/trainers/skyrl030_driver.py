"""Drives SkyRL 0.3.0's own code (its PyPI release, unmodified) against the server at argv[1]
through a three-step loop (tests/trainers/skyrl_loop.py): generation by its
`RemoteInferenceClient`, and its weight sync as its trainer's rank 0 runs it:
`BroadcastTransferStrategy.create_init_info`, the client's `init_weight_update_communicator`
beside the trainer's rendezvous, then each step `BroadcastWeightTransferSender.send_chunks`
(the client's `/collective_rpc` calls start, `update_weights_nccl` with the packed update info
and finish, around the broadcast, then its barrier). The one piece that is not SkyRL's is the
transport it takes from vLLM: `NCCLWeightTransferEngine.trainer_init` and
`trainer_send_weights` are NCCL only (vLLM is not installed here), so the trainer's group is
vLLM's gloo group and the same packed buckets go over it (tests/e2e/vllm_group.py). With
`--nccl` (a GPU host with vllm: scripts/gpu-check.sh --trainers), SkyRL's sender runs whole.

SkyRL 0.3.0 does not import on Python 3.11 (pydantic refuses its `typing.TypedDict` there),
so it runs in .venv-skyrl (Python 3.12) from the folder scripts/setup-trainers.sh installs it
to, ahead of 0.4.0 on the path. Prints the loop's record as JSON."""

from __future__ import annotations

import asyncio
import json
import sys
import types
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from tests.e2e.server import free_port
from tests.e2e.vllm_group import gloo_group, send
from tests.trainers.skyrl_loop import three_steps


def vllm_nccl_transport() -> None:
    """`vllm.distributed.weight_transfer.nccl_engine` as SkyRL's sender imports it, with
    vLLM's `trainer_send_weights` sending over the gloo group instead of NCCL."""

    class NCCLWeightTransferEngine:
        @staticmethod
        def trainer_send_weights(iterator: Any, trainer_args: dict[str, Any]) -> None:
            size = trainer_args.get("packed_buffer_size_bytes", 1 << 30)
            send(trainer_args["group"], list(iterator), trainer_args.get("packed", False), size)

    module = types.ModuleType("vllm.distributed.weight_transfer.nccl_engine")
    module.NCCLWeightTransferEngine = NCCLWeightTransferEngine  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules[module.__name__] = module


async def main(url: str, name: str, stop_id: int, source: str, nccl: bool) -> dict[str, Any]:
    """`nccl`: SkyRL's own sender end to end (`create_sender`: vLLM's NCCL engine, with vllm
    installed and the trainer on a GPU of its own), not the gloo stand-in."""
    import skyrl
    from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import (
        RemoteInferenceClient,
    )
    from skyrl.backends.skyrl_train.weight_sync.base import WeightChunk
    from skyrl.backends.skyrl_train.weight_sync.broadcast_strategy import (
        BroadcastTransferStrategy,
        BroadcastWeightTransferSender,
    )

    if not nccl:
        vllm_nccl_transport()
    client = RemoteInferenceClient(
        proxy_url=url, server_urls=[url], data_parallel_size=1, model_name=name
    )
    # the trainer's own process group (rank 0 of one), in which SkyRL's sender runs
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        total, _ = await client.get_world_size()
        config = SimpleNamespace(run_engines_locally=False)  # an external server
        init_info = BroadcastTransferStrategy.create_init_info(config, total)
        joined = asyncio.create_task(client.init_weight_update_communicator(init_info))
        if nccl:
            sender = await asyncio.to_thread(
                BroadcastTransferStrategy.create_sender, init_info, client
            )
        else:
            group = await asyncio.to_thread(
                gloo_group, init_info.master_addr, init_info.master_port, init_info.world_size
            )
            sender = BroadcastWeightTransferSender(init_info, group, client)
        await joined
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else None

        async def generate(prompts: list[list[int]], params: dict[str, Any]) -> dict[str, Any]:
            sessions = [f"s{i}" for i in range(len(prompts))]
            batch = {"prompt_token_ids": prompts, "sampling_params": params}
            return dict(await client.generate({**batch, "session_ids": sessions}))

        async def push(tensors: list[tuple[str, torch.Tensor]]) -> None:
            if device is not None:
                tensors = [(n, t.to(device)) for n, t in tensors]
            # what SkyRL's FSDP worker extracts: one chunk per parameter, its dtype's name
            chunks = [
                WeightChunk(names=[n], dtypes=[str(t.dtype)], shapes=[list(t.shape)], tensors=[t])
                for n, t in tensors
            ]
            metadata = {
                "names": [n for n, _ in tensors],
                "dtype_names": [str(t.dtype).split(".")[-1] for _, t in tensors],
                "shapes": [list(t.shape) for _, t in tensors],
            }
            await sender.send_chunks(chunks, weight_metadata=metadata)

        out = await three_steps(source, stop_id, generate, push)
        out["skyrl"] = skyrl.__file__
        return out
    finally:
        await client.teardown()
        dist.destroy_process_group()


if __name__ == "__main__":
    url, name, stop_id, source = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    nccl = sys.argv[5:] == ["--nccl"]
    if nccl:
        torch.cuda.set_device(torch.cuda.device_count() - 1)  # the server has the first
    print(json.dumps(asyncio.run(main(url, name, stop_id, source, nccl))))
