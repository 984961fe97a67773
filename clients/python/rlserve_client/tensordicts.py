"""TensorDict conversion in TorchRL's layout (needs the `[torch]` extra).

Keys: ("text"|"tokens"|"log_probs"|"history", "prompt"|"response"|"full"),
("log_probs", "response_processed") and ("masks", "all_attention_mask"|"all_assistant_mask"),
each where the samples carry it.

padded=True: one tensor per key. Prompts are left-padded and responses right-padded, so
`tokens.full` is `[pad.. prompt | response ..pad]` (right-padded when there is no split);
every per-position field of `full` shares that layout. Pads: token `pad_token_id`,
log-prob 0.0, mask False. padded=False: a lazy stack of one TensorDict per sample, each
with its own lengths. Text and history are non-tensor data either way."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

try:
    import torch
    from tensordict import LazyStackedTensorDict, NonTensorStack, TensorDict, TensorDictBase
    from tensordict import lazy_stack as _lazy_stack
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "TensorDict conversion needs torch and tensordict: pip install 'rlserve-client[torch]'"
    ) from error

from rlserve_client.records import Message, Sample, Step, Trajectory

_TOKEN_PARTS = ("prompt", "response", "full")
_LOG_PROB_PARTS = ("prompt", "response", "response_processed", "full")
_MASKS = ("all_attention_mask", "all_assistant_mask")
_ALL_KEYS = [
    *(("tokens", p) for p in _TOKEN_PARTS),
    *(("log_probs", p) for p in _LOG_PROB_PARTS),
    *(("masks", m) for m in _MASKS),
    *(("text", p) for p in _TOKEN_PARTS),
    *(("history", p) for p in _TOKEN_PARTS),
]


def _fields(sample: Sample) -> dict[tuple[str, str], list[Any]]:
    """Every per-position list of a sample, by TorchRL key."""
    out: dict[tuple[str, str], list[Any]] = {}
    for part in _TOKEN_PARTS:
        if (value := getattr(sample.tokens, part)) is not None:
            out["tokens", part] = value
    if sample.log_probs is not None:
        for part in _LOG_PROB_PARTS:
            if (value := getattr(sample.log_probs, part)) is not None:
                out["log_probs", part] = value
    for name in _MASKS:
        if (value := getattr(sample.masks, name)) is not None:
            out["masks", name] = value
    return out


def _dtype(key: tuple[str, str]) -> torch.dtype:
    return {"tokens": torch.long, "log_probs": torch.float32, "masks": torch.bool}[key[0]]


def _non_tensors(samples: Sequence[Sample]) -> dict[tuple[str, str], list[Any]]:
    out: dict[tuple[str, str], list[Any]] = {}
    for part in _TOKEN_PARTS:
        texts = [getattr(s.text, part) if s.text else None for s in samples]
        if all(t is not None for t in texts):
            out["text", part] = texts
        histories = [getattr(s.history, part) if s.history else None for s in samples]
        if all(h is not None for h in histories):
            out["history", part] = [[m.model_dump() for m in h or []] for h in histories]
    return out


def padded_row(values: Any, left: int, right: int, pad: Any, dtype: torch.dtype) -> torch.Tensor:
    """One row (a list or a tensor) with `left` and `right` pads."""
    row = torch.as_tensor(values, dtype=dtype)
    if not left and not right:
        return row
    out = torch.full((left + len(row) + right,), pad, dtype=dtype)
    out[left : left + len(row)] = row
    return out


def _place(key: tuple[str, str], value: Any, left: int, right: int, pad: Any) -> torch.Tensor:
    """One row in the padded layout: prompts pad on the left only, responses on the right."""
    if key[1] == "prompt":
        right = 0
    elif key[1] in ("response", "response_processed"):
        left = 0
    return padded_row(value, left, right, pad, _dtype(key))


def samples_to_tensordict(
    samples: Sequence[Sample], *, padded: bool = True, pad_token_id: int
) -> TensorDictBase:
    """Samples whose arrays are lists (JSON replies) or tensors (`tensors=True` replies)."""
    if not samples:
        raise ValueError("no samples to convert")
    rows = [_fields(s) for s in samples]
    keys = [k for k in rows[0] if all(k in r for r in rows)]
    texts = _non_tensors(samples)
    if not padded:
        return _lazy_stack(
            [
                _tensordict({k: torch.as_tensor(r[k], dtype=_dtype(k)) for k in keys}, texts, i, [])
                for i, r in enumerate(rows)
            ]
        )
    prompt_lens = [len(s.tokens.prompt if s.tokens.prompt is not None else ()) for s in samples]
    tail_lens = [  # what follows the prompt in the padded layout
        len(s.tokens.response if s.tokens.response is not None else ())
        if s.tokens.full is None
        else len(s.tokens.full) - p
        for s, p in zip(samples, prompt_lens, strict=True)
    ]
    max_prompt, max_tail = max(prompt_lens), max(tail_lens)
    columns: dict[tuple[str, str], torch.Tensor] = {}
    for key in keys:
        pad = pad_token_id if key[0] == "tokens" else 0
        columns[key] = torch.stack(
            [
                _place(key, r[key], max_prompt - p, max_tail - t, pad)
                for r, p, t in zip(rows, prompt_lens, tail_lens, strict=True)
            ]
        )
    return _tensordict(columns, texts, None, [len(samples)])


def _tensordict(
    columns: dict[tuple[str, str], torch.Tensor],
    non_tensors: dict[tuple[str, str], list[Any]],
    row: int | None,
    batch_size: list[int],
) -> TensorDict:
    td = TensorDict({}, batch_size=batch_size)
    for key, tensor in columns.items():
        td.set(key, tensor)
    for key, values in non_tensors.items():
        if row is None:
            td.set(key, NonTensorStack.from_list(values))
        else:
            td.set_non_tensor(key, values[row])
    return td


def samples_from_tensordict(td: TensorDictBase) -> list[Sample]:
    """The inverse of `samples_to_tensordict` (padding dropped using the attention mask)."""
    if isinstance(td, LazyStackedTensorDict):
        return [_sample(_row_lists(item, None)) for item in td.unbind(0)]
    if ("masks", "all_attention_mask") not in td.keys(True):
        raise KeyError("a padded TensorDict needs ('masks', 'all_attention_mask')")
    return [_sample(_row_lists(td[i], td)) for i in range(td.batch_size[0])]


def _row_lists(item: TensorDictBase, batch: TensorDictBase | None) -> dict[tuple[str, str], Any]:
    """One row's fields as plain lists, unpadded."""
    present = set(item.keys(True))
    keys = [k for k in _ALL_KEYS if k in present]
    out: dict[tuple[str, str], Any] = {}
    if batch is None:
        for key in keys:
            value = item.get(key)
            out[key] = (
                value.tolist() if isinstance(value, torch.Tensor) else item.get_non_tensor(key)
            )
        return out
    attention = item.get(("masks", "all_attention_mask")).tolist()
    max_prompt = batch.get(("tokens", "prompt")).shape[-1] if ("tokens", "prompt") in keys else 0
    num_prompt = sum(attention[:max_prompt])
    num_full = sum(attention)
    for key in keys:
        value = item.get(key)
        if not isinstance(value, torch.Tensor):
            out[key] = item.get_non_tensor(key)
        elif key[1] == "prompt":
            out[key] = value.tolist()[max_prompt - num_prompt :]
        elif key[1] in ("response", "response_processed"):
            out[key] = value.tolist()[: num_full - num_prompt]
        else:
            out[key] = [v for v, a in zip(value.tolist(), attention, strict=True) if a]
    return out


