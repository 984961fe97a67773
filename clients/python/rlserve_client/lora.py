"""A PEFT adapter as the one file `Client.push_adapter` sends: its tensors under PEFT's names
(what `get_peft_model_state_dict` gives), with its config (the text `save_pretrained` writes
to adapter_config.json) in the file's metadata, so a first push serves a new adapter."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

CONFIG_METADATA = "adapter_config"


def adapter_file(
    adapter: Any,
    config: Mapping[str, Any] | Any | None = None,
    *,
    adapter_name: str = "default",
) -> bytes:
    """One safetensors file of `adapter`: a PEFT model (its adapter `adapter_name`, tensors and
    config both) or a mapping of PEFT's tensor names to tensors. `config`: a PEFT config or its
    dict (default: the model's own; a mapping of tensors alone then travels without one, which
    the server takes only for an adapter it serves already)."""
    from safetensors.torch import save

    tensors, config = adapter_parts(adapter, config, adapter_name=adapter_name)
    metadata = {"format": "pt"}
    if config is not None:
        metadata[CONFIG_METADATA] = config_text(config)
    # safetensors refuses tensors that share memory: each one contiguous, on the CPU, its own
    return save(
        {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()},
        metadata=metadata,
    )


def adapter_parts(
    adapter: Any,
    config: Mapping[str, Any] | Any | None = None,
    *,
    adapter_name: str = "default",
) -> tuple[dict[str, Any], Any | None]:
    """`adapter`'s tensors under PEFT's names and its config (`config`, else a PEFT model's
    own, else None), as `adapter_file` takes them."""
    import torch

    if not isinstance(adapter, torch.nn.Module):
        return dict(adapter), config
    from peft import get_peft_model_state_dict

    tensors = dict(get_peft_model_state_dict(adapter, adapter_name=adapter_name))
    if config is None:
        configs: Mapping[str, Any] = getattr(adapter, "peft_config", {})
        config = configs.get(adapter_name)
    return tensors, config


def config_dict(config: Mapping[str, Any] | Any) -> dict[str, Any]:
    """A PEFT config (or its dict) as adapter_config.json's object."""
    result: dict[str, Any] = json.loads(config_text(config))
    return result


def config_text(config: Mapping[str, Any] | Any) -> str:
    """A PEFT config (or its dict) as adapter_config.json's text."""
    values = dict(config) if isinstance(config, Mapping) else config.to_dict()
    return json.dumps(values, sort_keys=True, default=_plain)


def _plain(value: Any) -> Any:
    """What json cannot write itself: sets (PEFT's target_modules), enums (its task type)."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if hasattr(value, "value"):
        return value.value
    raise TypeError(f"{type(value).__name__} in an adapter config is not JSON")
