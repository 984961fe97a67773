"""One generation vocabulary from the client to the engine (`rlserve_client.sampling`): the
server's `POST /v1/generate` takes exactly the parameters the client knows, every sampling
parameter sent by the client's `generate` reaches the engine's `SamplingConfig` (its alias
too), and the client refuses, naming it, a parameter the server would not take."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from rlserve_client import AsyncClient
from rlserve_client.sampling import (
    ALIASES,
    GENERATION_PARAMETERS,
    SAMPLING_PARAMETERS,
    check_generation_parameters,
)

from app.engine.base import Capabilities
from app.engine.types import GenerateItem, Generation
from app.generation.protocol import GenerateRequest
from tests.fake.backend import FakeBackend, fake_app


class Recording(FakeBackend):
    """The fake model, keeping every row it was asked to generate (it says it records MoE
    routing, so that the ask for it is taken)."""

    capabilities = Capabilities(routed_experts=True)
    routing = object()  # (routers of no layer: the fake samples without any)

    def __init__(self, name: str) -> None:
        super().__init__(name, lambda t: -1.0)
        self.items: list[GenerateItem] = []

    async def generate(self, items: Sequence[GenerateItem]) -> list[Generation]:
        self.items.extend(items)
        return await super().generate(items)


@pytest.fixture
async def recorded(tmp_path: Path) -> AsyncIterator[tuple[AsyncClient, Recording]]:
    policy = Recording("policy")
    async with fake_app(tmp_path, policy, FakeBackend("reference", lambda t: -1.0)) as app:
        transport = httpx.ASGITransport(app=app)
        async with AsyncClient(base_url="http://rlserve", transport=transport) as client:
            yield client, policy


# Each sampling parameter (and alias): a value other than its default, and what the engine's
# config must then hold (attribute, value).
WALK: dict[str, tuple[Any, str, Any]] = {
    "max_new_tokens": (7, "max_new_tokens", 7),
    "max_tokens": (5, "max_new_tokens", 5),
    "temperature": (0.7, "temperature", 0.7),
    "do_sample": (False, "do_sample", False),
    "top_p": (0.9, "top_p", 0.9),
    "top_k": (5, "top_k", 5),
    "min_p": (0.05, "min_p", 0.05),
    "repetition_penalty": (1.3, "repetition_penalty", 1.3),
    "stop": (["zz"], "stop_sequences", ("zz",)),
    "stop_sequences": (["yy"], "stop_sequences", ("yy",)),
    "ignore_eos": (True, "ignore_eos", True),
    "min_tokens": (2, "min_tokens", 2),
    "stop_token_ids": ([9], "stop_token_ids", (9,)),
    "presence_penalty": (0.5, "presence_penalty", 0.5),
    "frequency_penalty": (0.25, "frequency_penalty", 0.25),
    "logit_bias": ({"11": 2.0}, "logit_bias", ((11, 2.0),)),
    "allowed_token_ids": ([72, 105, 33], "allowed_token_ids", (72, 105, 33)),
    "bad_words": (["qq"], "bad_words", ("qq",)),
    "return_prompt_log_probs": (True, "return_prompt_log_probs", True),
    "return_routed_experts": (True, "return_routed_experts", True),
}


def test_the_server_takes_exactly_the_clients_vocabulary() -> None:
    inputs = {"messages", "text", "tokens", "chat_template_kwargs", "model"}
    assert set(GenerateRequest.model_fields) - inputs == GENERATION_PARAMETERS
    # every sampling parameter and its aliases are walked below
    sampling_aliases = {a for a, name in ALIASES.items() if name in SAMPLING_PARAMETERS}
    assert set(WALK) == {*SAMPLING_PARAMETERS, *sampling_aliases}


@pytest.mark.parametrize("name", sorted(WALK))
async def test_every_sampling_parameter_reaches_the_engine(recorded, name: str) -> None:
    client, policy = recorded
    value, attribute, expected = WALK[name]
    before = len(policy.items)
    result = await client.generate(tokens=[[1, 2, 3]], **{name: value})
    assert len(result.outputs) == 1
    (item,) = policy.items[before:]
    assert getattr(item.config, attribute) == expected, (name, item.config)


async def test_the_other_wishes_reach_the_reply(api: AsyncClient, backend_name: str) -> None:
    """The wishes beyond sampling, on the built-in model: how many samples, their streams,
    what is scored along, and batch invariance (the transformers backend's)."""
    prompt = {"tokens": [[1, 2, 3]], "max_new_tokens": 3, "ignore_eos": True}
    three = await api.generate(**prompt, n=3, seed=5)
    assert len(three.outputs[0]) == 3
    same = await api.generate(**prompt, num_return_sequences=3, seed=5)
    assert [s.tokens.response for s in same.outputs[0]] == [
        s.tokens.response for s in three.outputs[0]
    ]
    (scored,) = (await api.generate(**prompt, top_logprobs=2, entropy=True)).outputs[0]
    assert scored.top_logprobs is not None and len(scored.top_logprobs.ids[0] or []) == 2
    assert scored.entropy is not None and len(scored.entropy) == 3
    for off in ({"return_log_probs": False}, {"logprobs": False}):
        (unscored,) = (await api.generate(**prompt, **off)).outputs[0]
        assert unscored.log_probs is None, off
    (kept,) = (await api.generate(**prompt, skip_special_tokens=True)).outputs[0]
    assert kept.text is not None and len(kept.tokens.response or []) == 3
    if backend_name == "transformers":  # (vLLM has no batch-invariant mode)
        twice = [await api.generate(**prompt, batch_invariant=True, seed=1) for _ in range(2)]
        first, second = (result.outputs[0][0] for result in twice)
        assert first.tokens.response == second.tokens.response
        assert first.log_probs is not None and second.log_probs is not None
        assert first.log_probs.response == second.log_probs.response  # bitwise


def test_a_parameter_the_server_does_not_take_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"generate_kwargs: \['beam_width'\]"):
        check_generation_parameters({"temperature": 1.0, "beam_width": 4}, "generate_kwargs")
    from rlserve_client._routes import generate

    with pytest.raises(ValueError, match=r"generate: \['beam_width'\]"):
        generate(tokens=[[1]], beam_width=4)