def _sample(fields: dict[tuple[str, str], Any]) -> Sample:
    groups: dict[str, dict[str, Any]] = {}
    for (group, part), value in fields.items():
        if group == "masks":
            value = [int(v) for v in value]
        if group == "history":
            value = [Message(**m) for m in value]
        groups.setdefault(group, {})[part] = value
    groups.setdefault("masks", {})
    return Sample.model_validate(groups)


def trajectories_to_tensordict(
    trajectories: Sequence[Trajectory], *, padded: bool = True, pad_token_id: int
) -> TensorDictBase:
    """Every step of every trajectory, batch `[num_steps]`, with the sample keys plus
    ("next", "reward"|"done"|"terminated"|"truncated") of shape [num_steps, 1] (TorchRL's
    layout), "policy_version", "trajectory" (its index) and, for GRPO groups, "advantage". A
    reward a judge did not give (None), and the advantage of its trajectory, are NaN: mask
    them with `reward.isnan()`."""
    steps: list[Step] = [step for t in trajectories for step in t.steps]
    td = samples_to_tensordict(steps, padded=padded, pad_token_id=pad_token_id)
    index = [i for i, t in enumerate(trajectories) for _ in t.steps]
    scalars: dict[Any, torch.Tensor] = {
        ("next", "reward"): torch.tensor([[_nan(s.reward)] for s in steps], dtype=torch.float32),
        ("next", "done"): torch.tensor([[s.done] for s in steps]),
        ("next", "terminated"): torch.tensor([[s.terminated] for s in steps]),
        ("next", "truncated"): torch.tensor([[s.truncated] for s in steps]),
        "policy_version": torch.tensor([s.policy_version for s in steps]),
        "trajectory": torch.tensor(index),
    }
    if any(s.advantage is not None for s in steps) or any(
        t.group is not None for t in trajectories
    ):
        advantages = [[_nan(s.advantage)] for s in steps]
        scalars["advantage"] = torch.tensor(advantages, dtype=torch.float32)
    for key, value in scalars.items():
        td.set(key, value)
    return td


def _nan(value: float | None) -> float:
    return math.nan if value is None else value
