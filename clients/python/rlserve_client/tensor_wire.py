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
  (per token), 2-D (per token, k values: top-k tables, candidate ids) or 3-D integers (per
  token, a table: routed experts).
- Integers take the narrowest of uint8, int16, int32 and int64 that holds the column; floats
  are float32 (what the server computes in). A JSON null is NaN in a float column and -1 in an
  integer one; a removed token's log-prob (null in JSON) is -inf where the server scores
  straight into tensors.
- In a group holding `full`, `prompt` and `response` (tokens, log-probs), prompt and
  response are slices of full's row, not sent twice."""

# The one implementation of the format: the client and the server both import it (it needs the
# client's `[torch]` extra; the server has torch anyway).
from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel

try:
    import numpy as np
    import torch
    from safetensors import SafetensorError
    from safetensors.numpy import load as load_arrays
    from safetensors.numpy import save
    from safetensors.torch import load
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "binary bodies need torch and safetensors: pip install 'rlserve-client[torch]'"
    ) from error

MEDIA_TYPE = "application/x-safetensors"
METADATA_KEY = "rlserve"
_SPLIT_PARTS = ("prompt", "response")
M = TypeVar("M", bound=BaseModel)


class WireFormatError(ValueError):
    """Bytes that are not a MEDIA_TYPE body."""


def wants_binary(accept: str | None) -> bool:
    """Whether an Accept header asks for MEDIA_TYPE (JSON stays the default)."""
    if not accept:
        return False
    return any(part.split(";")[0].strip().lower() == MEDIA_TYPE for part in accept.split(","))


# -- encoding -----------------------------------------------------------------------------


def encode(body: dict[str, Any]) -> bytes:
    """A body (plain values, lists, and torch or numpy arrays) as MEDIA_TYPE bytes. A 2-D
    array is one row of equal-length sequences (e.g. `tokens`), a list of 1-D arrays one row
    each; numeric lists become columns too."""
    # Columns are built in numpy: per call, small arrays cost a fraction of torch's dispatch.
    columns: dict[str, list[np.ndarray]] = {}
    skeleton = _take(body, "", columns)
    arrays: dict[str, np.ndarray] = {}
    for name, rows in columns.items():
        values = np.concatenate(rows) if len(rows) > 1 else rows[0]
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([len(r) for r in rows], out=offsets[1:])
        arrays[name] = np.ascontiguousarray(_narrow(values))
        arrays[name + ".offsets"] = offsets
    header = json.dumps(skeleton, separators=(",", ":"), allow_nan=False)
    return save(arrays, metadata={METADATA_KEY: header})


def _take(node: Any, path: str, columns: dict[str, list[np.ndarray]]) -> Any:
    """`node` with its arrays moved into `columns` (placeholders left behind)."""
    if isinstance(node, torch.Tensor):
        return _add(columns, path, _from_torch(node))
    if isinstance(node, np.ndarray):
        return _add(columns, path, node)
    if hasattr(node, "__dlpack__"):  # other array libraries, on any device torch reads
        return _add(columns, path, _from_torch(torch.as_tensor(node)))
    if isinstance(node, dict):
        return _take_dict(node, path, columns)
    if isinstance(node, list | tuple):
        rows = _as_rows(node)
        if rows is not None:
            return _add(columns, path, rows)
        return [_take(item, path, columns) for item in node]
    return node


