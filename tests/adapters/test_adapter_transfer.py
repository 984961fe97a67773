"""A LoRA adapter pushed over the collective transfer (gloo on this CPU): the policy's group
carries the adapter's tensors, and finish serves them as the adapter's next version, which
scores as PEFT's own forward of the same adapter (an independent implementation), while the
policy's weights and version stay as they were. Every refusal names its field and changes
nothing. (vLLM's side: tests/adapters/test_engines.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from peft import PeftModel, get_peft_model_state_dict
from rlserve_client import (
    Client,
    ConflictError,
    NotFoundError,
    RequestTooLargeError,
    UnprocessableEntityError,
)

from app.config import Settings
from tests.adapters.models import assert_peft, log_probs, peft_model
from tests.conftest import served_app
from tests.weights.conftest import loop_client

ATTENTION = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
async def client(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    config = settings.replace(
        storage={"data_dir": settings.storage.data_dir / "adapter-transfer"},
        models={"max_adapter_rank": 8, "max_adapter_bytes": 64 << 10},
    )
    async with served_app(config, timeout=120) as c:
        yield c


def trainer(client: httpx.AsyncClient) -> Client:
    """The synchronous client a trainer thread uses (the app answers on the test's loop)."""
    return loop_client(client.app, asyncio.get_running_loop())  # type: ignore[attr-defined]


async def test_an_adapter_pushed_over_the_transfer_is_served_as_peft_computes_it(client, model_dir):
    first, second = peft_model(model_dir, 1, **ATTENTION), peft_model(model_dir, 2, **ATTENTION)
    policy_before = await log_probs(client, "policy")
    versions_before = (await client.get("/v1/weights/version")).json()
    api = trainer(client)

    def push_twice() -> tuple[Any, Any]:
        with api.weight_transfer() as sync:
            # a first push serves a new adapter: the PEFT model brings its config
            return sync.send_adapter(first, "over-gloo"), sync.send_adapter(
                dict(get_peft_model_state_dict(second)), "over-gloo"
            )

    pushed, again = await asyncio.to_thread(push_twice)
    tensors = get_peft_model_state_dict(first)
    assert (pushed.adapter, pushed.adapter_version) == ("over-gloo", 0)
    assert pushed.num_tensors == len(tensors)
    assert pushed.num_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert (again.adapter, again.adapter_version) == ("over-gloo", 1)
    # the policy is as it was: its version and its weights
    assert pushed.policy_version == again.policy_version == versions_before["policy_version"]
    assert (await client.get("/v1/weights/version")).json() == versions_before
    assert await log_probs(client, "policy") == policy_before
    assert_peft(await log_probs(client, "over-gloo"), second)
    listed = (await client.get("/v1/adapters")).json()["adapters"]
    assert [(a["name"], a["version"]) for a in listed if a["name"] == "over-gloo"] == [
        ("over-gloo", 1)
    ]
    # the adapter pushed by upload is served the same
    upload = await client.put("/v1/adapters/by-upload", content=_file(second))
    assert upload.status_code == 200, upload.text
    assert await log_probs(client, "by-upload") == await log_probs(client, "over-gloo")


def _file(model: PeftModel) -> bytes:
    from rlserve_client.lora import adapter_file

    return adapter_file(model)


async def test_refused_adapter_pushes_name_their_field_and_change_nothing(client, model_dir):
    served = peft_model(model_dir, 3, **ATTENTION)
    wider = peft_model(model_dir, 4, **{**ATTENTION, "r": 8})
    too_wide = peft_model(model_dir, 5, **{**ATTENTION, "r": 16})  # models.max_adapter_rank
    heavy = peft_model(
        model_dir,
        6,
        r=8,
        lora_alpha=8,
        target_modules=[
            "q_proj",
            "v_proj",
            "k_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    )  # models.max_adapter_bytes
    api = trainer(client)

    def pushes() -> list[tuple[type[Exception], str | None]]:
        refused: list[tuple[type[Exception], str | None]] = []
        with api.weight_transfer() as sync:
            sync.send_adapter(served, "kept")
            for adapter, name, start in (
                # a name not served, without a config
                (dict(get_peft_model_state_dict(served)), "unknown", None),
                # the policy's name is no adapter's
                (served, "policy", None),
                # other shapes than the served adapter's
                (wider, "kept", None),
                # a rank over the bound, bytes over the bound (announced: refused at once)
                (too_wide, "wide", None),
                (heavy, "heavy", None),
            ):
                try:
                    sync.send_adapter(adapter, name, config=start)
                except (
                    NotFoundError,
                    ConflictError,
                    UnprocessableEntityError,
                    RequestTooLargeError,
                ) as exc:
                    refused.append((type(exc), exc.param))
                    if isinstance(exc, RequestTooLargeError):
                        assert "models.max_adapter_" in str(exc), exc
            # a version is the server's to count for an adapter
            sync._step("start", {"adapter": {"name": "kept"}})
            try:
                api.transfer_finish(version=99)
            except UnprocessableEntityError as exc:
                refused.append((type(exc), exc.param))
            try:  # an adapter is the policy's
                api.transfer_step(
                    step="start", body={"model": "reference", "adapter": {"name": "x"}}
                )
            except UnprocessableEntityError as exc:
                refused.append((type(exc), exc.param))
            # the group is still joined, and takes a good push after all of that
            last = sync.send_adapter(served, "kept")
        assert last.adapter_version == 1
        return refused

    before = await log_probs(client, "policy")
    refused = await asyncio.to_thread(pushes)
    assert refused == [
        (NotFoundError, "adapter.config"),
        (ConflictError, "adapter.name"),
        (UnprocessableEntityError, "names"),
        (RequestTooLargeError, "names"),
        (RequestTooLargeError, "names"),
        (UnprocessableEntityError, "version"),
        (UnprocessableEntityError, "adapter"),
    ]
    assert await log_probs(client, "policy") == before
    assert_peft(await log_probs(client, "kept"), served)
    adapters = {a["name"]: a for a in (await client.get("/v1/adapters")).json()["adapters"]}
    assert "unknown" not in adapters and adapters["kept"]["version"] == 1
    assert "wide" not in adapters and "heavy" not in adapters
