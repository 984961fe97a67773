"""The Python client against real uvicorn processes: every method, retries over a socket,
typed errors, TensorDict round trips, the remote TorchRL pieces and `collect`."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from rlserve_client import (
    AsyncClient,
    Client,
    ConflictError,
    NotFoundError,
    RemoteChatEnv,
    RemotePolicy,
    ServiceUnavailableError,
    UnprocessableEntityError,
    collect,
)
from safetensors.torch import save
from tensordict import NonTensorStack, TensorDict

from tests.conftest import assert_close
from tests.e2e.server import Server, free_port, running_process, serving_here

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, settings) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    with serving_here(tmp_path_factory.mktemp("client-e2e"), settings) as running:
        yield running


@pytest.fixture
def client(server: Server) -> Iterator[Client]:
    with Client(base_url=server.url) as c:
        yield c


def test_every_sync_method_over_a_socket(client, reference_log_probs, hf_model):
    assert client.health().status == "ok" and client.ready().ready is True
    assert [m.name for m in client.models().models] == ["policy", "reference"]
    assert client.batching().enabled is True
    generated = client.generate(text=["Hi"], max_tokens=4, temperature=0, ignore_eos=True)
    full = generated.samples[0].tokens.full or []
    scored = client.logprobs(tokens=[full])
    assert_close(scored.outputs[0].log_probs.full or [], reference_log_probs(full), 1e-5)  # type: ignore[union-attr]
    assert client.kl(tokens=[full], assistant_only=False).outputs[0].kl_sum == 0.0
    env = client.create_env(max_turns=1).env_id
    assert client.reset_env(env, query=["q"]).observations[0].history is not None
    assert client.step_env(env, actions=[{"text": "a"}]).outputs[0].done is True
    assert client.get_env(env).rows[0].turns == 1
    assert env in {e.env_id for e in client.list_envs(limit=500).envs}
    client.delete_env(env)
    rollout = client.rollouts(
        env={"dataset": "arithmetic", "max_turns": 1, "batch_size": 2}, num_episodes=2
    )
    assert len(rollout.trajectories) == 2
    version = client.weights_version().policy_version
    bias = {"lm_head.weight": hf_model.lm_head.weight.detach().clone()}
    updated = client.upload_weights(payload=save(bias), progress=True)
    assert (updated.policy_version, updated.num_tensors) == (version + 1, 1)
    reloaded = client.load_weights(path=str(Path(hf_model.name_or_path) / "model.safetensors"))
    assert reloaded.policy_version == version + 2


def test_errors_are_typed_and_carry_the_body(client):
    with pytest.raises(UnprocessableEntityError) as error:
        client.generate(text=["a"], top_p=2)
    assert (error.value.status_code, error.value.param) == (422, "top_p")
    assert error.value.body["error"]["code"] == 422
    with pytest.raises(NotFoundError):
        client.step_env("env-nope", actions=[None])
    with RemoteChatEnv(client, max_turns=1) as env:
        env.reset(query=["q"])
        env.step([{"text": "a"}])
        with pytest.raises(ConflictError):
            env.step([{"text": "b"}])
    with pytest.raises(NotFoundError):  # the context manager deleted the session
        client.get_env(env.env_id)


def test_retries_reach_a_server_that_fails_twice(tmp_path):
    port = free_port()
    command = [sys.executable, "-m", "uvicorn", "tests.e2e.flaky_server:app", "--port", str(port)]
    with running_process(command, port, "/count", log=tmp_path / "flaky.log") as flaky:
        with Client(base_url=flaky.url, max_retries=2) as client:
            assert client.health().status == "ok"
        with (
            Client(base_url=flaky.url, max_retries=1) as client,
            pytest.raises(ServiceUnavailableError),
        ):
            client.ready()


def test_remote_policy_without_torchrl(client, reference_log_probs, hf_tokenizer):
    """Plain TensorDicts in TorchRL's key layout where torchrl is not installed."""
    prompts = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "what is 2+2"}]]
    td = TensorDict({"history": {"prompt": NonTensorStack.from_list(prompts)}}, batch_size=[2])
    policy = RemotePolicy(client, pad_output=True, generate_kwargs={"max_tokens": 5, "seed": 1})
    out = policy(td)
    pad = hf_tokenizer.pad_token_id
    mask = out["masks", "all_attention_mask"]
    for row in range(2):
        assert out[row]["history", "prompt"] == prompts[row]
        prompt = [t for t in out["tokens", "prompt"][row].tolist() if t != pad]
        full = out["tokens", "full"][row][mask[row]].tolist()
        response = full[len(prompt) :]
        assert out["tokens", "response"][row].tolist()[: len(response)] == response
        expected = reference_log_probs(full)[len(prompt) :]
        got = out["log_probs", "response"][row].tolist()[: len(response)]
        assert_close(got, expected, 1e-4)
    # scoring the padded output: TorchRL's layout, sequences padded on the left
    scorer = policy.get_new_version(input_mode="tokens", generate=False)
    scored = scorer(out.select(("tokens", "full"), ("masks", "all_attention_mask")))
    scored_mask = scored["masks", "all_attention_mask"]
    for row in range(2):
        ids = out["tokens", "full"][row][mask[row]].tolist()
        assert scored["tokens", "full"][row][scored_mask[row]].tolist() == ids
        values = scored["log_probs", "full"][row]
        assert_close(values[scored_mask[row]].tolist(), reference_log_probs(ids), 1e-4)
        assert torch.all(values[~scored_mask[row]] == 0)
        assert not scored_mask[row][-1:].logical_not().any()  # left padding


def test_collect_log_probs_equal_the_logprobs_route(server: Server):
    async def run() -> None:
        async with AsyncClient(base_url=server.url) as api:
            env = {"dataset": "arithmetic", "reward": "gsm8k", "batch_size": 4, "max_turns": 2}
            async for batch in collect(api, env=env, total_dialog_turns=8, progress=False):
                for step in (s for t in batch.trajectories for s in t.steps):
                    scored = await api.logprobs(tokens=[step.tokens.full])
                    expected = scored.outputs[0].log_probs.full or []  # type: ignore[union-attr]
                    num_prompt = len(step.tokens.prompt or [])
                    assert_close(step.log_probs.response or [], expected[num_prompt:], 1e-4)  # type: ignore[union-attr]

    asyncio.run(run())
