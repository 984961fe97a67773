"""`RemotePolicy` in TorchRL's own pipelines, in place of `TransformersWrapper`: ChatEnv with
GSM8KRewardParser through `env.rollout` and `LLMCollector`, `RetrieveKL` with two remote
scorers, MCAdvantage. The server runs as a real process (policy: the built-in model, reference:
the built-in model with another seed, so KL is not zero). Runs in `.venv-torchrl`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.conftest import assert_close, forward_log_probs
from tests.e2e.server import Server, serving_here
from tests.torchrl import torchrl_only

pytestmark = torchrl_only

ROWS = [
    {"query": "What is 6*7?", "answer": "#### 42"},
    {"query": "What is 2+2?", "answer": "#### 4"},
]
GREEDY = {"max_new_tokens": 6, "do_sample": False}
COEFF = 0.5


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, settings, ref_model) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    from app.engine.loader import builtin_model_dir

    tmp = tmp_path_factory.mktemp("remote-policy")
    ref_dir = builtin_model_dir(settings.replace(models={"builtin_seed": 1}).models)
    with serving_here(tmp, settings, "--ref-model", str(ref_dir)) as running:
        yield running


@pytest.fixture(scope="module")
def remote(server: Server) -> Iterator[object]:
    from rlserve_client import Client

    with Client(base_url=server.url) as client:
        yield client


@pytest.fixture(autouse=True)
def _list_to_stack() -> Iterator[None]:
    from tensordict import set_list_to_stack

    with set_list_to_stack(True):
        yield


def byte_reward() -> object:
    """A TorchRL transform adding a reward from the response tokens (how many are multiples of
    3), so that the sampled replies of a group score differently on this random model."""
    from torchrl.envs import Transform

    class ByteReward(Transform):
        def _step(self, tensordict, next_tensordict):  # type: ignore[no-untyped-def]
            reward = next_tensordict["reward"].clone()
            responses = tensordict.get(("tokens", "response"), as_list=True)
            for i, response in enumerate(responses):
                reward[i] += float((response % 3 == 0).sum())
            next_tensordict["reward"] = reward
            return next_tensordict

    return ByteReward()


def chat_env(tokenizer, *, repeats: int | None = None, max_steps: int | None = None):  # type: ignore[no-untyped-def]
    """TorchRL's ChatEnv over a tiny dataset, scored by its GSM8KRewardParser. With `repeats`:
    one row at a time, each prompt `repeats` times in a row (GRPO groups)."""
    from tensordict import TensorDict
    from torch.utils.data import DataLoader
    from torchrl.envs import StepCounter
    from torchrl.envs.llm import ChatEnv
    from torchrl.envs.llm.reward.gsm8k import GSM8KRewardParser

    def collate(rows: list[dict[str, str]]) -> TensorDict:
        return torch.stack([TensorDict.from_dict(r) for r in rows])

    batch = 2 if repeats is None else 1
    loader = DataLoader(ROWS, batch_size=batch, collate_fn=collate)
    env = ChatEnv.from_dataloader(
        loader,
        batch_size=(batch,),
        repeats=repeats,
        group_repeats=False,
        tokenizer=tokenizer,
        input_mode="history",
        system_prompt="Be terse.",
    )
    env.append_transform(GSM8KRewardParser(tokenizer=tokenizer))
    if max_steps is not None:
        env.append_transform(StepCounter(max_steps=max_steps))
    return env


def test_containers_and_keys_are_torchrls(remote, hf_tokenizer):
    from rlserve_client.policy import RemotePolicy
    from tensordict import TensorDict
    from torchrl.data.llm import History
    from torchrl.modules.llm import TransformersWrapper
    from torchrl.modules.llm.policies import ChatHistory, LogProbs, Masks, Text, Tokens

    policy = RemotePolicy(remote, generate_kwargs=GREEDY)
    twin = TransformersWrapper(
        torch.nn.Linear(1, 1), tokenizer=hf_tokenizer, generate=True, generate_kwargs=GREEDY
    )
    assert policy.in_keys == twin.in_keys and policy.out_keys == twin.out_keys
    scorer = policy.get_new_version(generate=False, log_probs_key="ref_log_probs")
    assert scorer.in_keys == [("history", "full")] and scorer.log_probs_key == "ref_log_probs"
    assert scorer.generate is False and scorer.inplace is True

    chats = [[{"role": "user", "content": r["query"]}] for r in ROWS]
    td = TensorDict({"history": ChatHistory(prompt=History.from_chats(chats))}, batch_size=[2])
    out = policy(td)
    assert isinstance(out["tokens"], Tokens) and isinstance(out["masks"], Masks)
    assert isinstance(out["log_probs"], LogProbs) and isinstance(out["text"], Text)
    assert isinstance(out["history"], ChatHistory)
    assert isinstance(out["history"].response, History)
    for row in out.unbind(0):
        full = row["tokens", "full"].tolist()
        assert full == row["tokens", "prompt"].tolist() + row["tokens", "response"].tolist()
        assert row["masks", "all_attention_mask"].all()
        assert row["history", "full"].role[-1] == "assistant"

    padded = policy.get_new_version(pad_output=True)(td.clone())
    lengths = [len(p) for p in out.get(("tokens", "prompt"), as_list=True)]
    prompts = padded["tokens", "prompt"]
    assert prompts.shape[-1] == max(lengths)
    for i, n in enumerate(lengths):  # prompts pad on the left with the model's pad token
        pad = prompts[i, : prompts.shape[-1] - n]
        assert (pad == hf_tokenizer.pad_token_id).all()
        assert prompts[i, -n:].tolist() == out[i]["tokens", "prompt"].tolist()


def test_num_samples_gives_torchrls_batch_layout(remote, hf_model):
    from rlserve_client.policy import RemotePolicy
    from tensordict import TensorDict
    from torchrl.data.llm import History
    from torchrl.modules.llm.policies import ChatHistory

    policy = RemotePolicy(
        remote, num_samples=3, generate_kwargs={"max_new_tokens": 5, "seed": 4, "ignore_eos": True}
    )
    assert policy.inplace is False
    chats = [[{"role": "user", "content": r["query"]}] for r in ROWS]
    td = TensorDict({"history": ChatHistory(prompt=History.from_chats(chats))}, batch_size=[2])
    out = policy(td)
    assert out.batch_size == torch.Size([2, 3])
    responses = {
        tuple(out[i, j]["tokens", "response"].tolist()) for i in range(2) for j in range(3)
    }
    assert len(responses) > 1  # sampled, not copies
    for i in range(2):
        for j in range(3):
            row = out[i, j]
            full = row["tokens", "full"].tolist()
            prompt_len = len(row["tokens", "prompt"])
            expected = forward_log_probs(hf_model, full)[prompt_len:]
            assert_close(row["log_probs", "response"].tolist(), expected, 1e-4)


def test_every_generation_parameter_the_server_takes_the_policy_takes(remote):
    """`generate_kwargs` are the server's vocabulary (`rlserve_client.sampling`): the shaping
    parameters TorchRL's own wrappers take from vLLM reach the server and shape the reply."""
    from rlserve_client.policy import RemotePolicy
    from tensordict import TensorDict
    from torchrl.data.llm import History
    from torchrl.modules.llm.policies import ChatHistory

    allowed = [40, 41, 42]
    kwargs = {
        "max_new_tokens": 6,
        "min_tokens": 6,
        "ignore_eos": True,
        "min_p": 0.01,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "logit_bias": {"41": 100.0},
        "allowed_token_ids": allowed,
        "stop_token_ids": [7],
        "seed": 3,
    }
    policy = RemotePolicy(remote, generate_kwargs=kwargs)
    chats = [[{"role": "user", "content": r["query"]}] for r in ROWS]
    td = TensorDict({"history": ChatHistory(prompt=History.from_chats(chats))}, batch_size=[2])
    out = policy(td)
    for i in range(2):
        response = out[i]["tokens", "response"].tolist()
        assert len(response) == 6 and set(response) <= set(allowed), response
        assert response[0] == 41  # the bias wins the first token; the penalties act after
    with pytest.raises(ValueError, match="beam_width"):
        RemotePolicy(remote, generate_kwargs={"beam_width": 2})


