"""Keys and values of recent sequences, kept so that a prompt that continues one (an agent's
next turn, a chat's next message, a GRPO group sent as separate requests) prefills only its
new tokens.

An entry is a row's token ids and, per layer, their keys and values on the model's device,
labelled with the weight version and the LoRA adapter (name and version) that computed them.
A prompt reuses the longest common prefix with any entry of its version and adapter (at least
one token of the prompt is always prefilled: its logits start the decode). Entries are evicted
least-recently-used to stay within `max_bytes`; a longer entry replaces the entries that are
prefixes of it. At a weight change the entries are dropped, or relabelled with the new version
when the change asks to keep caches (a snapshot's cache policy 'keep'). Blocking, called on
the model thread; the counters are read from any thread."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from app.engine.transformers.compiled import cache_argument
from app.engine.transformers.lora import LoraHooks
from app.engine.transformers.rows import adapted, distinct_prompts, positions, returned_cache
from app.engine.types import GenerateItem, PrefixCacheStats
from app.weights.lora import LoraAdapter

logger = logging.getLogger(__name__)

KeysValues = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer: keys and values of one row, each [heads, tokens, head_dim]."""

AdapterKey = tuple[str, int] | None


def adapter_key(adapter: LoraAdapter | None) -> AdapterKey:
    return None if adapter is None else (adapter.name, adapter.version)


@dataclass
class Entry:
    tokens: torch.Tensor  # int64 [n], on the host
    kv: KeysValues
    version: int
    adapter: AdapterKey
    nbytes: int


@dataclass(frozen=True)
class Hit:
    entry: Entry
    length: int
    """Leading tokens of the prompt whose keys and values the entry holds."""


def common_length(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.shape[0], b.shape[0])
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0, 0]) if differ.numel() else n


class PrefixCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, Entry] = OrderedDict()
        self._next = 0
        self._bytes = 0
        self._lock = threading.Lock()
        self.queried_tokens = 0
        self.hit_tokens = 0

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            held = len(self._entries), self._bytes
            return PrefixCacheStats(self.queried_tokens, self.hit_tokens, *held, self.max_bytes)

    def lookup(self, prompt: Sequence[int], version: int, adapter: AdapterKey) -> Hit | None:
        """The entry sharing the longest prefix with `prompt` (of `version` and `adapter`),
        made the most recently used; counted in the hit rate."""
        tokens = torch.tensor(prompt, dtype=torch.long)
        best: tuple[int, int] | None = None
        with self._lock:
            self.queried_tokens += len(prompt)
            for key, entry in list(self._entries.items()):
                if entry.version != version:
                    if entry.version < version:  # (stored as a weight change dropped the rest)
                        self._drop(key)
                    continue
                if entry.adapter != adapter:
                    continue
                length = min(common_length(entry.tokens, tokens), len(prompt) - 1)
                if length > 0 and (best is None or length > best[1]):
                    best = key, length
            if best is None:
                return None
            key, length = best
            self._entries.move_to_end(key)
            self.hit_tokens += length
            return Hit(self._entries[key], length)

    def store(
        self, tokens: Sequence[int], kv: KeysValues, version: int, adapter: AdapterKey
    ) -> None:
        """Keep `kv`, the keys and values of `tokens`: the entries it extends go, and the least
        recently used ones while the cache is over its bound. Nothing is kept when `tokens`
        are a prefix of an entry already held (that entry is made the most recent)."""
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv)
        if nbytes > self.max_bytes or not tokens:
            return
        ids = torch.tensor(tokens, dtype=torch.long)
        with self._lock:
            for key, entry in list(self._entries.items()):
                if entry.version != version or entry.adapter != adapter:
                    continue
                common = common_length(entry.tokens, ids)
                if common == len(tokens):  # held already
                    self._entries.move_to_end(key)
                    return
                if common == entry.tokens.shape[0]:  # extended by this one
                    self._drop(key)
            while self._entries and self._bytes + nbytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
            self._entries[self._next] = Entry(ids, kv, version, adapter, nbytes)
            self._next += 1
            self._bytes += nbytes

    def unusable(self, why: str) -> None:
        """This model's cache is not one of plain keys and values (sliding windows, linear
        attention): nothing is kept."""
        if self.max_bytes:
            logger.warning("prefix cache off: the model's key/value cache is a %s", why)
        self.max_bytes = 0

    def weights_changed(self, version: int, *, keep: bool) -> None:
        """Drop every entry, or with `keep` serve them on under `version` (their keys and
        values are then the old weights': a snapshot's cache policy 'keep')."""
        with self._lock:
            if not keep:
                self._entries.clear()
                self._bytes = 0
                return
            for entry in self._entries.values():
                entry.version = version

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.nbytes


