"""RemotePolicy beside TorchRL's TransformersWrapper on SmolLM2-135M-Instruct, whose pad token is
its end-of-sequence token (`<|im_end|>`, id 2) and whose template has no generation tags. Where
they differ, plain transformers (`apply_chat_template` + `generate`, a plain forward) decides:
rlserve agrees with it; TorchRL does too once given a distinct pad token, the model's own
template and an explicit attention mask (docs/guides/torchrl.md)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.conftest import assert_close, forward_log_probs
from tests.e2e.server import Server, running_server
from tests.torchrl import torchrl_only

pytestmark = [*torchrl_only, pytest.mark.slow]
SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one short sentence."}
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [SYSTEM, {"role": "user", "content": "What color is the sky?"}],
    [
        SYSTEM,
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "An apple."},
        {"role": "user", "content": "Name another one."},
    ],
]
GREEDY = {"max_new_tokens": 24, "do_sample": False}


@pytest.fixture(scope="module")
def real_dir():  # type: ignore[no-untyped-def]
    from app.config import Settings
    from app.config_groups import DEFAULT_MODEL
    from app.engine.loader import smollm2_dir

    return smollm2_dir(Settings(models={"model": DEFAULT_MODEL}).models)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, real_dir) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("smollm2-parity")
    env = {
        "RLSERVE_MODELS__MODEL": str(real_dir),
        "RLSERVE_STORAGE__DATA_DIR": str(tmp),
        "RLSERVE_MODELS__BACKEND": "transformers",
        "RLSERVE_MODELS__LOAD_REFERENCE": "false",
    }
    with running_server(env=env, log=tmp / "server.log", ready_timeout=600) as s:
        yield s


@pytest.fixture(scope="module")
def model(real_dir):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(real_dir, dtype=torch.float32).eval()


@pytest.fixture()
def tokenizer(real_dir):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_dir)


@pytest.fixture(autouse=True)
def _list_to_stack() -> Iterator[None]:
    from tensordict import set_list_to_stack

    with set_list_to_stack(True):
        yield


def history(chats):  # type: ignore[no-untyped-def]
    from tensordict import TensorDict
    from torchrl.data.llm import History
    from torchrl.modules.llm.policies import ChatHistory

    prompt = ChatHistory(prompt=History.from_chats(chats))
    return TensorDict({"history": prompt}, batch_size=[len(chats)])


def template_ids(tokenizer, chat) -> list[int]:  # type: ignore[no-untyped-def]
    encoded = tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(encoded["input_ids"])


def plain_greedy(model, tokenizer, chat) -> tuple[list[int], list[int]]:  # type: ignore[no-untyped-def]
    prompt = template_ids(tokenizer, chat)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), **GREEDY)
    return prompt, out[0, len(prompt) :].tolist()


def test_history_mode_greedy_replies_are_transformers_and_torchrl_drops_the_eos(
    server, model, tokenizer
):
    from rlserve_client import Client
    from rlserve_client.policy import RemotePolicy
    from torchrl.modules.llm import TransformersWrapper

    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 2
    with Client(base_url=server.url, timeout=600) as client:
        ours = RemotePolicy(client, generate_kwargs=GREEDY)(history(CHATS))
    default = TransformersWrapper(model, tokenizer=tokenizer, generate_kwargs=GREEDY)
    # one chat at a time: a batch of them fails inside TorchRL (its history of the replies,
    # empty here, no longer lines up with the batch)
    theirs = [default(history([chat]))[0] for chat in CHATS]
    for i, chat in enumerate(CHATS):
        prompt, reply = plain_greedy(model, tokenizer, chat)
        assert ours[i]["tokens", "prompt"].tolist() == prompt
        assert ours[i]["tokens", "response"].tolist() == reply
        assert reply[-1] == 2  # the reply ends on <|im_end|>, which the model wrote
        assert ours[i]["history", "response"].content[-1] == tokenizer.decode(reply[:-1])
        # TorchRL takes every 2 for padding: the reply loses its end-of-turn token
        assert theirs[i]["tokens", "response"].tolist() == reply[:-1]

    tokenizer.pad_token = "<|endoftext|>"  # id 0, which this chat model never writes
    fixed = TransformersWrapper(
        model,
        tokenizer=tokenizer,
        generate_kwargs={**GREEDY, "pad_token_id": 0},
        chat_template=tokenizer.chat_template,
    )
    theirs = [fixed(history([chat]))[0] for chat in CHATS]
    for i in range(len(CHATS)):
        for part in ("prompt", "response", "full"):
            assert theirs[i]["tokens", part].tolist() == ours[i]["tokens", part].tolist(), part


def test_token_rows_holding_the_pad_id_are_scored_whole(server, model, tokenizer):
    """Token rows of unequal length (a lazy stack) with <|im_end|> inside: rlserve scores them
    as given; TorchRL, without an attention mask, takes the 2s for padding."""
    from rlserve_client import Client
    from rlserve_client.policy import RemotePolicy
    from tensordict import TensorDict, lazy_stack
    from torchrl.modules.llm import TransformersWrapper

    rows = [template_ids(tokenizer, chat) for chat in CHATS]
    assert all(2 in row for row in rows)

    def inputs(mask: bool) -> TensorDict:
        tds = []
        for row in rows:
            fields: dict = {"tokens": {"full": torch.tensor(row)}}
            if mask:
                fields["masks"] = {"all_attention_mask": torch.ones(len(row), dtype=torch.bool)}
            tds.append(TensorDict(fields, batch_size=[]))
        return lazy_stack(tds)

    with Client(base_url=server.url, timeout=600) as client:
        scorer = RemotePolicy(client, generate=False, input_mode="tokens")
        ours = scorer(inputs(mask=False))
    torchrl = TransformersWrapper(
        model, tokenizer=tokenizer, input_mode="tokens", generate=False, pad_output=False
    )
    unmasked = torchrl(inputs(mask=False))
    masked = torchrl(inputs(mask=True))
    for i, row in enumerate(rows):
        expected = forward_log_probs(model, row)
        assert ours[i]["tokens", "full"].tolist() == row
        assert_close(ours[i]["log_probs", "full"].tolist()[1:], expected[1:], 1e-4)
        assert len(unmasked[i]["tokens", "full"]) == len(row) - row.count(2)
        assert_close(masked[i]["log_probs", "full"].tolist()[1:], expected[1:], 1e-4)
