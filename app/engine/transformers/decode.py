"""Batched scoring and decoding on a transformers causal LM (blocking; call from a worker thread).

Prompts are left-padded with explicit position ids, so a row's values do not depend on the
other rows in its batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from app.engine.distribution import assemble, log_probs_of, position_scores
from app.engine.sampling import RowSampler
from app.engine.transformers.compiled import CompiledDecode, StaticRun, cache_argument
from app.engine.transformers.freeze import ModelThreadControl
from app.engine.transformers.lora import LoraHooks
from app.engine.transformers.moe import RoutedRows, recording, replayed
from app.engine.transformers.prefix_cache import PrefixCache, cached_prefill, remember
from app.engine.transformers.rows import adapted, distinct_prompts, positions, returned_cache
from app.engine.types import GenerateItem, Generation, Scores, ScoreSpec, version_spans

if TYPE_CHECKING:
    from rlserve_client.moe import Routing


def padded(
    rows: Sequence[Sequence[int]], pad_id: int, device: torch.device, *, left: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows padded to the longest (on the left or the right), and their attention mask,
    built on the host in one tensor each and copied to the device."""
    width = max(len(r) for r in rows)
    ids = torch.tensor(
        [
            [*[pad_id] * (width - len(r)), *r] if left else [*r, *[pad_id] * (width - len(r))]
            for r in rows
        ],
        dtype=torch.long,
    )
    lengths = torch.tensor([len(r) for r in rows])[:, None]
    columns = torch.arange(width)[None, :]
    mask = columns >= width - lengths if left else columns < lengths
    return ids.to(device), mask.long().to(device)