@dataclass
class Prefilled:
    """Distinct prompts laid out over their cached prefixes: `ids` and `mask` [rows, P + S],
    each row's cached tokens right-aligned in the first P columns and its other tokens in the
    last S (padding between them is masked out); `past` holds the cached keys and values of
    the first P columns (None when no row of the group hits)."""

    ids: torch.Tensor
    mask: torch.Tensor
    past: DynamicCache | None
    cached: int  # P


PADDING_WASTE = 1.25
"""A prefill group's padded new tokens (rows x the longest) stay within this factor of its
rows' own: a row with a long history cached is not padded to a row that hits nothing."""


def prefill_groups(prompts: Sequence[Sequence[int]], hits: Sequence[Hit | None]) -> list[list[int]]:
    """The rows, by how many tokens each still prefills, in groups of similar counts (each
    group one forward)."""
    rest = [len(p) - (0 if h is None else h.length) for p, h in zip(prompts, hits, strict=True)]
    order = sorted(range(len(prompts)), key=lambda row: -rest[row])
    groups: list[list[int]] = []
    for row in order:
        group = groups[-1] if groups else None
        if group is not None:
            longest, total = rest[group[0]], sum(rest[r] for r in group) + rest[row]
            if longest * (len(group) + 1) <= PADDING_WASTE * total:
                group.append(row)
                continue
        groups.append([row])
    return groups


def lay_out(
    prompts: Sequence[Sequence[int]], hits: Sequence[Hit | None], pad_id: int, device: torch.device
) -> Prefilled:
    lengths = [0 if hit is None else hit.length for hit in hits]
    cached = max(lengths)
    width = cached + max(len(p) - h for p, h in zip(prompts, lengths, strict=True))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, (prompt, length) in enumerate(zip(prompts, lengths, strict=True)):
        rest = len(prompt) - length
        ids[row, cached - length : cached] = torch.tensor(prompt[:length], dtype=torch.long)
        ids[row, width - rest :] = torch.tensor(prompt[length:], dtype=torch.long)
        mask[row, cached - length : cached] = 1
        mask[row, width - rest :] = 1
    if not cached:
        return Prefilled(ids.to(device), mask.to(device), None, 0)
    reference = next(hit for hit in hits if hit is not None).entry.kv
    layers = []
    for layer, (keys0, values0) in enumerate(reference):
        heads, _, dim = keys0.shape
        keys = keys0.new_zeros((len(prompts), heads, cached, dim))
        values = values0.new_zeros((len(prompts), values0.shape[0], cached, values0.shape[2]))
        for row, (hit, length) in enumerate(zip(hits, lengths, strict=True)):
            if hit is not None:
                k, v = hit.entry.kv[layer]
                keys[row, :, cached - length :] = k[:, :length]
                values[row, :, cached - length :] = v[:, :length]
        layers.append((keys, values))
    return Prefilled(ids.to(device), mask.to(device), DynamicCache(ddp_cache_data=layers), cached)


@dataclass
class Part:
    """One prefill group's result: its rows (indices), their ids, mask, cache and logits."""

    rows: list[int]
    ids: torch.Tensor
    mask: torch.Tensor
    cache: Any
    logits: torch.Tensor


