"""PEFT's LoRA adapter layout (`adapter_config.json` beside `adapter_model.safetensors`, what
`PeftModel.save_pretrained` writes), read and checked against the served model. What the
per-row LoRA of `app.engine.transformers.lora` computes is plain LoRA on the decoder's linear
layers; an adapter that needs more (DoRA, biases, embeddings, the output head, modules saved
whole) is refused by name rather than served without it."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from app.common.failures import NotFound, Unsupported, file_failure, invalid
from app.common.roles import Role
from app.weights.lora import AdapterBuild, LoraAdapter, LoraModule

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
CONFIG_METADATA = "adapter_config"
"""An uploaded adapter file's metadata key for its config (the text of adapter_config.json):
what lets an upload serve a new adapter, with no folder on the server."""
_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")

# Settings that change what an adapter computes beyond plain LoRA on linear layers: served only
# while unset (or false, or empty).
_MUST_BE_OFF = (
    "use_dora",
    "fan_in_fan_out",
    "lora_bias",
    "modules_to_save",
    "trainable_token_indices",
    "target_parameters",
    "layer_replication",
    "alora_invocation_tokens",
    "use_qalora",
    "use_bdlora",
    "arrow_config",
)


def read_folder(
    path: Path, role: Role = Role.CHECKPOINT
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The config and the tensors of the adapter in folder `path` (blocking: call in a
    thread); a file call that fails is the request's failure, named `role`."""
    try:
        return _read_folder(path, role)
    except OSError as error:
        raise file_failure(error, role) from None


