"""Tensors on the wire: a request or response body as one safetensors file, so token ids,
log-probs, top-k tables and masks travel as raw little-endian arrays instead of JSON numbers.

Why safetensors: a maintained format with readers in Python, Rust and JavaScript, a bounded
JSON header (no pickle, nothing executable) and zero-copy views; numpy and torch both load it.

The format (media type MEDIA_TYPE):
- The file's metadata entry "rlserve" is the body as JSON with every numeric array taken out.
  In its place stands `{"$tensor": name, "row": i}`: row i of the column `name`, optionally
  narrowed to `[start:stop]`.
- A column is two tensors: `name`, its rows concatenated along dim 0, and `name.offsets`
  (int64, one more than the rows): row i is `name[offsets[i]:offsets[i+1]]`. A row is 1-D
  (per token) or 2-D (per token, k values: top-k tables, candidate ids).
- Integers take the narrowest of uint8, int16, int32 and int64 that holds the column; floats
  are float32 (what the server computes in). A JSON null is NaN in a float column and -1 in an
  integer one; a removed token's log-prob (null in JSON) is -inf where the server scores
  straight into tensors.
- In a group holding `full`, `prompt` and `response` (tokens, log-probs), prompt and
  response are slices of full's row, not sent twice."""

from __future__ import annotations

import json
import math
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from app.common.failures import Malformed

MEDIA_TYPE = "application/x-safetensors"
METADATA_KEY = "rlserve"
_SPLIT_PARTS = ("prompt", "response")


def wants_binary(accept: str | None) -> bool:
    """Whether an Accept header asks for MEDIA_TYPE (JSON stays the default)."""
    if not accept:
        return False
    return any(part.split(";")[0].strip().lower() == MEDIA_TYPE for part in accept.split(","))


# -- encoding -----------------------------------------------------------------------------


def encode(body: dict[str, Any]) -> bytes:
    """A body (plain values, lists and tensors) as MEDIA_TYPE bytes."""
    columns: dict[str, list[torch.Tensor]] = {}
    skeleton = _take(body, "", columns)
    tensors: dict[str, torch.Tensor] = {}
    for name, rows in columns.items():
        values = torch.cat(rows) if len(rows) > 1 else rows[0]
        offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor([len(r) for r in rows]).cumsum(0)
        tensors[name] = _narrow(values).contiguous()
        tensors[name + ".offsets"] = offsets
    header = json.dumps(skeleton, separators=(",", ":"), allow_nan=False)
    return save(tensors, metadata={METADATA_KEY: header})


def _take(node: Any, path: str, columns: dict[str, list[torch.Tensor]]) -> Any:
    """`node` with its arrays moved into `columns` (placeholders left behind)."""
    if isinstance(node, torch.Tensor):
        return _add(columns, path, node)
    if isinstance(node, dict):
        return _take_dict(node, path, columns)
    if isinstance(node, list | tuple):
        rows = _as_rows(node)
        if rows is not None:
            return _add(columns, path, rows)
        return [_take(item, path, columns) for item in node]
    return node


def _take_dict(node: dict[str, Any], path: str, columns: dict[str, list[torch.Tensor]]) -> Any:
    out: dict[str, Any] = {}
    full = node.get("full")
    if full is not None and all(node.get(p) is not None for p in _SPLIT_PARTS):
        placeholder = _take(full, _join(path, "full"), columns)
        if isinstance(placeholder, dict) and _is_split_of(full, node["prompt"], node["response"]):
            cut = len(node["prompt"])
            out["prompt"] = {**placeholder, "stop": cut}
            out["response"] = {**placeholder, "start": cut}
        out["full"] = placeholder
    for key, value in node.items():
        if key not in out:
            out[key] = _take(value, _join(path, key), columns)
    return out


def _is_split_of(full: Any, prompt: Any, response: Any) -> bool:
    cut = len(prompt)
    if len(full) != cut + len(response):
        return False
    if isinstance(full, torch.Tensor):
        return bool(
            torch.equal(full[:cut], torch.as_tensor(prompt, dtype=full.dtype))
            and torch.equal(full[cut:], torch.as_tensor(response, dtype=full.dtype))
        )
    return list(full[:cut]) == list(prompt) and list(full[cut:]) == list(response)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _add(columns: dict[str, list[torch.Tensor]], name: str, row: torch.Tensor) -> dict[str, Any]:
    rows = columns.setdefault(name, [])
    if rows and (rows[0].shape[1:], rows[0].is_floating_point()) != (
        row.shape[1:],
        row.is_floating_point(),
    ):  # a column keeps one row shape and kind: anything else is a column of its own
        kind = "f" if row.is_floating_point() else "i"
        return _add(columns, f"{name}~{row.dim()}{kind}", row)
    rows.append(row.detach().cpu())
    return {"$tensor": name, "row": len(rows) - 1}


