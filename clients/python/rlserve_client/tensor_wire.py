"""The server's binary bodies (media type MEDIA_TYPE, needs the `[torch]` extra): a safetensors
file whose metadata entry "rlserve" is the JSON body with its numeric arrays taken out, each
replaced by `{"$tensor": name, "row": i}` (optionally narrowed by "start"/"stop"): row i of
the column `name`, stored as `name` (rows concatenated along dim 0) and `name.offsets`.
A JSON null is NaN in a float column and -1 in an integer one (a removed token's log-prob is
-inf). The server's OpenAPI document describes the same format.

Decoding builds no Python lists: every array is a view of one tensor per column, integers
widened to int64 (torch's index type) and masks as bool."""

from __future__ import annotations

import json
from typing import Any, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel

try:
    import torch
    from safetensors.torch import load, save
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "binary bodies need torch and safetensors: pip install 'rlserve-client[torch]'"
    ) from error

METADATA_KEY = "rlserve"
M = TypeVar("M", bound=BaseModel)


def _is_array(value: Any) -> bool:
    return hasattr(value, "__dlpack__")  # torch tensors and numpy arrays


def encode(body: dict[str, Any]) -> bytes:
    """A request body whose tensors (torch or numpy) travel as columns; everything else stays
    JSON. A 2-D tensor is one row of equal-length sequences (e.g. `tokens`), a list of 1-D
    tensors one row each."""
    tensors: dict[str, torch.Tensor] = {}

    def take(node: Any, path: str) -> Any:
        if _is_array(node):
            name = f"{path}~{len(tensors) // 2}"  # each given tensor is a column of one row
            row = torch.as_tensor(node).detach().cpu()
            tensors[name] = _narrow(row).contiguous()
            tensors[name + ".offsets"] = torch.tensor([0, len(row)], dtype=torch.int64)
            return {"$tensor": name, "row": 0}
        if isinstance(node, dict):
            return {k: take(v, f"{path}.{k}" if path else k) for k, v in node.items()}
        if isinstance(node, list | tuple):
            return [take(v, path) for v in node]
        return node

    skeleton = take(body, "")
    return save(tensors, metadata={METADATA_KEY: json.dumps(skeleton, separators=(",", ":"))})


def _narrow(values: torch.Tensor) -> torch.Tensor:
    """Floats as float32, integers in the narrowest type that holds them (as the server)."""
    if values.is_floating_point():
        return values.to(torch.float32)
    if values.dtype == torch.bool or values.numel() == 0:
        return values
    low, high = int(values.min()), int(values.max())
    for dtype in (torch.uint8, torch.int16, torch.int32):
        if torch.iinfo(dtype).min <= low and high <= torch.iinfo(dtype).max:
            return values.to(dtype)
    return values.to(torch.int64)


def decode(data: bytes) -> Any:
    """A binary body as the JSON body it stands for, arrays as tensors (views, no lists)."""
    tensors = load(data)
    size = int.from_bytes(data[:8], "little")
    skeleton = json.loads(json.loads(data[8 : 8 + size])["__metadata__"][METADATA_KEY])
    columns = {
        name: _canonical(name, values)
        for name, values in tensors.items()
        if not name.endswith(".offsets")
    }
    offsets = {name: tensors[name + ".offsets"].tolist() for name in columns}

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            if "$tensor" in node:
                name, row = node["$tensor"], node["row"]
                part = columns[name][offsets[name][row] : offsets[name][row + 1]]
                return part[node.get("start") : node.get("stop")]
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(skeleton)


def _canonical(name: str, values: torch.Tensor) -> torch.Tensor:
    if values.is_floating_point() or values.dtype == torch.bool:
        return values
    if name.rsplit(".", 1)[-1].endswith("mask"):
        return values.to(torch.bool)
    return values.to(torch.int64)


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