def test_env_rollout_with_retrieve_kl_equals_transformers_wrapper(
    remote, hf_model, ref_model, hf_tokenizer
):
    """The same greedy episodes through TorchRL's loop, once with TransformersWrapper and once
    with RemotePolicy: same tokens, log-probs, GSM8K rewards; KL and shaped rewards equal
    except on the end-of-turn token, which rlserve's assistant mask counts (and TorchRL's
    does not): there the KL is the independent forwards' difference."""
    from rlserve_client.policy import RemotePolicy
    from torchrl.envs.llm.transforms.kl import RetrieveKL
    from torchrl.modules.llm import TransformersWrapper

    def wrapper(model, **kwargs):  # type: ignore[no-untyped-def]
        return TransformersWrapper(model, tokenizer=hf_tokenizer, input_mode="history", **kwargs)

    theirs_kl = RetrieveKL(
        wrapper(hf_model, generate=False),
        wrapper(ref_model, generate=False, log_probs_key="ref_log_probs"),
        coeff=COEFF,
    )
    policy = RemotePolicy(remote, generate_kwargs=GREEDY)
    ours_kl = RetrieveKL(
        policy.get_new_version(generate=False),
        RemotePolicy(remote, model="reference", generate=False),  # its own key by default
        coeff=COEFF,
    )
    with torch.no_grad():
        theirs = chat_env(hf_tokenizer).rollout(2, wrapper(hf_model, generate_kwargs=GREEDY))
        theirs = theirs_kl(theirs.reshape(-1))
    ours = ours_kl(chat_env(hf_tokenizer).rollout(2, policy).reshape(-1))

    assert ours.batch_size == theirs.batch_size == torch.Size([4])
    for key in ("reward_answer", "reward_think", "reward_right", "success", "done"):
        assert torch.equal(ours["next", key], theirs["next", key]), key
    for i in range(4):
        mine, torchrl = ours[i], theirs[i]
        assert mine["tokens", "response"].tolist() == torchrl["tokens", "response"].tolist()
        assert mine["tokens", "full"].tolist() == torchrl["tokens", "full"].tolist()
        lp, their_lp = mine["log_probs", "response"].tolist(), torchrl["log_probs", "response"]
        assert_close(lp[1:], their_lp.tolist()[1:], 1e-4)  # TorchRL writes 0.0 first

        history = mine["next", "history", "prompt"]
        chat = [
            {"role": r, "content": c} for r, c in zip(history.role, history.content, strict=True)
        ]
        ids = hf_tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
        independent = [
            p - q
            for p, q in zip(
                forward_log_probs(hf_model, ids), forward_log_probs(ref_model, ids), strict=True
            )
        ]
        kl, their_kl = mine["next", "kl_penalty"], torchrl["next", "kl_penalty"].detach()
        reward, their_reward = mine["next", "reward"], torchrl["next", "reward"].detach()
        assert kl.shape == their_kl.shape == (len(ids),)
        extra = (kl != 0) & (their_kl == 0)
        assistant_turns = list(history.role).count("assistant")
        places = extra.nonzero().flatten().tolist()
        # rlserve's mask also has each reply's end-of-turn token, and the trailing bytes of a
        # multi-byte last character that the template's character offsets leave out
        assert [ids[j] for j in places].count(hf_tokenizer.eos_token_id) == assistant_turns
        assert all(ids[j] == hf_tokenizer.eos_token_id or 0x80 <= ids[j] < 0xC0 for j in places)
        assert_close(kl[extra].tolist(), [independent[j] for j in places], 1e-4)
        shaped = their_reward[extra].flatten() - COEFF * torch.tensor(
            [independent[j] for j in places]
        )
        assert_close(reward[extra].flatten().tolist(), shaped.tolist(), 1e-4)
        same = ~extra
        assert_close(kl[same].tolist(), their_kl[same].tolist(), 1e-4)
        assert_close(reward[same].flatten().tolist(), their_reward[same].flatten().tolist(), 1e-4)


