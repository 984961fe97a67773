"""The transformers backend's prefix cache (`app.engine.transformers.prefix_cache`): a prompt
that continues a decoded sequence prefills only its new tokens, and every token and log-prob
stays what the uncached path gives (log-probs within float32 rounding of a forward over the
whole sequence); entries are bounded, least-recently-used, separate per version and adapter,
and dropped or kept at a weight change."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from app.engine.transformers import decode as hf_decode
from app.engine.transformers.freeze import ModelThreadControl
from app.engine.transformers.prefix_cache import PrefixCache, prefill_groups
from app.engine.types import GenerateItem, Generation, SamplingConfig
from tests.conftest import assert_close, forward_log_probs, served_app

EOS = frozenset({0})
GREEDY = SamplingConfig(max_new_tokens=12, do_sample=False, ignore_eos=True)


def run(
    model: Any, items: list[GenerateItem], prefix: PrefixCache | None, version: int = 0
) -> list[Generation]:
    control = ModelThreadControl()
    control.version = version
    return hf_decode.generate(
        model, items, pad_id=0, eos_ids=EOS, decode=str, control=control, prefix=prefix
    )


def prefilled(prefix: PrefixCache, before: tuple[int, int]) -> tuple[int, int]:
    """(prompt tokens looked up, of those found) since `before`."""
    stats = prefix.stats()
    return stats.queried_tokens - before[0], stats.hit_tokens - before[1]


def counts(prefix: PrefixCache) -> tuple[int, int]:
    stats = prefix.stats()
    return stats.queried_tokens, stats.hit_tokens


def assert_exact(model: Any, prompt: tuple[int, ...], generation: Generation) -> None:
    """Each sampled log-prob equals a forward over the whole sequence, within float32
    rounding."""
    sequence = [*prompt, *generation.token_ids]
    expected = forward_log_probs(model, sequence)[len(prompt) :]
    assert_close(generation.log_probs, expected, 1e-5)


def test_an_agents_turns_prefill_only_their_new_tokens(hf_model):
    """Three turns of one session, each prompt the last turn's prompt, its reply and a new
    message: from the second turn on, only the reply's last token and the new message are
    prefilled, and the tokens are those of a server without the cache."""
    prefix = PrefixCache(1 << 30)
    prompt: tuple[int, ...] = (5, 17, 33, 2, 9, 40, 41)
    for turn in range(3):
        before = counts(prefix)
        (cached,) = run(hf_model, [GenerateItem(prompt, GREEDY, seed=turn)], prefix)
        (plain,) = run(hf_model, [GenerateItem(prompt, GREEDY, seed=turn)], None)
        assert cached.token_ids == plain.token_ids
        assert_close(cached.log_probs, plain.log_probs, 1e-5)
        assert_exact(hf_model, prompt, cached)
        looked_up, found = prefilled(prefix, before)
        assert looked_up == len(prompt)
        # the entry: the last prompt and every sampled token but the last (never fed)
        assert found == (0 if turn == 0 else len(prompt) - 4)
        prompt = (*prompt, *cached.token_ids, 60 + turn, 61, 62)
    held = prefix.stats()
    assert held.entries == 1  # each turn's entry replaced the one it extends
    heads_dim = 2 * hf_model.config.num_hidden_layers * hf_model.config.num_key_value_heads
    per_token = heads_dim * (hf_model.config.hidden_size // hf_model.config.num_attention_heads)
    assert held.bytes == per_token * 4 * (len(prompt) - 3 - 1)  # float32 keys and values


def test_a_group_sent_as_separate_requests_prefills_its_prompt_once(hf_model):
    prefix = PrefixCache(1 << 30)
    prompt = tuple(range(30, 70))
    config = SamplingConfig(max_new_tokens=8, temperature=1.0)
    first = run(hf_model, [GenerateItem(prompt, config, seed=0)], prefix)[0]
    before = counts(prefix)
    rest = [run(hf_model, [GenerateItem(prompt, config, seed=s)], prefix)[0] for s in (1, 2, 3)]
    assert prefilled(prefix, before) == (3 * len(prompt), 3 * (len(prompt) - 1))
    for seed, generation in enumerate([first, *rest]):
        (plain,) = run(hf_model, [GenerateItem(prompt, config, seed=seed)], None)
        assert generation.token_ids == plain.token_ids
        assert_close(generation.log_probs, plain.log_probs, 1e-5)


def test_a_batch_mixing_hits_misses_and_a_shared_prompt_decodes_as_without_the_cache(hf_model):
    prefix = PrefixCache(1 << 30)
    long = tuple(range(40, 75))
    run(hf_model, [GenerateItem(long, GREEDY, seed=0)], prefix)
    sampled = SamplingConfig(max_new_tokens=10, temperature=0.9, repetition_penalty=1.2)
    items = [
        GenerateItem((*long, 3, 4), sampled, seed=1),  # continues the entry
        GenerateItem((*long, 3, 4), sampled, seed=2),  # the same prompt
        GenerateItem((7, 8), GREEDY, seed=3),  # nothing cached
        GenerateItem((*long[:20], 99), GREEDY, seed=4),  # a shorter shared prefix
        GenerateItem(tuple(range(100, 160)), sampled, seed=5),  # long, nothing cached
    ]
    # (the long prompt that hits nothing is a forward of its own: the others, which prefill
    # a token or two each, are not padded to its 60)
    hits = [prefix.lookup(item.prompt_ids, 0, None) for item in items]
    groups = prefill_groups([item.prompt_ids for item in items], hits)
    assert [4] in groups and len(groups) >= 2
    before = counts(prefix)
    cached = run(hf_model, items, prefix)
    plain = run(hf_model, items, None)
    looked_up, found = prefilled(prefix, before)
    assert looked_up == len(long) + 2 + 2 + 21 + 60  # distinct prompts only
    assert found == len(long) + 20

    for item, got, want in zip(items, cached, plain, strict=True):
        assert got.token_ids == want.token_ids
        assert_close(got.log_probs, want.log_probs, 1e-5)
        assert_exact(hf_model, item.prompt_ids, got)


def test_entries_are_bounded_and_least_recently_used_go_first(hf_model):
    config = hf_model.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * 4
    per_token *= config.hidden_size // config.num_attention_heads
    prefix = PrefixCache(per_token * 50)  # room for two of the three sequences below
    prompts = [tuple(range(b, b + 20)) for b in (30, 60, 90)]
    one = SamplingConfig(max_new_tokens=1, do_sample=False)
    run(hf_model, [GenerateItem(prompts[0], one, seed=0)], prefix)
    run(hf_model, [GenerateItem(prompts[1], one, seed=0)], prefix)
    run(hf_model, [GenerateItem(prompts[0], one, seed=0)], prefix)  # used again: the newest
    run(hf_model, [GenerateItem(prompts[2], one, seed=0)], prefix)  # evicts prompts[1]'s
    stats = prefix.stats()
    assert stats.entries == 2 and stats.bytes == 2 * 20 * per_token <= stats.max_bytes
    for prompt, kept in zip(prompts, (True, False, True), strict=True):
        hit = prefix.lookup((*prompt, 1), 0, None)
        assert (hit.length if hit else 0) == (20 if kept else 0)


def test_a_weight_change_drops_the_entries_unless_told_to_keep_them(hf_model):
    prefix = PrefixCache(1 << 30)
    prompt = tuple(range(10, 30))
    run(hf_model, [GenerateItem(prompt, GREEDY, seed=0)], prefix, version=3)
    longer = (*prompt, 1, 2)
    before = counts(prefix)
    run(hf_model, [GenerateItem(longer, GREEDY, seed=0)], prefix, version=4)  # not version 3's
    assert prefilled(prefix, before)[1] == 0
    prefix.weights_changed(5, keep=False)
    assert prefix.stats().entries == 0 and prefix.stats().bytes == 0
    run(hf_model, [GenerateItem(prompt, GREEDY, seed=0)], prefix, version=5)
    prefix.weights_changed(6, keep=True)  # a snapshot with the cache policy 'keep'
    before = counts(prefix)
    run(hf_model, [GenerateItem(longer, GREEDY, seed=0)], prefix, version=6)
    assert prefilled(prefix, before)[1] == len(prompt)


def test_rows_of_another_adapter_or_alone_neither_reuse_nor_leave_entries(hf_model):
    prefix = PrefixCache(1 << 30)
    prompt = tuple(range(10, 30))
    run(hf_model, [GenerateItem(prompt, GREEDY, seed=0, reuse_prefix=False)], prefix)
    assert prefix.stats().entries == 0 and prefix.stats().queried_tokens == 0
    asked = SamplingConfig(max_new_tokens=4, return_prompt_log_probs=True)
    (scored,) = run(hf_model, [GenerateItem(prompt, asked, seed=0)], prefix)
    assert scored.prompt_log_probs is not None and prefix.stats().entries == 0
    run(hf_model, [GenerateItem(prompt, GREEDY, seed=0)], prefix)
    assert prefix.lookup((*prompt, 1), 0, ("other", 1)) is None
    hit = prefix.lookup((*prompt, 1), 0, None)
    assert hit is not None and hit.length == len(prompt)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_half_precision_entries_stay_within_the_dtypes_rounding(hf_model, dtype):
    model = type(hf_model)(hf_model.config).to(dtype)
    model.load_state_dict(hf_model.state_dict())
    model.eval()
    prefix = PrefixCache(1 << 30)
    prompt = tuple(range(50, 80))
    (first,) = run(model, [GenerateItem(prompt, GREEDY, seed=0)], prefix)
    follow = (*prompt, *first.token_ids, 7, 8)
    (cached,) = run(model, [GenerateItem(follow, GREEDY, seed=0)], prefix)
    (plain,) = run(model, [GenerateItem(follow, GREEDY, seed=0)], None)
    assert prefix.stats().hit_tokens == len(prompt) + len(first.token_ids) - 1
    assert_close(cached.log_probs, plain.log_probs, 0.05)


def metric(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(f'{name}{{model="policy"}}'))
    return float(line.rsplit(" ", 1)[1])


async def prefix_metrics(client: Any) -> tuple[float, float, float]:
    text = (await client.get("/metrics")).text
    names = ("queries_total", "hits_total", "entries")
    return tuple(metric(text, f"rlserve_prefix_cache_{n}") for n in names)  # type: ignore[return-value]


async def test_a_chat_sessions_turns_hit_the_cache_as_metrics_show(settings, model_dir):
    """Three turns of a chat session: from the second, the history comes from the cache
    (/metrics: hits over queries), the replies are those of a server without it, a
    batch-invariant request neither reads nor fills it, and a weight load empties it."""
    plain_settings = settings.replace(models={"backend": "transformers", "prefix_cache_bytes": 0})
    async with (
        served_app(settings.replace(models={"backend": "transformers"})) as client,
        served_app(plain_settings) as plain,
    ):
        assert "rlserve_prefix_cache_queries_total{" not in (await plain.get("/metrics")).text
        messages = [{"role": "user", "content": "Count with me: one two three"}]
        found = []
        for turn in range(3):
            body = {"messages": messages, "max_tokens": 8, "temperature": 0, "logprobs": True}
            before = await prefix_metrics(client)
            reply = (await client.post("/v1/chat/completions", json=body)).json()
            after = await prefix_metrics(client)
            want = (await plain.post("/v1/chat/completions", json=body)).json()
            assert "choices" in reply, reply
            got_choice, want_choice = reply["choices"][0], want["choices"][0]
            assert got_choice["message"] == want_choice["message"]
            assert_close(
                [t["logprob"] for t in got_choice["logprobs"]["content"]],
                [t["logprob"] for t in want_choice["logprobs"]["content"]],
                1e-5,
            )
            assert after[0] - before[0] == reply["usage"]["prompt_tokens"]
            found.append(after[1] - before[1])
            messages += [got_choice["message"], {"role": "user", "content": f"and {turn + 4}?"}]
        assert found[0] == 0 and all(f > 20 for f in found[1:])
        invariant = {"messages": [messages], "max_tokens": 4, "batch_invariant": True}
        before = await prefix_metrics(client)
        invariant_reply = await client.post("/v1/generate", json=invariant)
        assert invariant_reply.status_code == 200, invariant_reply.text
        assert await prefix_metrics(client) == before
        assert before[2] >= 1
        loaded = await client.post("/v1/weights/load", json={"path": str(model_dir)})
        assert loaded.status_code == 200, loaded.text
        assert (await prefix_metrics(client))[2] == 0
