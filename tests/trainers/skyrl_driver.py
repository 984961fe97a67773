"""Drives SkyRL 0.4.0's own `RemoteInferenceClient` (unmodified) against the server at
argv[1], the way SkyRL's generator and its Tinker-style sampler call it, and prints what the
client returned as JSON for tests/trainers/test_skyrl.py to check. With `loop` (and the
policy's folder), a three-step loop (tests/trainers/skyrl_loop.py) whose weight sync is
SkyRL's `SkyrlWeightSyncClient` with its `nccl_init_payloads`, driven as vLLM's trainer engine
drives it (`NCCLTrainerWeightTransferEngine`: `trainer_init`, then each step `send_weights`,
which stamps the packing on every update info, as vLLM before 0.32 reads it); that engine is
vLLM's and NCCL only, so its calls are made here in its order, its broadcasts over vLLM's gloo
group (tests/e2e/vllm_group.py). Runs in .venv-skyrl: SkyRL needs Python 3.12 (and torch,
which its client module imports)."""

from __future__ import annotations

import asyncio
import json
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import (
    RemoteInferenceClient,
)

from tests.e2e.server import free_port
from tests.e2e.vllm_group import gloo_group, send
from tests.trainers.skyrl_loop import sampling_params, three_steps


def paused(url: str) -> bool:
    with urllib.request.urlopen(f"{url}/is_paused") as answer:
        return bool(json.load(answer)["is_paused"])


async def main(url: str, model: str, stop_id: int) -> dict[str, object]:
    client = RemoteInferenceClient(
        proxy_url=url, server_urls=[url], data_parallel_size=1, model_name=model
    )
    out: dict[str, object] = {}
    try:
        params = sampling_params(stop_id, 8)
        generated = await client.generate(
            {
                "prompt_token_ids": [[5, 6, 7, 8], [40, 41]],
                "sampling_params": params,
                "session_ids": ["a", "b"],
            }
        )
        out["generate"] = {
            key: generated[key]
            for key in ("responses", "response_ids", "response_logprobs", "stop_reasons")
        }  # type: ignore[literal-required]
        sampled = await client.sample(
            {
                "json": {
                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7, 8, 9]}]},
                    "num_samples": 2,
                    "sampling_params": {"max_tokens": 4, "seed": 3, "stop_tokens": [stop_id]},
                    "include_prompt_logprobs": True,
                    "topk_prompt_logprobs": 2,
                }
            }
        )
        out["sample"] = sampled
        out["tokenize"] = await client.tokenize(["2 + 3 ="])
        out["detokenize"] = await client.detokenize([[97, 98, 99]])
        await client.pause_generation()
        out["paused"] = paused(url)
        await client.resume_generation()
        out["resumed"] = not paused(url)
        out["world_size"] = list(await client.get_world_size())
        await client.reset_prefix_cache()
    finally:
        await client.teardown()
    # Without --served-model-name for it, SkyRL's model name (its policy's model path by
    # default) names nothing the server serves: its own error says what to do.
    unnamed = RemoteInferenceClient(
        proxy_url=url, server_urls=[url], data_parallel_size=1, model_name="/models/policy"
    )
    try:
        await unnamed.generate(
            {
                "prompt_token_ids": [[5, 6, 7, 8]],
                "sampling_params": sampling_params(stop_id, 2),
                "session_ids": ["c"],
            }
        )
        out["unnamed"] = {"status": 200}
    except Exception as exc:  # (whatever SkyRL raises: its status and words)
        out["unnamed"] = {"status": getattr(exc, "status", None), "error": str(exc)}
    finally:
        await unnamed.teardown()
    return out


async def loop(url: str, model: str, stop_id: int, source: str) -> dict[str, Any]:
    import ray
    from skyrl.backends.skyrl_train.weight_sync.control_plane import (
        SkyrlWeightSyncClient,
        nccl_init_payloads,
    )

    client = RemoteInferenceClient(
        proxy_url=url, server_urls=[url], data_parallel_size=1, model_name=model
    )
    sync = SkyrlWeightSyncClient([url], 1, init_payload_fn=nccl_init_payloads)
    packing = {"packed": True, "packed_buffer_size_bytes": 1 << 30, "packed_num_buffers": 2}
    try:
        total, _ = await client.get_world_size()
        # SkyRL's init info (weight_senders._build_sender_init_info) as the engine's
        # trainer_init sends it: the workers from rank_offset 1, beside the rendezvous
        address, port = ray._private.services.get_node_ip_address(), free_port()
        worker = {
            "master_address": address,
            "master_port": port,
            "rank_offset": 1,
            "world_size": total + 1,
        }
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(sync.init_weight_transfer_engine, worker)
            group = gloo_group(address, port, total + 1)
            joined.result()

        async def generate(prompts: list[list[int]], params: dict[str, Any]) -> dict[str, Any]:
            return dict(
                await client.generate({"prompt_token_ids": prompts, "sampling_params": params})
            )

        def send_weights(tensors: list[tuple[str, Any]]) -> None:
            info = {
                "names": [n for n, _ in tensors],
                "dtype_names": [str(t.dtype).split(".")[-1] for _, t in tensors],
                "shapes": [list(t.shape) for _, t in tensors],
                **packing,
            }
            sync.start_weight_update()
            with ThreadPoolExecutor(1) as pool:
                updated = pool.submit(sync.update_weights, info)
                send(group, tensors, True, packing["packed_buffer_size_bytes"])
                updated.result()
            sync.finish_weight_update()

        async def push(tensors: list[tuple[str, Any]]) -> None:
            await asyncio.to_thread(send_weights, tensors)

        return await three_steps(source, stop_id, generate, push)
    finally:
        sync.close()
        await client.teardown()


if __name__ == "__main__":
    if sys.argv[4:5] == ["loop"]:
        result = asyncio.run(loop(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[5]))
    else:
        result = asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
    print(json.dumps(result))
