"""renderers 0.1.12's `generate` (what verifiers 0.4.0's TrainClient and prime-rl's rollouts
call; the PyPI release, unmodified) against a real rlserve started with a served model name, as
a trainer configured with its own name for the model: renderers' own chat-template renderer
over the policy's tokenizer, its stop ids, its strict parsing of vLLM's log-prob entries, the
log-probs it returns against /v1/logprobs; then verifiers 0.4.0's TrainClient itself through
a three-step loop. Runs in .venv-trainers (scripts/test-trainers.sh)."""

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


def test_a_three_step_loop_with_verifiers_train_client_and_prime_rls_weight_updates(
    server, tmp_path
):
    """prime-rl's loop on rlserve: each step samples a group with verifiers 0.4.0's
    TrainClient (the real client: it renders with renderers and calls renderers' `generate`),
    takes a policy-gradient step on the trainer, saves the weights and loads them with
    prime-rl's admin requests (filesystem mode: pause keep, `/update_weights {"weight_dir"}`,
    resume; replayed as in tests/dialects/test_prime_rl_admin.py). Each step's log-probs are
    the trainer's own forward of the weights it loaded last."""
    import torch
    from transformers import AutoModelForCausalLM
    from verifiers.v1.clients.train import TrainClient
    from verifiers.v1.configs.client import TrainClientConfig
    from verifiers.v1.dialects.chat import ChatDialect
    from verifiers.v1.types import SamplingConfig

    chat = [{"role": "user", "content": "Count: 1 2 3"}]
    source = httpx.get(f"{server.url}/v1/models").json()["data"][0]["source"]
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    async def group(step: int) -> list[dict[str, object]]:
        """Four rollouts, each through verifiers' TrainClient as its interception server
        samples a training turn (the chat rendered by renderers, sampled on
        /inference/v1/generate, its tokens and log-probs read back)."""
        client = TrainClient(
            TrainClientConfig(
                base_url=f"{server.url}/v1",
                api_key_var="RLSERVE_TRAIN_CLIENT_KEY",
                renderer_model_name=source,
            )
        )
        try:
            out = []
            for k in range(4):
                sampling = SamplingConfig(max_tokens=6, temperature=1.0, seed=10 * step + k)
                response = await client.get_response(
                    ChatDialect(), {"model": NAME, "messages": chat}, sampling
                )
                tokens = response.tokens
                out.append(
                    {
                        "prompt_ids": tokens.prompt_ids,
                        "completion_ids": tokens.completion_ids,
                        "completion_logprobs": tokens.completion_logprobs,
                    }
                )
            return out
        finally:
            await client.close()

    def own_log_probs(prompt: list[int], completion: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt + completion])
        logits = model(ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
        return logits.gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)

    def admin(path: str, **kwargs: object) -> None:
        response = httpx.post(f"{server.url}{path}", timeout=120, **kwargs)  # type: ignore[arg-type]
        assert response.status_code == 200, response.text

    for step in range(1, 4):
        outs = asyncio.run(group(step))
        rewards = [sum(t % 2 == 0 for t in o["completion_ids"]) / 6 for o in outs]  # type: ignore[union-attr]
        mean = sum(rewards) / len(rewards)
        optimizer.zero_grad()
        loss = torch.zeros(())
        for out, reward in zip(outs, rewards, strict=True):
            mine = own_log_probs(out["prompt_ids"], out["completion_ids"])  # type: ignore[arg-type]
            # sampled by the weights loaded last: the ratio starts at 1
            assert_close(out["completion_logprobs"], mine.tolist(), 1e-4)  # type: ignore[arg-type]
            loss = loss - (reward - mean) * mine.sum()
        loss.backward()
        optimizer.step()
        step_dir = tmp_path / f"step_{step}"
        model.save_pretrained(step_dir)
        admin("/pause", params={"mode": "keep", "clear_cache": "false"})
        admin("/update_weights", json={"weight_dir": str(step_dir)})
        admin("/resume")
    out = asyncio.run(group(4))[0]
    with torch.no_grad():
        mine = own_log_probs(out["prompt_ids"], out["completion_ids"])  # type: ignore[arg-type]
    assert_close(out["completion_logprobs"], mine.tolist(), 1e-4)  # type: ignore[arg-type]
