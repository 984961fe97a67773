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
from rlserve_client.tensordicts import samples_from_tensordict
from safetensors.torch import save
from tensordict import NonTensorStack, TensorDict

from tests.conftest import assert_close
from tests.e2e.server import Server, free_port, running_process, running_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, settings) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("client-e2e")
    env = {"RLSERVE_CACHE_DIR": str(settings.cache_dir), "RLSERVE_DATA_DIR": str(tmp)}
    with running_server(env=env, log=tmp / "server.log") as running:
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


def test_tensordict_round_trip_and_remote_policy(client, reference_log_probs):
    prompts = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "what is 2+2"}]]
    td = TensorDict({"history": {"prompt": NonTensorStack.from_list(prompts)}}, batch_size=[2])
    policy = RemotePolicy(client, generate_kwargs={"max_tokens": 5, "seed": 1})
    out = policy(td)
    assert out["tokens", "full"].shape[0] == 2
    for row, sample in enumerate(samples_from_tensordict(out)):
        assert sample.history is not None and sample.history.prompt is not None
        assert [m.model_dump() for m in sample.history.prompt] == prompts[row]
        full = sample.tokens.full or []
        prompt_len = len(sample.tokens.prompt or [])
        expected = reference_log_probs(full)[prompt_len:]
        assert_close(sample.log_probs.response or [], expected, 1e-4)  # type: ignore[union-attr]
    # log-prob mode on the padded output keeps its layout
    scorer = RemotePolicy(client, input_mode="tokens", generate=False)
    scored = scorer(out.select(("tokens", "full"), ("masks", "all_attention_mask")))
    mask = out["masks", "all_attention_mask"]
    for row in range(2):
        ids = out["tokens", "full"][row][mask[row]].tolist()
        assert_close(
            scored["log_probs", "full"][row][mask[row]].tolist(), reference_log_probs(ids), 1e-4
        )
        assert torch.all(scored["log_probs", "full"][row][~mask[row]] == 0)


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
