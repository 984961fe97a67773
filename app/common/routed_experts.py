"""Routed experts on the wire: which served models record and replay them, and a request's
routing checked against the model's routers (`rlserve_client.moe` holds the layout)."""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from app.common.failures import Unsupported, invalid
from app.engine.base import Backend

if TYPE_CHECKING:
    from rlserve_client.moe import Routing


def routing_of(backend: Backend, model: str, param: str) -> Routing:
    """The served model's MoE routers; Unsupported naming `param` when it has none to record
    or replay."""
    if backend.routing is not None:
        return backend.routing
    from rlserve_client.moe import SUPPORTED

    if backend.info.backend != "transformers":
        why = (
            f"the {backend.info.backend} backend does not record or replay routing (vLLM 0.32 "
            "records it only in its V2 model runner, which its CPU build cannot run, and takes "
            "none to replay): serve the model with the transformers backend"
        )
    else:
        why = (
            f"{model} is not a mixture-of-experts model with routers rlserve records and "
            f"replays ({', '.join(SUPPORTED)})"
        )
    raise Unsupported(f"{param}: {why}", param=param)


def replay_rows(
    routing: Routing,
    given: Sequence[Sequence[Any] | None],
    lengths: Sequence[int],
    param: str,
) -> list[torch.Tensor | None]:
    """Per sequence (of `lengths` tokens), the routing to replay: `T - 1` rows (what
    generation returns) or `T`, each [num_layers][top_k] ids within the model's experts;
    InvalidInput naming `param[i]` otherwise."""
    if len(given) != len(lengths):
        raise invalid(param, f"{len(given)} entries for {len(lengths)} inputs")
    rows: list[torch.Tensor | None] = []
    for i, (experts, length) in enumerate(zip(given, lengths, strict=True)):
        name = f"{param}[{i}]"
        if experts is None:
            rows.append(None)
            continue
        if len(experts) not in (length - 1, length):
            raise invalid(
                name,
                f"{len(experts)} tokens' routing for a sequence of {length} tokens (give "
                f"{length - 1}: every token but the last, as generation returns them)",
            )
        try:
            tensor = torch.tensor(experts, dtype=torch.long)
        except (ValueError, TypeError):
            raise invalid(
                name, f"every token needs {routing.num_layers} lists of {routing.top_k} ids"
            ) from None
        if tensor.numel() == 0:
            tensor = tensor.reshape(0, routing.num_layers, routing.top_k)
        try:
            routing.check(tensor, name)
        except ValueError as error:
            raise invalid(name, str(error).removeprefix(f"{name}: ")) from None
        rows.append(tensor)
    return rows


def check_prompt_start(start: int, prompt_lengths: Sequence[int], param: str) -> None:
    """vLLM's and SGLang's start of the returned routing: within every prompt."""
    shortest = min(prompt_lengths, default=0)
    if start > shortest:
        raise invalid(param, f"is past the prompt's {shortest} tokens")


def npy_base64(experts: torch.Tensor, routing: Routing) -> str:
    """Routed experts as vLLM encodes them: a .npy file (its header holds dtype and shape),
    base64; uint8 ids for models of up to 256 experts, uint16 past them."""
    values = experts.numpy().astype(np.uint8 if routing.num_experts <= 256 else np.uint16)
    buffer = io.BytesIO()
    np.save(buffer, values, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def from_npy_base64(encoded: str) -> np.ndarray:
    """`npy_base64`'s array back."""
    return np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)


def int32_base64(experts: torch.Tensor) -> str:
    """Routed experts as SGLang encodes them: base64 of the int32 array's bytes (little-endian,
    no shape)."""
    return base64.b64encode(experts.numpy().astype("<i4").tobytes()).decode("ascii")
