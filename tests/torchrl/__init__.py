"""Tests beside the real TorchRL library; they run in `.venv-torchrl` (scripts/test-torchrl.sh)."""

import importlib.util

import pytest

torchrl_only = [
    pytest.mark.torchrl,
    pytest.mark.skipif(
        importlib.util.find_spec("torchrl") is None, reason="torchrl is not installed here"
    ),
]
