"""Binary bodies (safetensors): every reply that asks for it carries the same values as the
JSON reply, requests may send their arrays as tensors, and a broken body is a 400."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest
import torch
from rlserve_client.tensor_wire import MEDIA_TYPE
from rlserve_client.tensor_wire import decode as client_decode
from rlserve_client.tensor_wire import encode as client_encode
from safetensors.torch import load, save

PROMPTS = [[5, 77, 12, 200, 3], [9, 41]]
RESPONSES = [[9, 41, 8, 130, 66], [2, 17, 250]]
BINARY = {"Accept": MEDIA_TYPE}


def read_binary(data: bytes) -> Any:
    """An independent reader of the format: the metadata skeleton with each placeholder
    replaced by its rows as lists (NaN and -1 left as they are)."""
    tensors = load(data)
    size = int.from_bytes(data[:8], "little")
    skeleton = json.loads(json.loads(data[8 : 8 + size])["__metadata__"]["rlserve"])

    def resolve(node: Any) -> Any:
        if isinstance(node, dict) and "$tensor" in node:
            offsets = tensors[node["$tensor"] + ".offsets"]
            row = tensors[node["$tensor"]][offsets[node["row"]] : offsets[node["row"] + 1]]
            return row[node.get("start") : node.get("stop")].tolist()
        if isinstance(node, dict):
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(skeleton)


def same(json_value: Any, binary_value: Any, path: str = "") -> None:
    """JSON and binary agree: equal numbers (float32 exactly), null as NaN / -1 / -inf."""
    if isinstance(json_value, dict):
        assert set(json_value) == set(binary_value), path
        for key in json_value:
            same(json_value[key], binary_value[key], f"{path}.{key}")
    elif isinstance(json_value, list):
        assert isinstance(binary_value, list) and len(json_value) == len(binary_value), path
        if (
            json_value
            and json_value[0] is None
            and binary_value
            and isinstance(binary_value[0], list)
        ):
            binary_value = [None if all(_null(v) for v in row) else row for row in binary_value]
        for a, b in zip(json_value, binary_value, strict=True):
            same(a, b, path)
    elif json_value is None:
        assert binary_value is None or _null(binary_value), (path, binary_value)
    elif isinstance(json_value, float):
        assert binary_value == json_value, (path, json_value, binary_value)
    else:
        assert binary_value == json_value, (path, json_value, binary_value)


def _null(value: Any) -> bool:
    return value == -1 or (isinstance(value, float) and (math.isnan(value) or value == -math.inf))


async def both(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> tuple[Any, bytes]:
    plain = await client.post(path, json=body)
    assert plain.status_code == 200, plain.text
    packed = await client.post(path, json=body, headers=BINARY)
    assert packed.status_code == 200, packed.text
    assert packed.headers["content-type"] == MEDIA_TYPE
    return plain.json(), packed.content


async def test_scoring_reply_in_binary_equals_json(client):
    body = {
        "prompt_tokens": PROMPTS,
        "response_tokens": RESPONSES,
        "top_logprobs": 4,
        "entropy": True,
        "temperature": 0.7,
        "top_k": 5,
        "top_p": 0.8,
        "token_ids": [0, 41, 258],
        "reference_log_probs": [[-5.0] * 5, [-4.0] * 3],
    }
    plain, packed = await both(client, "/v1/logprobs", body)
    decoded = read_binary(packed)
    same(plain, decoded)
    # A token top-k/top-p removed is null in JSON and -inf in binary; the first position of a
    # full-span sequence has no prediction: NaN.
    processed = decoded["outputs"][0]["processed"]["log_probs"]
    removed = [i for i, v in enumerate(plain["outputs"][0]["processed"]["log_probs"]) if v is None]
    assert removed and all(processed[i] == -math.inf for i in removed)
    # prompt and response are slices of full, not sent twice
    header = json.loads(packed[8 : 8 + int.from_bytes(packed[:8], "little")])
    assert not any(name.startswith("outputs.tokens.prompt") for name in header)
    assert header["outputs.tokens.full"]["dtype"] == "U8"  # ids below 256 take one byte


async def test_full_span_extras_start_with_a_missing_row(client):
    plain, packed = await both(
        client, "/v1/logprobs", {"tokens": [PROMPTS[0]], "top_logprobs": 3, "entropy": True}
    )
    decoded = read_binary(packed)
    same(plain, decoded)
    assert decoded["outputs"][0]["top_logprobs"]["ids"][0] == [-1, -1, -1]
    assert math.isnan(decoded["outputs"][0]["entropy"][0])


async def test_generate_and_kl_replies_in_binary_equal_json(client, backend_name):
    generate = {"tokens": PROMPTS, "max_new_tokens": 6, "n": 2, "seed": 3, "temperature": 1.0}
    if backend_name == "transformers":  # (the second request's values bitwise the first's,
        generate["batch_invariant"] = True  # not taken from the prefix cache)
    plain, packed = await both(client, "/v1/generate", generate)
    same(plain, read_binary(packed))
    plain, packed = await both(
        client, "/v1/kl", {"prompt_tokens": PROMPTS, "response_tokens": RESPONSES}
    )
    same(plain, read_binary(packed))


async def test_requests_may_send_their_arrays_as_tensors(client):
    body = {"tokens": [PROMPTS[0] + RESPONSES[0], PROMPTS[1] + RESPONSES[1]], "top_logprobs": 2}
    expected = (await client.post("/v1/logprobs", json=body)).json()
    as_tensors = {
        **body,
        "tokens": [torch.tensor(seq) for seq in body["tokens"]],  # type: ignore[union-attr]
    }
    sent = await client.post(
        "/v1/logprobs", content=client_encode(as_tensors), headers={"Content-Type": MEDIA_TYPE}
    )
    assert sent.status_code == 200, sent.text
    assert sent.json() == expected
    # one 2-D tensor of equal-length sequences is one row
    square = {"tokens": torch.tensor([PROMPTS[0], PROMPTS[0]])}
    sent = await client.post(
        "/v1/logprobs", content=client_encode(square), headers={"Content-Type": MEDIA_TYPE}
    )
    assert sent.status_code == 200, sent.text
    assert [o["tokens"]["full"] for o in sent.json()["outputs"]] == [PROMPTS[0], PROMPTS[0]]


async def test_client_decoding_gives_tensor_views_with_torch_dtypes(client):
    body = {"prompt_tokens": PROMPTS, "response_tokens": RESPONSES, "top_logprobs": 3}
    plain, packed = await both(client, "/v1/logprobs", body)
    decoded = client_decode(packed)
    first = decoded["outputs"][0]
    assert first["tokens"]["full"].dtype == torch.int64
    assert first["masks"]["all_assistant_mask"].dtype == torch.bool
    assert first["top_logprobs"]["log_probs"].shape == (len(RESPONSES[0]), 3)
    assert first["tokens"]["response"].tolist() == plain["outputs"][0]["tokens"]["response"]
    assert first["log_probs"]["full"].tolist() == plain["outputs"][0]["log_probs"]["full"]


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (b"not safetensors", "body"),
        (save({"x": torch.zeros(2)}), "body"),  # no skeleton
        (
            save(
                {"t": torch.tensor([1, 2]), "t.offsets": torch.tensor([0, 2])},
                metadata={"rlserve": json.dumps({"tokens": [{"$tensor": "t", "row": 5}]})},
            ),
            "body",
        ),
        (
            save(
                {"t": torch.tensor([1, 2]), "t.offsets": torch.tensor([0, 9])},
                metadata={"rlserve": json.dumps({"tokens": [{"$tensor": "t", "row": 0}]})},
            ),
            "body",
        ),
        (
            save(
                {"r": torch.tensor([math.nan, 1.0]), "r.offsets": torch.tensor([0, 2])},
                metadata={
                    "rlserve": json.dumps(
                        {"tokens": [[1, 2]], "reference_log_probs": [{"$tensor": "r", "row": 0}]}
                    )
                },
            ),
            "reference_log_probs",
        ),
    ],
)
async def test_broken_binary_bodies_are_named_4xx(client, content, param):
    response = await client.post(
        "/v1/logprobs", content=content, headers={"Content-Type": MEDIA_TYPE}
    )
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert error["param"].startswith(param), error


def test_encoding_takes_torch_and_numpy_arrays_of_every_dtype():
    """Arrays of any dtype encode to the values they hold, as the independent reader sees
    them: half and bfloat16 as float32, float64 narrowed to float32, bools as bools,
    integers narrowed to the smallest type that holds them."""
    import numpy as np

    body = {
        "bf16": torch.tensor([0.5, -1.25, 3.0], dtype=torch.bfloat16),
        "f16": torch.tensor([[0.5, 2.0]], dtype=torch.float16),
        "f64": np.array([1.0 / 3.0, 2.5]),
        "mask": torch.tensor([True, False, True]),
        "ids": np.array([[1, 70_000], [2, 3]], dtype=np.int64),
        "small": [4, 5, 6],
    }
    data = client_encode(body)
    tensors = load(data)
    assert tensors["bf16"].dtype == torch.float32 and tensors["f16"].dtype == torch.float32
    assert tensors["mask"].dtype == torch.bool and tensors["ids"].dtype == torch.int32
    assert tensors["small"].dtype == torch.uint8
    decoded = read_binary(data)
    assert decoded["bf16"] == [0.5, -1.25, 3.0]
    assert decoded["f16"] == [[0.5, 2.0]]
    assert decoded["f64"] == [float(np.float32(1.0 / 3.0)), 2.5]
    assert decoded["mask"] == [True, False, True]
    assert decoded["ids"] == [[1, 70_000], [2, 3]]
    assert decoded["small"] == [4, 5, 6]