def token_log_probs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits[:, t-1])[ids[:, t]] for t >= 1, with 0.0 prepended; logits [B, T, V]."""
    picked = log_probs_of(logits[:, :-1].float(), ids[:, 1:])
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)


LOGIT_CHUNK_ELEMENTS = 1 << 24
"""Positions are scored in chunks of at most this many logits (64 MiB in float32), so the
full-vocabulary work of a call stays bounded however long its sequences are."""


@torch.inference_mode()
def score(model: Any, sequences: Sequence[Sequence[int]], pad_id: int) -> list[list[float]]:
    items = [(seq, ScoreSpec()) for seq in sequences]
    return [s.log_probs.tolist() for s in score_detailed(model, items, pad_id)]


@torch.inference_mode()
def score_detailed(
    model: Any,
    items: Sequence[tuple[Sequence[int], ScoreSpec]],
    pad_id: int,
    lora: LoraHooks | None = None,
    routing: Routing | None = None,
) -> list[Scores]:
    """One forward through the model's trunk for the batch, then its output head over each
    row's positions in chunks of `LOGIT_CHUNK_ELEMENTS`, answering each row's spec. Rows that
    ask for log-probs alone share their chunks (`_plain_scores`). A row whose spec names a
    LoRA adapter runs with it (`lora`: the model's hooks); a row whose spec gives routed
    experts routes as they say (`routing`: the model's MoE routers)."""
    device = model.device
    ids, mask = padded([seq for seq, _ in items], pad_id, device, left=False)
    specs = [spec for _, spec in items]
    with (
        adapted(lora, [spec.adapter for spec in specs]),
        replayed(routing, specs, ids.shape[1]),
    ):
        hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False)[0]
    head = model.get_output_embeddings()
    chunk = max(1, LOGIT_CHUNK_ELEMENTS // head.weight.shape[0])
    results: list[Scores | None] = [None] * len(items)
    group: list[int] = []
    size = 0

    def flush() -> None:
        nonlocal group, size
        if group:
            scored = _plain_scores(
                model.config, head, hidden, ids, [items[r] for r in group], group
            )
            for row, scores in zip(group, scored, strict=True):
                results[row] = scores
        group, size = [], 0

    for row, (seq, spec) in enumerate(items):
        scored = len(seq) - 1
        if spec.extras or scored > chunk:
            results[row] = _row_scores(model.config, head, hidden, ids, row, seq, spec, chunk)
            continue
        if size + scored > chunk:
            flush()
        group.append(row)
        size += scored
    flush()
    return [r for r in results if r is not None]


def _row_scores(
    config: Any,
    head: Any,
    hidden: torch.Tensor,
    ids: torch.Tensor,
    row: int,
    seq: Sequence[int],
    spec: ScoreSpec,
    chunk: int,
) -> Scores:
    """One row's positions, `chunk` at a time, with whatever its spec asks for."""
    parts = []
    for begin in range(1, len(seq), chunk):
        end = min(begin + chunk, len(seq))
        logits = _head_logits(config, head, hidden[row, begin - 1 : end - 1])
        extras = spec.extras and end > spec.start
        parts.append(position_scores(logits, ids[row, begin:end], spec, extras=extras))
    return assemble(parts, spec.start, len(seq))


def _plain_scores(
    config: Any,
    head: Any,
    hidden: torch.Tensor,
    ids: torch.Tensor,
    items: Sequence[tuple[Sequence[int], ScoreSpec]],
    rows: list[int],
) -> list[Scores]:
    """Log-probs alone for `rows`, whose logits fit one chunk together: the output head row
    by row (the very products `_row_scores` computes: a matrix product's bits depend on its
    shape), then `position_scores`' arithmetic over all of them at once and one copy to the
    host, instead of a dozen small operations per row."""
    lengths = [len(seq) - 1 for seq, _ in items]
    logits = torch.cat(
        [_head_logits(config, head, hidden[row, :n]) for row, n in zip(rows, lengths, strict=True)]
    ).float()
    targets = torch.cat([ids[row, 1 : n + 1] for row, n in zip(rows, lengths, strict=True)])
    log_probs = log_probs_of(logits, targets).cpu()
    zero = torch.zeros(1)
    return [
        Scores(log_probs=torch.cat([zero, part]), start=spec.start)
        for part, (_, spec) in zip(log_probs.split(lengths), items, strict=True)
    ]


def _head_logits(config: Any, head: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The output head as the model's own forward applies it, with the logit scalings the
    architectures in transformers put after it (Cohere, Granite, Gemma 2/3)."""
    logits = head(hidden)
    if scale := getattr(config, "logit_scale", None):
        logits = logits * scale
    if scaling := getattr(config, "logits_scaling", None):
        logits = logits / scaling
    if cap := getattr(config, "final_logit_softcapping", None):
        logits = torch.tanh(logits / cap) * cap
    return logits


class _Rows:
    """Book-keeping of the rows being decoded."""

    def __init__(self, items: Sequence[GenerateItem]) -> None:
        self.items = items
        self.tokens: list[list[int]] = [[] for _ in items]
        self.raw: list[list[float]] = [[] for _ in items]
        self.processed: list[list[float]] = [[] for _ in items]
        self.versions: list[list[int]] = [[] for _ in items]
        self.finish: list[str | None] = [None for _ in items]
        self.stop_reason: list[str | int | None] = [None for _ in items]

    def active(self) -> list[int]:
        return [i for i, f in enumerate(self.finish) if f is None]


@torch.inference_mode()
def generate(
    model: Any,
    items: Sequence[GenerateItem],
    *,
    pad_id: int,
    eos_ids: frozenset[int],
    decode: Callable[[list[int]], str],
    control: ModelThreadControl | None = None,
    lora: LoraHooks | None = None,
    routing: Routing | None = None,
    compiled: CompiledDecode | None = None,
    prefix: PrefixCache | None = None,
) -> list[Generation]:
    """Decode `items` together. With a `control`, the loop parks at its checkpoints while the
    model is frozen, ends every row on an abort, and labels each token with its version. A row
    that names a LoRA adapter runs with it (`lora`: the model's hooks). A row whose config asks
    gets the experts its tokens were routed to (`routing`: the model's MoE routers). With
    `compiled`, the steps run compiled over a static cache where they can
    (`app.engine.transformers.compiled`: not on a model with adapters or MoE routers). With
    a `prefix` cache, prompts reuse the keys and values of earlier sequences they continue,
    and each row's are kept for later ones (`app.engine.transformers.prefix_cache`: not with
    compiled steps, MoE routers, prompt log-probs or a row that must prefill alone)."""
    if compiled is not None and (lora is not None or routing is not None or not compiled.usable()):
        compiled = None
    if (
        compiled is not None
        or routing is not None
        or not all(it.reuse_prefix and not it.config.return_prompt_log_probs for it in items)
    ):
        prefix = None
    with recording(routing, items) as recorded:
        routes = RoutedRows(recorded)
        return _decode(
            model, items, pad_id, eos_ids, decode, control, lora, routes, compiled, prefix
        )


def _decode(
    model: Any,
    items: Sequence[GenerateItem],
    pad_id: int,
    eos_ids: frozenset[int],
    decode: Callable[[list[int]], str],
    control: ModelThreadControl | None,
    lora: LoraHooks | None,
    routes: RoutedRows,
    compiled: CompiledDecode | None,
    prefix: PrefixCache | None,
) -> list[Generation]:
    control = control or ModelThreadControl()
    device = model.device
    configs = [item.config for item in items]
    sampler = RowSampler(configs, [it.seed for it in items], device, eos_ids)
    ids, mask = padded([it.prompt_ids for it in items], pad_id, device, left=True)
    want_prompt = any(c.return_prompt_log_probs for c in configs)
    version = control.checkpoint()
    new_tokens = max(c.max_new_tokens for c in configs)
    cached = prefix and cached_prefill(model, items, pad_id, version, lora, prefix)
    if cached:
        ids, mask, cache, prefill_logits = cached
    else:
        cache, prefill_logits = _prefill(model, items, ids, mask, want_prompt, lora, routes)
    start = positions(mask)
    run: StaticRun | None = None
    if compiled is not None:
        try:
            run, cache = compiled.begin(ids, mask, new_tokens, cache), None
        except Exception as error:  # on eagerly (`CompiledDecode.failed`)
            compiled.failed(error)
    adapters = [item.adapter for item in items]
    prompt_lps = token_log_probs(prefill_logits, ids).cpu() if want_prompt else None
    seen = None
    if sampler.needs_penalty:
        vocab = prefill_logits.shape[-1]
        seen = torch.zeros((len(items), vocab), dtype=torch.bool, device=device)
        seen.scatter_(1, ids, mask.bool())
    rows = _Rows(items)
    logits = prefill_logits[:, -1].float()
    del prefill_logits
    next_position = start[:, -1:] + 1
    columns: list[torch.Tensor] = []  # the tokens chosen so far (a cache rebuild needs them)
    cache_name = cache_argument(model)
    for _step in range(new_tokens):
        processed = sampler.process(logits, seen, rows.tokens)
        chosen = sampler.choose(processed)
        sampler.observe(chosen)
        # The step's one copy to the host: the chosen ids with both log-probs of each (float32
        # values are exact in float64, and so are token ids).
        chosen_list, raw_list, proc_list = (
            torch.stack(
                [chosen.double(), log_probs_of(logits, chosen), log_probs_of(processed, chosen)]
            )
            .cpu()
            .tolist()
        )
        for i in rows.active():
            abandoned = items[i].abandoned
            if (abandoned is not None and abandoned.is_set()) or control.aborting.is_set():
                rows.finish[i] = "abort"  # requester gone, or serving paused with abort
                continue
            rows.versions[i].append(version)
            token = int(chosen_list[i])
            _advance(rows, i, token, raw_list[i], proc_list[i], eos_ids, decode)
        if not rows.active():
            break
        if seen is not None:
            seen.scatter_(1, chosen[:, None], True)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        columns.append(chosen[:, None])
        previous, version = version, control.checkpoint()
        rebuild = version != previous
        if run is not None:
            stepped = (
                run.rebuild(torch.cat([ids, *columns], dim=1), positions(mask))
                if rebuild
                else run.step(chosen, next_position)
            )
            if stepped is not None:
                logits, next_position = stepped, next_position + 1
                continue
            # The step failed (`CompiledDecode.failed`: it did not compile, or memory ran
            # out): on eagerly, over a cache rebuilt from everything so far.
            run, rebuild = None, True
        with adapted(lora, adapters):
            if not rebuild:
                out = model(
                    input_ids=chosen[:, None],
                    attention_mask=mask,
                    position_ids=next_position,
                    **{cache_name: cache},
                    use_cache=True,
                )
            else:
                # The weights changed while frozen: the cache holds the old weights' keys and
                # values, so it is rebuilt over everything so far. Every later token then
                # comes from the new weights exactly, as if the whole sequence had been fed
                # to them.
                out = model(
                    input_ids=torch.cat([ids, *columns], dim=1),
                    attention_mask=mask,
                    position_ids=positions(mask),
                    use_cache=True,
                    logits_to_keep=1,
                )
        routes.stepped(len(items), rebuilt=rebuild)
        cache, next_position = returned_cache(out), next_position + 1
        logits = out.logits[:, -1].float()
    if prefix is not None and run is None:  # (every key and value is of `version`'s weights)
        remember(prefix, cache, mask, items, rows.tokens, version)
    return [_result(rows, i, prompt_lps, routes) for i in range(len(items))]


def _prefill(
    model: Any,
    items: Sequence[GenerateItem],
    ids: torch.Tensor,
    mask: torch.Tensor,
    want_prompt: bool,
    lora: LoraHooks | None,
    routes: RoutedRows,
) -> tuple[Any, torch.Tensor]:
    """The prompts' forward into a new key/value cache; the cache and the logits (of every
    position with `want_prompt`, else the last). A prompt shared by several rows (a GRPO
    group, n > 1) is prefilled once; its cache and logits are then copied to each of its rows."""
    firsts, expand = distinct_prompts(items, ids.device)
    with adapted(lora, [items[i].adapter for i in firsts]):
        out = model(
            input_ids=ids[firsts],
            attention_mask=mask[firsts],
            position_ids=positions(mask)[firsts],
            use_cache=True,
            logits_to_keep=0 if want_prompt else 1,
        )
    cache, logits = returned_cache(out), out.logits
    routes.prefilled(len(firsts), expand)
    if expand is not None:
        cache.reorder_cache(expand)
        logits = logits.index_select(0, expand)
    return cache, logits


def _advance(
    rows: _Rows,
    i: int,
    token: int,
    raw_lp: float,
    processed_lp: float,
    eos_ids: frozenset[int],
    decode: Callable[[list[int]], str],
) -> None:
    config = rows.items[i].config
    rows.tokens[i].append(token)
    rows.raw[i].append(raw_lp)
    rows.processed[i].append(processed_lp)
    if (sink := rows.items[i].sink) is not None:
        sink.put([token], [raw_lp])
    if token in eos_ids and not config.ignore_eos:
        rows.finish[i] = "stop"
    elif token in config.stop_token_ids:
        rows.finish[i], rows.stop_reason[i] = "stop", token
    elif (
        config.stop_sequences
        and len(rows.tokens[i]) > config.min_tokens
        and (hit := _stop_hit(rows.tokens[i], config.stop_sequences, decode, config.min_tokens))
    ):
        rows.finish[i], rows.stop_reason[i] = "stop", hit
    elif len(rows.tokens[i]) >= config.max_new_tokens:
        rows.finish[i] = "length"


def _stop_hit(
    tokens: list[int], stops: Sequence[str], decode: Callable[[list[int]], str], skip: int = 0
) -> str | None:
    """The first stop string in the text of `tokens` after that of their first `skip` (the
    min-tokens, whose text vLLM does not search either)."""
    text = decode(tokens)
    if skip:
        text = text[len(decode(tokens[:skip])) :]
    return next((s for s in stops if s in text), None)


def _result(rows: _Rows, i: int, prompt_lps: torch.Tensor | None, routes: RoutedRows) -> Generation:
    item = rows.items[i]
    prompt = None
    if prompt_lps is not None and item.config.return_prompt_log_probs:
        num_prompt = len(item.prompt_ids)
        prompt = [0.0, *prompt_lps[i, prompt_lps.shape[1] - num_prompt + 1 :].tolist()]
    finish = rows.finish[i]
    return Generation(
        token_ids=rows.tokens[i],
        log_probs=rows.raw[i],
        processed_log_probs=rows.processed[i],
        finish_reason="stop" if finish == "stop" else "abort" if finish == "abort" else "length",
        stop_reason=rows.stop_reason[i],
        prompt_log_probs=prompt,
        versions=version_spans(rows.versions[i]),
        routed_experts=(
            routes.of(i, len(item.prompt_ids), len(rows.tokens[i]))
            if item.config.return_routed_experts
            else None
        ),
    )