def merged(
    parts: Sequence[Part], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, Any, torch.Tensor]:
    """The groups' rows as one batch, in row order: each group left-padded to the widest
    (padding ids, masked out, zero keys and values)."""
    if len(parts) == 1 and parts[0].rows == sorted(parts[0].rows):
        part = parts[0]
        return part.ids, part.mask, part.cache, part.logits
    width = max(part.ids.shape[1] for part in parts)

    def padded(tensor: torch.Tensor, dim: int, value: float) -> torch.Tensor:
        missing = width - tensor.shape[dim]
        if not missing:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = missing
        return torch.cat([tensor.new_full(shape, value), tensor], dim=dim)

    rows = [row for part in parts for row in part.rows]
    back = torch.empty(len(rows), dtype=torch.long)
    back[torch.tensor(rows)] = torch.arange(len(rows))
    back = back.to(parts[0].ids.device)
    ids = torch.cat([padded(part.ids, 1, pad_id) for part in parts]).index_select(0, back)
    mask = torch.cat([padded(part.mask, 1, 0) for part in parts]).index_select(0, back)
    logits = torch.cat([part.logits for part in parts]).index_select(0, back)
    layers = []
    for index in range(len(parts[0].cache.layers)):
        keys = [padded(part.cache.layers[index].keys, 2, 0.0) for part in parts]
        values = [padded(part.cache.layers[index].values, 2, 0.0) for part in parts]
        layers.append(
            (torch.cat(keys).index_select(0, back), torch.cat(values).index_select(0, back))
        )
    return ids, mask, DynamicCache(ddp_cache_data=layers), logits


def remember(
    prefix: PrefixCache,
    cache: object,
    mask: torch.Tensor,
    items: Sequence[GenerateItem],
    tokens: Sequence[Sequence[int]],
    version: int,
) -> None:
    """Keep each row's keys and values after a decode: its prompt and every sampled token but
    the last (which no forward has taken yet), from the columns `mask` marks as the row's."""
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        prefix.unusable(type(cache).__name__)
        return
    kept: set[tuple[tuple[int, ...], AdapterKey]] = set()
    for row, item in enumerate(items):
        if not item.reuse_prefix:
            continue
        sequence = (*item.prompt_ids, *tokens[row][:-1])
        key = (sequence, adapter_key(item.adapter))
        if key in kept:
            continue
        kept.add(key)
        columns = mask[row].nonzero().squeeze(1)[: len(sequence)]
        kv = [
            (layer.keys[row].index_select(1, columns), layer.values[row].index_select(1, columns))
            for layer in layers
        ]
        prefix.store(sequence, kv, version, key[1])


def cached_prefill(
    model: Any,
    items: Sequence[GenerateItem],
    pad_id: int,
    version: int,
    lora: LoraHooks | None,
    prefix: PrefixCache,
) -> tuple[torch.Tensor, torch.Tensor, Any, torch.Tensor] | None:
    """Where a distinct prompt continues a cached sequence, the forward of its other tokens
    alone over the cached keys and values (`prefix_cache.lay_out`), rows grouped by how many
    tokens they still prefill (`prefill_groups`: one forward each, merged after): the ids and
    mask of the whole rows, the cache and the last position's logits. None when no prompt
    hits."""
    firsts, expand = distinct_prompts(items, model.device)
    prompts = [items[i].prompt_ids for i in firsts]
    adapters = [items[i].adapter for i in firsts]
    hits = [
        prefix.lookup(prompt, version, adapter_key(adapter))
        for prompt, adapter in zip(prompts, adapters, strict=True)
    ]
    if all(hit is None for hit in hits):
        return None
    parts = []
    for rows in prefill_groups(prompts, hits):
        laid = lay_out([prompts[r] for r in rows], [hits[r] for r in rows], pad_id, model.device)
        past = {} if laid.past is None else {cache_argument(model): laid.past}
        with adapted(lora, [adapters[r] for r in rows]):
            out = model(
                input_ids=laid.ids[:, laid.cached :],
                attention_mask=laid.mask,
                position_ids=positions(laid.mask)[:, laid.cached :],
                **past,
                use_cache=True,
                logits_to_keep=1,
            )
        parts.append(Part(rows, laid.ids, laid.mask, returned_cache(out), out.logits))
    ids, mask, cache, logits = merged(parts, pad_id)
    if expand is not None:
        cache.reorder_cache(expand)
        logits = logits.index_select(0, expand)
        ids, mask = ids.index_select(0, expand), mask.index_select(0, expand)
    return ids, mask, cache, logits