def _read_folder(path: Path, role: Role) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    config_file, weights_file = path / CONFIG, path / WEIGHTS
    if not path.is_dir():
        raise NotFound(f"no adapter folder at {path}", role=role)
    for file in (config_file, weights_file):
        if not file.is_file():
            raise NotFound(
                f"{path} holds no {file.name} (PEFT's adapter layout: "
                f"{CONFIG} and {WEIGHTS}, as save_pretrained writes them)",
                role=role,
            )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise invalid(role, f"{config_file} is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise invalid(role, f"{config_file} holds no JSON object")
    return config, read_tensors(weights_file, role)


def read_upload(file: Path, role: Role) -> tuple[dict[str, Any] | None, dict[str, torch.Tensor]]:
    """The config in an uploaded file's metadata (`CONFIG_METADATA`; None without one) and its
    tensors (blocking: call in a thread)."""
    tensors = read_tensors(file, role)
    with safe_open(file, "pt") as opened:
        text = (opened.metadata() or {}).get(CONFIG_METADATA)
    if text is None:
        return None, tensors
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise invalid(role, f"the metadata's {CONFIG_METADATA} is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise invalid(role, f"the metadata's {CONFIG_METADATA} holds no JSON object")
    return config, tensors


def upload_bytes(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bytes:
    """One safetensors file of an adapter: its tensors, its config in the metadata (what
    `read_upload` reads)."""
    metadata = {CONFIG_METADATA: json.dumps(config)}
    return safetensors.torch.save({k: t.contiguous() for k, t in tensors.items()}, metadata)


def read_tensors(file: Path, role: Role) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file, in memory of their own (blocking: call in a
    thread). safetensors maps the file: a tensor kept as loaded would keep the file mapped,
    an upload's deleted temporary file included, for as long as the adapter is served."""
    try:
        mapped = load_file(file)
    except Exception as exc:
        raise invalid(role, f"{file.name} is not a valid safetensors file: {exc}") from exc
    return {name: tensor.clone() for name, tensor in mapped.items()}


def adapter_from(build: AdapterBuild, model: torch.nn.Module) -> LoraAdapter:
    """An adapter from PEFT's config and tensors (names as PEFT saves them), checked against
    `model`: every adapted layer a linear layer of its decoder, A and B of matching shapes."""
    parameter = next(model.parameters())
    # On a half-precision model the adapter stays in float32, as PEFT keeps it by default.
    half = parameter.dtype in (torch.bfloat16, torch.float16)
    shapes = {
        module: (layer.in_features, layer.out_features)
        for module, layer in _decoder_linears(model).items()
    }
    return parse_adapter(
        build, shapes, device=parameter.device, dtype=torch.float32 if half else parameter.dtype
    )


def parse_adapter(
    build: AdapterBuild,
    shapes: dict[str, tuple[int, int]] | None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> LoraAdapter:
    """An adapter from PEFT's config and tensors, checked against `shapes` (each linear layer
    of the decoder: in and out features), or, without them, left for the engine that loads it
    to check against its model (its layers' names as PEFT's, the output head refused here).
    Refusals name the role `Role.ADAPTER_SOURCE`."""
    config, tensors, role = build.config, build.tensors, Role.ADAPTER_SOURCE
    _check_config(config, role)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key.removeprefix(_PREFIX))
        if match is None:
            raise Unsupported(
                f"the adapter holds {key}, which is not a LoRA A or B matrix of a "
                "linear layer (embeddings, biases and modules saved whole are not served)",
                role=role,
            )
        pairs.setdefault(match["module"], {})[match["which"]] = tensor
    if not pairs:
        raise invalid(role, "the adapter holds no LoRA tensors")
    r, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora", False))
    modules: dict[str, LoraModule] = {}
    for module, pair in sorted(pairs.items()):
        layer = None if shapes is None else shapes.get(module)
        if (shapes is not None and layer is None) or module.rsplit(".", 1)[-1] == "lm_head":
            raise Unsupported(
                f"the adapter adapts {module}, which is not a linear layer of the "
                "served model's decoder (LoRA on the output head or embeddings is not served)",
                role=role,
            )
        if set(pair) != {"A", "B"}:
            raise invalid(role, f"{module} has lora_{set('AB') - set(pair)} missing")
        a, b = pair["A"], pair["B"]
        rank = _pattern(rank_pattern, module, r)
        fits = a.dim() == 2 and b.dim() == 2 and b.shape[1] == a.shape[0]
        if layer is not None:
            fits = fits and a.shape[1] == layer[0] and b.shape[0] == layer[1]
        if not fits:
            layer_text = "" if layer is None else f" {layer[0]}->{layer[1]}"
            raise invalid(
                role,
                f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit a"
                f"{layer_text} linear layer",
            )
        if a.shape[0] != rank:
            raise invalid(role, f"{module}: rank {a.shape[0]}, but its config says {rank}")
        scale = _pattern(alpha_pattern, module, alpha)
        scaling = scale / math.sqrt(rank) if rslora else scale / rank
        modules[module] = LoraModule(
            a=a.to(device=device, dtype=dtype or a.dtype).contiguous(),
            b=b.to(device=device, dtype=dtype or b.dtype).contiguous(),
            scaling=scaling,
        )
    return LoraAdapter(
        name=build.name,
        version=build.version,
        source=build.source,
        config=config,
        rank=max(m.a.shape[0] for m in modules.values()),
        modules=modules,
    )


def _check_config(config: dict[str, Any], role: Role) -> None:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise Unsupported(f"a {peft_type} adapter; only LoRA is served", role=role)
    if config.get("bias", "none") != "none":
        raise Unsupported(
            f"the adapter trains biases (bias {config['bias']!r}); rlserve serves "
            "plain LoRA (bias 'none')",
            role=role,
        )
    for key in _MUST_BE_OFF:
        if config.get(key):
            raise Unsupported(
                f"the adapter sets {key} ({config[key]!r}); rlserve serves plain "
                f"LoRA on linear layers, without {key}",
                role=role,
            )
    for key in ("r", "lora_alpha"):
        value = config.get(key, 8)
        if not isinstance(value, int | float) or value <= 0:
            raise invalid(role, f"the adapter's {key} must be a positive number, not {value!r}")


def _pattern(patterns: dict[str, Any], module: str, default: float) -> Any:
    """PEFT's rule for `rank_pattern` and `alpha_pattern`: the first key that matches the end
    of the module's name (`get_pattern_key`)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _decoder_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The linear layers inside the model's decoder, by their names in the whole model."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder: torch.nn.Module = get_decoder() if callable(get_decoder) else model
    prefix = next((n for n, m in model.named_modules() if m is decoder), "")
    found = {}
    for sub, module in decoder.named_modules():
        if isinstance(module, torch.nn.Linear):
            found[f"{prefix}.{sub}" if prefix else sub] = module
    return found
