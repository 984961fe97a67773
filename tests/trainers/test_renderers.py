"""renderers 0.1.12's `generate` (what verifiers 0.4.0's TrainClient and prime-rl's rollouts
call; the PyPI release, unmodified) against a real rlserve started with a served model name, as
a trainer configured with its own name for the model: renderers' own chat-template renderer
over the policy's tokenizer, its stop ids, its strict parsing of vLLM's log-prob entries, the
log-probs it returns against /v1/logprobs. Runs in .venv-trainers (scripts/test-trainers.sh)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.conftest import assert_close
from tests.e2e.server import running_server

pytestmark = pytest.mark.trainers
client_module = pytest.importorskip("renderers.client", reason="renderers is not installed")

from openai import AsyncOpenAI  # noqa: E402
from renderers.default import DefaultRenderer  # noqa: E402

NAME = "org/policy-instruct"  # the name the trainer was configured with


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("renderers")
    env = {
        "RLSERVE_STORAGE__DATA_DIR": str(tmp),
        "RLSERVE_MODELS__LOAD_REFERENCE": "false",
    }
    with running_server("--served-model-name", NAME, env=env, log=tmp / "server.log") as running:
        yield running


def renderer(url: str) -> DefaultRenderer:
    from transformers import AutoTokenizer

    source = httpx.get(f"{url}/v1/models").json()["data"][0]["source"]
    return DefaultRenderer(AutoTokenizer.from_pretrained(source))


def test_renderers_generate_parses_rlserves_answer(server):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 3 ="}]
    own = renderer(server.url)
    stops = own.get_stop_token_ids()

    async def run(params: dict[str, object]) -> dict[str, object]:
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="EMPTY")
        try:
            return await client_module.generate(
                client=client, renderer=own, model=NAME, messages=chat, sampling_params=params
            )
        finally:
            await client.close()

    for params in (
        {"max_tokens": 8, "temperature": 1.0, "seed": 3},
        {"max_tokens": 8, "temperature": 0.0, "min_tokens": 2, "reasoning_effort": "low"},
    ):
        out = asyncio.run(run(params))
        prompt, completion = out["prompt_ids"], out["completion_ids"]
        assert isinstance(prompt, list) and isinstance(completion, list)
        # renderers' own render of the chat is the prompt rlserve builds for it
        tokenized = httpx.post(f"{server.url}/tokenize", json={"messages": chat}).json()
        assert prompt == tokenized["tokens"]
        assert 1 <= len(completion) <= 8 and out["finish_reason"] in ("stop", "length")
        if out["finish_reason"] == "stop":
            assert completion[-1] in stops
        scored = httpx.post(
            f"{server.url}/v1/logprobs", json={"tokens": [prompt + completion]}
        ).json()
        full = scored["outputs"][0]["log_probs"]["full"]
        assert_close(out["completion_logprobs"], full[len(prompt) :], 1e-4)
