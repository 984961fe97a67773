"""TensorDict conversion: TorchRL's padding layout, and back again without loss."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from rlserve_client.tensordicts import samples_from_tensordict, samples_to_tensordict
from rlserve_client.types import GenerateResult, Sample

SAMPLES = [
    {
        "text": {"prompt": "ab", "response": "c", "full": "abc"},
        "tokens": {"prompt": [1, 2], "response": [3], "full": [1, 2, 3]},
        "masks": {"all_attention_mask": [1, 1, 1], "all_assistant_mask": [0, 0, 1]},
        "log_probs": {"response": [-0.5]},
        "history": {"full": [{"role": "user", "content": "ab"}]},
        "finish_reason": "length",
    },
    {
        "text": {"prompt": "d", "response": "efg", "full": "defg"},
        "tokens": {"prompt": [4], "response": [5, 6, 7], "full": [4, 5, 6, 7]},
        "masks": {"all_attention_mask": [1, 1, 1, 1], "all_assistant_mask": [0, 1, 1, 1]},
        "log_probs": {"response": [-1.0, -2.0, -3.0]},
        "history": {"full": [{"role": "user", "content": "d"}]},
        "finish_reason": "stop",
    },
]


def samples() -> list[Sample]:
    return GenerateResult.model_validate(
        {"policy_version": 3, "model": "policy", "outputs": [[s] for s in SAMPLES]}
    ).samples


def test_padded_layout_is_left_padded_prompts_and_right_padded_responses():
    td = samples_to_tensordict(samples(), pad_token_id=9)
    assert td.batch_size == torch.Size([2])
    assert td["tokens", "prompt"].tolist() == [[1, 2], [9, 4]]
    assert td["tokens", "response"].tolist() == [[3, 9, 9], [5, 6, 7]]
    assert td["tokens", "full"].tolist() == [[1, 2, 3, 9, 9], [9, 4, 5, 6, 7]]
    assert td["masks", "all_attention_mask"].tolist() == [
        [True, True, True, False, False],
        [False, True, True, True, True],
    ]
    assert td["masks", "all_assistant_mask"].tolist() == [
        [False, False, True, False, False],
        [False, False, True, True, True],
    ]
    assert td["log_probs", "response"].tolist() == [[-0.5, 0.0, 0.0], [-1.0, -2.0, -3.0]]
    assert td["masks", "all_attention_mask"].dtype == torch.bool
    assert td["text", "response"] == ["c", "efg"]
    assert td["history", "full"][1] == [{"role": "user", "content": "d"}]


def test_unpadded_is_a_lazy_stack_with_each_samples_own_lengths():
    td = samples_to_tensordict(samples(), padded=False, pad_token_id=9)
    assert [row["tokens", "full"].tolist() for row in td.unbind(0)] == [[1, 2, 3], [4, 5, 6, 7]]
    assert td[1]["log_probs", "response"].tolist() == [-1.0, -2.0, -3.0]


@pytest.mark.parametrize("padded", [True, False])
def test_round_trip_recovers_every_field(padded):
    original = samples()
    back = samples_from_tensordict(samples_to_tensordict(original, padded=padded, pad_token_id=9))
    for before, after in zip(original, back, strict=True):
        assert after.tokens == before.tokens
        assert after.masks == before.masks
        assert after.text == before.text
        assert after.history is not None and before.history is not None
        assert after.history.full == before.history.full
        assert after.log_probs is not None and before.log_probs is not None
        assert after.log_probs.response == before.log_probs.response


def test_the_core_client_does_not_import_torch():
    code = "import sys, rlserve_client; print('torch' in sys.modules, 'tensordict' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


async def test_padding_uses_the_models_pad_token_reported_by_the_server(api, hf_tokenizer):
    pad = hf_tokenizer.pad_token_id
    assert pad is not None and pad != 0 and pad in hf_tokenizer.all_special_ids
    card = (await api.models()).models[0]
    assert card.pad_token_id == pad
    generated = await api.generate(
        tokens=[[1, 2, 3], [4]], max_tokens=3, temperature=0, ignore_eos=True
    )
    assert generated.pad_token_id == pad
    td = generated.to_tensordict()
    # [4] is left-padded by two positions: the model's pad token, not token 0 (a real byte)
    assert td["tokens", "full"][1, :2].tolist() == [pad, pad]
    assert td["tokens", "prompt"][1].tolist() == [pad, pad, 4]
    scored = await api.logprobs(tokens=[[5, 6, 7], [8]])
    assert scored.to_tensordict()["tokens", "full"][1].tolist() == [8, pad, pad]
    assert scored.to_tensordict(pad_token_id=0)["tokens", "full"][1].tolist() == [8, 0, 0]
    with pytest.raises(ValueError, match="pad_token_id"):
        scored.model_copy(update={"pad_token_id": None}).to_tensordict()


async def test_binary_replies_build_the_same_tensordicts_as_json(api):
    """`tensors=True` replies hold tensors (no lists) and convert to the same TensorDicts."""
    body = {"prompt_tokens": [[5, 77, 12], [9]], "response_tokens": [[41, 8], [2, 17, 250]]}
    plain = await api.logprobs(**body, top_logprobs=2)
    packed = await api.logprobs(**body, top_logprobs=2, tensors=True)
    first = packed.outputs[0]
    assert isinstance(first.log_probs.full, torch.Tensor)
    assert isinstance(first.top_logprobs.log_probs, torch.Tensor)
    assert first.top_logprobs.log_probs[1:].tolist() == plain.outputs[0].top_logprobs.log_probs[1:]
    for padded in (True, False):
        expected = plain.to_tensordict(padded=padded)
        got = packed.to_tensordict(padded=padded)
        for want, have in zip(expected.unbind(0), got.unbind(0), strict=True):
            keys = [k for k in want.keys(True, True) if isinstance(want.get(k), torch.Tensor)]
            assert keys and sorted(map(str, keys)) == sorted(
                str(k) for k in have.keys(True, True) if isinstance(have.get(k), torch.Tensor)
            )
            for key in keys:
                assert torch.equal(have.get(key), want.get(key)), key
    generated = await api.generate(tokens=[[5, 77]], max_new_tokens=4, n=2, seed=1, tensors=True)
    again = await api.generate(tokens=[[5, 77]], max_new_tokens=4, n=2, seed=1)
    assert torch.equal(
        generated.to_tensordict().get(("tokens", "full")),
        again.to_tensordict().get(("tokens", "full")),
    )


async def test_tensor_inputs_travel_as_binary(api):
    """Token tensors are sent as they are (binary) and score like the same lists."""
    rows = [[5, 77, 12, 41], [9, 2]]
    plain = await api.logprobs(tokens=rows)
    sent = await api.logprobs(tokens=[torch.tensor(r) for r in rows])
    assert [o.log_probs.full for o in sent.outputs] == [o.log_probs.full for o in plain.outputs]


def test_a_reward_a_judge_left_out_is_nan_with_its_advantage() -> None:
    from rlserve_client.types import RolloutResult

    def step(sample: dict, reward: float | None, advantage: float | None) -> dict:
        return {
            **sample,
            "reward": reward,
            "done": True,
            "terminated": True,
            "truncated": False,
            "policy_version": 3,
            "advantage": advantage,
        }

    trajectories = [
        {"env_id": "e", "row": 0, "steps": [step(SAMPLES[0], 1.0, 0.7)], "reward": 1.0},
        {"env_id": "e", "row": 1, "steps": [step(SAMPLES[1], None, None)], "reward": None},
    ]
    result = RolloutResult.model_validate(
        {"trajectories": trajectories, "num_dialog_turns": 2, "policy_version": 3}
    )
    td = result.to_tensordict(pad_token_id=0)
    reward = td["next", "reward"].flatten()
    assert reward[0] == 1.0 and reward[1].isnan()
    advantage = td["advantage"].flatten()
    assert advantage[0] == pytest.approx(0.7) and advantage[1].isnan()