def test_llm_collector_grpo_groups_with_remote_policy(remote, hf_model, hf_tokenizer):
    """LLMCollector drives RemotePolicy (sampling) over GRPO groups; the log-probs it writes
    are TorchRL's own scores of those tokens, and MCAdvantage over the collected rewards equals
    rlserve's group advantages."""
    from rlserve_client import group_advantages
    from rlserve_client.policy import RemotePolicy
    from torchrl.collectors.llm import LLMCollector
    from torchrl.modules.llm import TransformersWrapper
    from torchrl.objectives.llm import MCAdvantage

    policy = RemotePolicy(remote, generate_kwargs={"max_new_tokens": 6, "seed": 3})
    env = chat_env(hf_tokenizer, repeats=4, max_steps=1)
    env.append_transform(byte_reward())
    collector = LLMCollector(env, policy=policy, dialog_turns_per_batch=8)
    assert collector.policy is policy and policy.collector is collector
    data = next(iter(collector)).reshape(-1)
    collector.shutdown()
    assert data.batch_size == torch.Size([8])

    scorer = TransformersWrapper(
        hf_model, tokenizer=hf_tokenizer, input_mode="tokens", generate=False
    )
    with torch.no_grad():
        for row in data.unbind(0):
            full = row["tokens", "full"]
            prompt_len = len(row["tokens", "prompt"])
            from tensordict import TensorDict

            scored = scorer(TensorDict({"tokens": {"full": full[None]}}, batch_size=[1]))
            theirs = scored["log_probs", "full"][0, prompt_len:].tolist()
            assert_close(row["log_probs", "response"].tolist(), theirs, 1e-4)

    transform = MCAdvantage(grpo_size=4, prompt_key="query", trajectory_return="sum")
    groups = [w for w in (transform.inv(step[None]) for step in data.unbind(0)) if w is not None]
    assert len(groups) == 2  # one per prompt, written once its 4 replies are in
    for group in groups:
        query = group["query"]  # one string when the whole group shares it
        assert isinstance(query, str) or len(set(query)) == 1
        returns = [[float(r)] for r in group["next", "reward"].reshape(4, -1).sum(-1)]
        expected = [a[0] for a in group_advantages(returns, 4, "sum")]
        assert_close(group["advantage"].flatten().tolist(), expected, 1e-6)
    assert any(group["advantage"].abs().sum() > 0 for group in groups)


