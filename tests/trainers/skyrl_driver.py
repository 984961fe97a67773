"""Drives SkyRL 0.4.0's own `RemoteInferenceClient` (unmodified) against the server at
argv[1], the way SkyRL's generator and its Tinker-style sampler call it, and prints what the
client returned as JSON for tests/trainers/test_skyrl.py to check. Runs in .venv-skyrl: SkyRL
needs Python 3.12 (and torch, which its client module imports)."""

from __future__ import annotations

import asyncio
import json
import sys
import urllib.request

from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import (
    RemoteInferenceClient,
)


def paused(url: str) -> bool:
    with urllib.request.urlopen(f"{url}/is_paused") as answer:
        return bool(json.load(answer)["is_paused"])


async def main(url: str, model: str, stop_id: int) -> dict[str, object]:
    client = RemoteInferenceClient(
        proxy_url=url, server_urls=[url], data_parallel_size=1, model_name=model
    )
    out: dict[str, object] = {}
    try:
        # What SkyRL's generator sends (skyrl/train/generators/utils: get_sampling_params).
        params = {
            "max_tokens": 8,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "min_p": 0.0,
            "min_tokens": 1,
            "skip_special_tokens": True,
            "include_stop_str_in_output": True,
            "logprobs": 0,
            "stop_token_ids": [stop_id],
        }
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
    return out


if __name__ == "__main__":
    result = asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
    print(json.dumps(result))