def _from_torch(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu()
    if tensor.is_floating_point() and tensor.dtype not in (torch.float32, torch.float64):
        tensor = tensor.float()  # half and bfloat16: numpy has no bfloat16; floats go as float32
    return tensor.numpy()


def _take_dict(node: dict[str, Any], path: str, columns: dict[str, list[np.ndarray]]) -> Any:
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


def _add(columns: dict[str, list[np.ndarray]], name: str, row: np.ndarray) -> dict[str, Any]:
    rows = columns.setdefault(name, [])
    floating = row.dtype.kind == "f"
    if rows and (rows[0].shape[1:], rows[0].dtype.kind == "f") != (row.shape[1:], floating):
        # a column keeps one row shape and kind: anything else is a column of its own
        kind = "f" if floating else "i"
        return _add(columns, f"{name}~{row.ndim}{kind}", row)
    rows.append(row)
    return {"$tensor": name, "row": len(rows) - 1}


def _as_rows(values: list[Any] | tuple[Any, ...]) -> np.ndarray | None:
    """A numeric list (1-D), or a list of equal-length numeric lists (2-D), as an array;
    None for anything else. Nulls become NaN (floats) or -1 (integers)."""
    first = next((v for v in values if v is not None), None)
    if first is None:
        return np.zeros(0, dtype=np.int64) if not values else None
    if _is_number(first):
        return _array(values, None)
    if isinstance(first, list | tuple) and _is_number(next((v for v in first if v is not None), 0)):
        width = len(first)
        if all(v is None or len(v) == width for v in values):
            return _array(values, width)
    if isinstance(first, list | tuple) and first and isinstance(first[0], list | tuple):
        return _cube(values)
    return None


def _cube(values: list[Any] | tuple[Any, ...]) -> np.ndarray | None:
    """A list of equal-shaped integer tables (routed experts: per token, layers x top-k) as one
    3-D array; None for anything else."""
    try:
        array = np.array(values)
    except ValueError:  # ragged
        return None
    return array if array.ndim == 3 and array.dtype.kind in "iu" else None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _array(values: Any, width: int | None) -> np.ndarray:
    floating = _has_float(values, width)
    fill: float = math.nan if floating else -1
    dtype = np.float32 if floating else np.int64
    if width is None:
        if None in values:
            values = [fill if v is None else v for v in values]
        return np.array(values, dtype=dtype)
    rows = [_filled(row, width, fill) for row in values]
    return np.array(rows, dtype=dtype).reshape(len(values), width)


def _filled(row: Any, width: int, fill: float) -> Any:
    if row is None:
        return [fill] * width
    return [fill if v is None else v for v in row] if None in row else row


def _has_float(values: Any, width: int | None) -> bool:
    rows = values if width is not None else [values]
    return any(isinstance(v, float) for row in rows if row is not None for v in row)


def _narrow(values: np.ndarray) -> np.ndarray:
    """Floats as float32; integers in the narrowest type that holds them."""
    if values.dtype.kind == "f":
        return values.astype(np.float32, copy=False)
    if values.dtype == np.bool_ or values.size == 0:
        return values
    low, high = int(values.min()), int(values.max())
    for dtype in (np.uint8, np.int16, np.int32):
        info = np.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return values.astype(dtype, copy=False)
    return values.astype(np.int64, copy=False)


# -- decoding -----------------------------------------------------------------------------


def decode(data: bytes) -> Any:
    """A MEDIA_TYPE body with its arrays as tensors: views of one tensor per column, no
    Python lists; integers widened to int64 (torch's index type), masks (a field whose name
    ends in "mask") as bool. WireFormatError when `data` is not such a body."""
    return _decoded(data, load, _canonical, lambda part: part)


def decode_values(data: bytes) -> Any:
    """A MEDIA_TYPE body as plain JSON values: what the same body sent as JSON parses to.
    WireFormatError when `data` is not such a body."""
    return _decoded(data, load_arrays, lambda _name, column: column, lambda part: part.tolist())


def _decoded(
    data: bytes,
    loader: Callable[[bytes], dict[str, Any]],
    column: Callable[[str, Any], Any],
    row: Callable[[Any], Any],
) -> Any:
    """The skeleton with each placeholder replaced by `row` of its slice of `column` (each
    column converted once); `loader` reads the arrays (torch's or numpy's)."""
    try:
        tensors = loader(data)
        skeleton = json.loads(_metadata(data)[METADATA_KEY])
    except (SafetensorError, ValueError, KeyError, TypeError) as error:
        raise WireFormatError(
            f"not a {MEDIA_TYPE} body with an '{METADATA_KEY}' metadata entry: {error}"
        ) from error
    columns = {
        name: column(name, values)
        for name, values in tensors.items()
        if not name.endswith(".offsets")
    }

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            if "$tensor" in node:
                return row(_slice(node, columns, tensors))
            return {key: resolve(value) for key, value in node.items()}
        if isinstance(node, list):
            return [resolve(item) for item in node]
        return node

    return resolve(skeleton)


def _metadata(data: bytes) -> dict[str, str]:
    size = int.from_bytes(data[:8], "little")
    if size <= 0 or size > len(data) - 8:
        raise ValueError("bad header length")
    metadata = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise ValueError("metadata is not an object")
    return metadata


def _slice(placeholder: dict[str, Any], columns: dict[str, Any], tensors: dict[str, Any]) -> Any:
    """The slice of its column a placeholder names (torch tensors or numpy arrays)."""
    name, row = placeholder.get("$tensor"), placeholder.get("row")
    values, offsets = columns.get(f"{name}"), tensors.get(f"{name}.offsets")
    begin, end = placeholder.get("start"), placeholder.get("stop")
    if (
        values is None
        or offsets is None
        or not isinstance(row, int)
        or not 0 <= row < len(offsets) - 1
        or not all(b is None or isinstance(b, int) for b in (begin, end))
    ):
        raise WireFormatError(f"the body refers to row {row} of a column {name!r} it lacks")
    start, stop = int(offsets[row]), int(offsets[row + 1])
    if not 0 <= start <= stop <= len(values):
        raise WireFormatError(f"column {name!r} has offsets outside its values")
    part = values[start:stop]
    if begin is not None or end is not None:
        part = part[begin:end]
    return part


def _canonical(name: str, values: torch.Tensor) -> torch.Tensor:
    if values.is_floating_point() or values.dtype == torch.bool:
        return values
    if name.rsplit(".", 1)[-1].split("~")[0].endswith("mask"):
        return values.to(torch.bool)
    return values.to(torch.int64)


# -- typed results without validation (arrays stay tensors) ---------------------------------


def construct(model: type[M], tree: Any) -> M:
    """`tree` as `model` without validation, so arrays stay tensors where the model's
    fields say lists (nested models are built from their annotations)."""
    fields: dict[str, Any] = {}
    for name, value in tree.items():
        info = model.model_fields.get(name)
        fields[name] = value if info is None else _build(info.annotation, value)
    return model.model_construct(**fields)


def _build(annotation: Any, value: Any) -> Any:
    if isinstance(value, dict):
        target = _model_in(annotation)
        return construct(target, value) if target is not None else value
    if isinstance(value, list):
        item = _list_item(annotation)
        return value if item is None else [_build(item, v) for v in value]
    return value


def _options(annotation: Any) -> tuple[Any, ...]:
    origin = get_origin(annotation)
    if origin is Union or type(annotation).__name__ == "UnionType":
        return get_args(annotation)
    return (annotation,)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    for option in _options(annotation):
        if isinstance(option, type) and issubclass(option, BaseModel):
            return option
    return None


def _list_item(annotation: Any) -> Any:
    for option in _options(annotation):
        if get_origin(option) is list:
            return get_args(option)[0]
    return None