def test_get_dist_is_torchrls_distribution_truncated_to_the_top_k(remote, hf_model, hf_tokenizer):
    """`get_dist` on sequences of two lengths against TorchRL's TransformersWrapper.get_dist
    (full logits): at every predicted position the ids are a top k of TorchRL's distribution,
    their log-probs equal its log-softmax, the renormalized log-prob and entropy equal the
    truncated distribution's, and the mask leaves out padding and first tokens. `log_prob`
    equals an independent forward."""
    from rlserve_client.policy import RemotePolicy
    from tensordict import TensorDict, lazy_stack
    from torchrl.modules.llm import TransformersWrapper

    k = 8
    sequences = [[72, 105, 33, 10, 40, 50, 60], [87, 104, 121, 63]]
    td = lazy_stack(
        [TensorDict({("tokens", "full"): torch.tensor(s)}, batch_size=[]) for s in sequences]
    )
    policy = RemotePolicy(remote, input_mode="tokens", generate=False)
    dist = policy.get_dist(td, top_logprobs=k)
    theirs = TransformersWrapper(
        hf_model, tokenizer=hf_tokenizer, input_mode="tokens", generate=False, pad_output=False
    )
    width = max(map(len, sequences))
    assert dist.batch_shape == (2, width) and dist.ids.shape == (2, width, k)
    for i, seq in enumerate(sequences):
        with torch.no_grad():  # one sequence at a time: TorchRL's batch is padded its own way
            their_dist = theirs.get_dist(td[i : i + 1], mask_key=("masks", "all_attention_mask"))
        offset = width - len(seq)
        logits = torch.cat([torch.zeros(offset, their_dist.logits.shape[-1]), their_dist.logits[0]])
        expected_mask = [False] * (offset + 1) + [True] * (len(seq) - 1)
        assert dist.mask[i].tolist() == expected_mask
        for t in range(offset + 1, width):
            full = logits[t].log_softmax(-1)
            ours = dist.raw_log_probs[i, t]
            assert_close(ours.tolist(), full[dist.ids[i, t]].tolist(), 1e-4)
            assert float(ours.min()) >= float(full.topk(k).values[-1]) - 1e-5  # a top k
            kept = full.masked_fill(full < full.topk(k).values[-1], -torch.inf)
            reference = torch.distributions.Categorical(logits=kept)
            token = dist.ids[i, t, 3]
            assert_close(
                [float(dist.log_prob(_at(dist, i, t, token))[i, t])],
                [float(reference.log_prob(token))],
                1e-4,
            )
            assert_close([float(dist.entropy()[i, t])], [float(reference.entropy())], 1e-4)
            mass = 1 - float(full.topk(k).values.exp().sum())
            assert_close([float(dist.truncated_mass[i, t])], [mass], 1e-4)
    padded = policy.log_prob(td, as_padded_tensor=True, padding_side="left")
    for i, seq in enumerate(sequences):
        assert_close(padded[i, width - len(seq) :].tolist(), forward_log_probs(hf_model, seq), 1e-4)


