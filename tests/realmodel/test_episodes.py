"""Episodes on the real tokenizer: token actions enter the history exactly as sent (even
where re-encoding their text would give other ids), and an OpenAI-SDK agent's turns are
recorded as a token-exact trajectory."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from tests.conftest import assert_close
from tests.e2e.server import Server, running_server
from tests.e2e.test_openai_sdk import agent_turns
from tests.realmodel.conftest import post
from tests.realmodel.test_parity import TOLERANCE

pytestmark = pytest.mark.slow


def ids(tokenizer, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


async def test_token_actions_enter_the_episode_exactly(real_client, real_tokenizer):
    created = await real_client.post("/v1/envs", json={"max_turns": 3})
    assert created.status_code == 201, created.text
    env = created.json()["env_id"]
    reset = await post(real_client, f"/v1/envs/{env}/reset", {"query": ["What is 7 + 5?"]})
    prompt = reset["observations"][0]["prompt_tokens"]
    # "Paris" written as two pieces, then <|im_end|>: the tokenizer encodes the text otherwise.
    action = [*ids(real_tokenizer, "The answer is Par"), *ids(real_tokenizer, "is"), 2]
    assert ids(real_tokenizer, real_tokenizer.decode(action)) != action
    step = await post(real_client, f"/v1/envs/{env}/step", {"actions": [{"tokens": action}]})
    following = step["outputs"][0]["observation"]["prompt_tokens"]
    assert following == prompt + action + ids(real_tokenizer, "\n<|im_start|>assistant\n")
    # A generated reply stepped back as tokens extends the prompt by exactly its tokens.
    body = {"tokens": [following], "max_tokens": 12, "temperature": 0}
    (reply,) = (await post(real_client, "/v1/generate", body))["outputs"][0]
    step = await post(
        real_client,
        f"/v1/envs/{env}/step",
        {"actions": [{"tokens": reply["tokens"]["response"]}]},
    )
    after = step["outputs"][0]["observation"]["prompt_tokens"]
    assert after[: len(following) + len(reply["tokens"]["response"])] == reply["tokens"]["full"]


@pytest.fixture(scope="module")
def real_server(tmp_path_factory: pytest.TempPathFactory, real_settings) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("real-openai")
    env = {
        "RLSERVE_MODELS__MODEL": real_settings.models.model,
        "RLSERVE_MODELS__CACHE_DIR": str(real_settings.models.cache_dir),
        "RLSERVE_STORAGE__DATA_DIR": str(tmp),
        "RLSERVE_MODELS__BACKEND": "transformers",
        "RLSERVE_MODELS__LOAD_REFERENCE": "false",
    }
    with running_server(env=env, log=tmp / "server.log", ready_timeout=300) as running:
        yield running


def test_an_openai_sdk_agent_is_one_token_exact_trajectory(real_server):
    from openai import OpenAI
    from rlserve_client import Client

    with OpenAI(base_url=f"{real_server.url}/v1", api_key="-", max_retries=0) as sdk:
        trajectory = agent_turns(
            sdk, "Give me a number between 1 and 10.", "Another one, please.", max_tokens=16
        )
    with Client(base_url=real_server.url) as client:
        recorded = client.trajectory(trajectory)
        assert recorded.num_turns == 3
        # A turn's prompt extends the sequence before it (one segment) unless the template's
        # re-rendering of a sampled reply tokenizes it otherwise (SmolLM2 at temperature 1
        # samples non-canonical pairs): then a new segment starts, exactly there.
        assert sum(len(s.turns) for s in recorded.segments) == 3
        for before, after in itertools.pairwise(recorded.segments):
            assert before.tokens.full is not None and after.tokens.full is not None
            ended = before.tokens.full
            assert after.tokens.full[: len(ended)] != ended
        for segment in recorded.segments:
            full = segment.tokens.full
            assert full is not None and segment.log_probs is not None
            scored = client.logprobs(tokens=[full]).outputs[0].log_probs
            assert scored is not None and scored.full is not None
            mask = segment.masks.all_assistant_mask
            assert mask is not None
            at = [i for i, m in enumerate(mask) if m]
            assert len(at) == sum(t.end - t.start for t in segment.turns)
            assert_close(
                [segment.log_probs.full[i] for i in at], [scored.full[i] for i in at], TOLERANCE
            )