def _as_rows(values: list[Any] | tuple[Any, ...]) -> torch.Tensor | None:
    """A numeric list (1-D), or a list of equal-length numeric lists (2-D), as a tensor;
    None for anything else. Nulls become NaN (floats) or -1 (integers)."""
    first = next((v for v in values if v is not None), None)
    if first is None:
        return torch.zeros(0, dtype=torch.int64) if not values else None
    if _is_number(first):
        return _tensor(values, None)
    if isinstance(first, list | tuple) and _is_number(next((v for v in first if v is not None), 0)):
        width = len(first)
        if all(v is None or len(v) == width for v in values):
            return _tensor(values, width)
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _tensor(values: Any, width: int | None) -> torch.Tensor:
    floating = _has_float(values, width)
    fill: float = math.nan if floating else -1
    dtype = torch.float32 if floating else torch.int64
    if width is None:
        if None in values:
            values = [fill if v is None else v for v in values]
        return torch.tensor(values, dtype=dtype)
    rows = [_filled(row, width, fill) for row in values]
    return torch.tensor(rows, dtype=dtype).reshape(len(values), width)


def _filled(row: Any, width: int, fill: float) -> Any:
    if row is None:
        return [fill] * width
    return [fill if v is None else v for v in row] if None in row else row


def _has_float(values: Any, width: int | None) -> bool:
    rows = values if width is not None else [values]
    return any(isinstance(v, float) for row in rows if row is not None for v in row)


def _narrow(values: torch.Tensor) -> torch.Tensor:
    """Floats as float32; integers in the narrowest type that holds them."""
    if values.is_floating_point():
        return values.to(torch.float32)
    if values.dtype == torch.bool or values.numel() == 0:
        return values
    low, high = int(values.min()), int(values.max())
    for dtype in (torch.uint8, torch.int16, torch.int32):
        info = torch.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return values.to(dtype)
    return values.to(torch.int64)


# -- decoding (request bodies) ------------------------------------------------------------


def decode(data: bytes) -> Any:
    """A MEDIA_TYPE body as plain JSON values (what the same body sent as JSON would parse
    to); 400 naming `body` when it is not one."""
    try:
        tensors = load(data)
        with_metadata = _metadata(data)
        skeleton = json.loads(with_metadata[METADATA_KEY])
    except (SafetensorError, ValueError, KeyError, TypeError) as error:
        raise Malformed(
            f"not a {MEDIA_TYPE} body with an '{METADATA_KEY}' metadata entry: {error}",
            param="body",
        ) from error
    return _resolve(skeleton, tensors)


def _metadata(data: bytes) -> dict[str, str]:
    size = int.from_bytes(data[:8], "little")
    if size <= 0 or size > len(data) - 8:
        raise ValueError("bad header length")
    metadata = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise ValueError("metadata is not an object")
    return metadata


def _resolve(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(node, dict):
        if "$tensor" in node:
            return _row(node, tensors).tolist()
        return {key: _resolve(value, tensors) for key, value in node.items()}
    if isinstance(node, list):
        return [_resolve(item, tensors) for item in node]
    return node


def _row(placeholder: dict[str, Any], tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    name, row = placeholder.get("$tensor"), placeholder.get("row")
    values, offsets = tensors.get(f"{name}"), tensors.get(f"{name}.offsets")
    begin, end = placeholder.get("start"), placeholder.get("stop")
    if (
        values is None
        or offsets is None
        or not isinstance(row, int)
        or not 0 <= row < len(offsets) - 1
        or not all(b is None or isinstance(b, int) for b in (begin, end))
    ):
        raise Malformed(f"the body refers to row {row} of a column {name!r} it lacks", param="body")
    start, stop = int(offsets[row]), int(offsets[row + 1])
    if not 0 <= start <= stop <= len(values):
        raise Malformed(f"column {name!r} has offsets outside its values", param="body")
    part = values[start:stop]
    if begin is not None or end is not None:
        part = part[begin:end]
    if part.dtype == torch.uint8 or part.dtype == torch.int16 or part.dtype == torch.int32:
        part = part.to(torch.int64)
    return part