def _at(dist, i: int, t: int, token: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Token ids of the distribution's shape, `token` at (i, t)."""
    value = dist.mode.clone()
    value[i, t] = token
    return value


def test_get_dist_of_a_generation_masks_the_assistant_reply(remote, hf_model):
    """A generating policy's `get_dist` scores what it generated (through its scoring twin):
    with the assistant mask only the reply counts, and greedy replies are the mode of the
    distribution at each of their tokens; `log_prob` gives the generation's own log-probs."""
    from rlserve_client.policy import RemotePolicy
    from tensordict import TensorDict
    from torchrl.data.llm import History
    from torchrl.modules.llm.policies import ChatHistory

    policy = RemotePolicy(remote, generate_kwargs=GREEDY)
    chats = [[{"role": "user", "content": r["query"]}] for r in ROWS]
    td = policy(TensorDict({"history": ChatHistory(prompt=History.from_chats(chats))}, [2]))
    dist = policy.get_dist(td, top_logprobs=4, mask_key=("masks", "all_assistant_mask"))
    scored = policy.log_prob(td, as_list=True)
    width = dist.batch_shape[-1]
    for i in range(2):
        full = td[i]["tokens", "full"]
        response = td[i]["tokens", "response"].tolist()
        assistant = td[i]["masks", "all_assistant_mask"]
        offset = width - len(full)
        assert dist.mask[i, offset:].tolist() == assistant.tolist()
        assert not bool(dist.mask[i, :offset].any())
        replied = dist.mode[i, offset:][assistant].tolist()
        assert replied[: len(response)] == response
        assert_close(scored[i].tolist(), forward_log_probs(hf_model, full.tolist()), 1e-4)
        generated = td[i]["log_probs", "response"].tolist()
        assert_close(scored[i][-len(response) :].tolist(), generated, 1e-4)
