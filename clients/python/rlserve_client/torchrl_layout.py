"""TorchRL's LLM containers (`Text`, `Tokens`, `Masks`, `LogProbs`, `ChatHistory` of `History`)
as `RemotePolicy` reads and writes them: a request's rows read from a TensorDict, and a sample
laid out in a row, padded or as it is. Where torchrl is not importable, plain TensorDicts hold
the same keys."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

try:
    from torchrl.data.llm import History as _History
    from torchrl.modules.llm.policies import ChatHistory as _ChatHistory
    from torchrl.modules.llm.policies import LLMWrapperBase as WrapperBase
    from torchrl.modules.llm.policies import LogProbs as _LogProbs
    from torchrl.modules.llm.policies import Masks as _Masks
    from torchrl.modules.llm.policies import Text as _Text
    from torchrl.modules.llm.policies import Tokens as _Tokens

    HAS_TORCHRL = True
except ImportError:  # plain TensorDicts in TorchRL's key layout
    HAS_TORCHRL = False

    class WrapperBase:  # type: ignore[no-redef]
        def __call__(self, tensordict: TensorDictBase, **kwargs: Any) -> TensorDictBase:
            return self.forward(tensordict, **kwargs)  # type: ignore[attr-defined,no-any-return]


from rlserve_client.tensordicts import padded_row
from rlserve_client.types import Sample

Chat = list[dict[str, str]]
__all__ = [
    "HAS_TORCHRL",
    "Chat",
    "RowLayout",
    "WrapperBase",
    "chat",
    "chat_history",
    "container",
    "generated_full_log_probs",
    "given",
    "pad_token",
    "read_rows",
    "row_widths",
    "token_versions",
    "unpadded_tokens",
]


def generated_full_log_probs(prompt: Any, response: Any, prompt_len: int) -> torch.Tensor:
    """A generation's `log_probs.full` as TorchRL's wrappers write it: the prompt's scores
    when they were asked for, else NaN over the prompt (not 0.0, a real log-prob: GRPOLoss
    and the KL transforms skip non-finite positions), then the response's."""
    response = torch.as_tensor(response, dtype=torch.float32)
    if prompt is not None:
        head = torch.as_tensor(prompt, dtype=torch.float32)
    else:
        head = torch.full((prompt_len,), float("nan"))
    return torch.cat([head, response])


def token_versions(sample: Sample, length: int) -> list[int]:
    """The policy version that sampled each response token (-1 where the server did not say,
    an old server)."""
    versions = sample.token_versions()
    return versions if versions is not None else [-1] * length


def given(values: Any) -> Any:
    """A list or tensor of values; an empty list for None."""
    return [] if values is None else values


class RowLayout:
    """Where one row's values (a list or a tensor) sit in the padded layout (or as they are,
    unpadded)."""

    def __init__(
        self, widths: tuple[int, int] | None, prompt_len: int | None, full_len: int, gen: bool
    ) -> None:
        self.widths = widths
        self.prompt_len = prompt_len or 0
        self.full_len = full_len
        self.generated = gen

    def prompt(self, values: Any, pad: Any, dtype: torch.dtype) -> torch.Tensor:
        left = self.widths[0] - len(values) if self.widths else 0
        return padded_row(values, left, 0, pad, dtype)

    def response(self, values: Any, pad: Any, dtype: torch.dtype) -> torch.Tensor:
        right = self.widths[1] - len(values) if self.widths else 0
        return padded_row(values, 0, right, pad, dtype)

    def full(self, values: Any, pad: Any, dtype: torch.dtype) -> torch.Tensor:
        if self.widths is None:
            return padded_row(values, 0, 0, pad, dtype)
        if not self.generated:  # scored sequences: left padding
            return padded_row(values, self.widths[1] - len(values), 0, pad, dtype)
        left = self.widths[0] - self.prompt_len
        right = self.widths[1] - (self.full_len - self.prompt_len)
        return padded_row(values, left, right, pad, dtype)


def row_widths(samples: Sequence[Sample], *, generated: bool) -> tuple[int, int]:
    """(longest prompt, longest response) for generations; (0, longest sequence) for scores."""
    if not generated:
        return 0, max(len(given(s.tokens.full)) for s in samples)
    return (
        max(len(given(s.tokens.prompt)) for s in samples),
        max(len(given(s.tokens.response)) for s in samples),
    )


def container(kind: str, fields: dict[str, Any], padded: bool | None) -> Any:
    """A TorchRL container when torchrl is importable, else a TensorDict with the same keys."""
    if HAS_TORCHRL:
        cls = {
            "Tokens": _Tokens,
            "Masks": _Masks,
            "LogProbs": _LogProbs,
            "Text": _Text,
        }[kind]
        extra = {} if padded is None else {"padded": padded}
        return cls(**fields, **extra, batch_size=[])
    return TensorDict(fields, batch_size=[])


def chat_history(sample: Sample) -> Any:
    history = sample.history
    assert history is not None
    prompt = [m.model_dump() for m in history.prompt or []]
    response = [m.model_dump() for m in history.response or []]
    # A reply is complete when it ended on the end-of-sequence token (not a length cap or a
    # stop string), as TorchRL's History.is_complete says.
    complete = sample.finish_reason != "length" and sample.stop_reason is None
    response = [{**m, "is_complete": complete} for m in response]
    parts = {"prompt": prompt, "response": response, "full": prompt + response}
    if not HAS_TORCHRL:
        plain = TensorDict({}, batch_size=[])
        for name, messages in parts.items():
            plain.set_non_tensor(name, messages)
        return plain
    built = {k: _History.from_chats(v) for k, v in parts.items() if v}
    return _ChatHistory(**built, batch_size=[])


def pad_token(served: int | None) -> int:
    if served is None:
        raise ValueError("the server did not report pad_token_id (upgrade the server)")
    return served


def read_rows(td: TensorDictBase, key: Any, mode: str, attention_mask_key: str) -> list[Any]:
    """Per-row request inputs: message lists, strings or unpadded token-id lists."""
    rows = td.unbind(0)
    if mode == "tokens":
        return [unpadded_tokens(row, key, attention_mask_key) for row in rows]
    values = [row.get(key) if mode == "history" else row.get_non_tensor(key) for row in rows]
    if mode == "text":
        return [str(v) for v in values]
    return [chat(v) for v in values]


def unpadded_tokens(row: TensorDictBase, key: Any, attention_mask_key: str) -> torch.Tensor:
    """A row's token ids without padding, as a tensor (the request then travels as binary)."""
    tokens = row.get(key)
    for mask_key in (("masks", "all_attention_mask"), attention_mask_key):
        mask = row.get(mask_key, None)
        if isinstance(mask, torch.Tensor) and mask.shape == tokens.shape:
            masked: torch.Tensor = tokens[mask.bool()]
            return masked
    return torch.as_tensor(tokens)


def chat(value: Any) -> Chat:
    """A conversation from a TorchRL History (or a list of messages)."""
    if hasattr(value, "unbind") and hasattr(value, "role"):
        return [
            {"role": str(m.role), "content": str(m.content)}
            for m in (value.unbind(0) if value.ndim else [value])
        ]
    if hasattr(value, "tolist"):
        value = value.tolist()
    return [
        {"role": m["role"], "content": m["content"]}
        if isinstance(m, dict)
        else {"role": m.role, "content": m.content}
        for m in value
    ]
