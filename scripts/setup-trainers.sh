#!/usr/bin/env bash
# Create .venv-trainers: rlserve (server and tests) beside the trainers' own clients, pinned and
# unmodified, for tests/trainers (scripts/test-trainers.sh). A trainer package that drags in a
# GPU stack is installed with --no-deps, plus the few packages its client module imports.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${RLSERVE_TRAINERS_VENV:-.venv-trainers}
# AReaL 1.0.4: areal.engine.sglang_remote (its remote SGLang engine). Its import chain loads
# areal.infra and areal.api.cli_args (ray, hydra/omegaconf, uvloop, ...), not SGLang or vLLM.
areal=(areal==1.0.4)
areal_needs=(
  "ray==2.60.0" aiohttp requests colorlog tenacity flask torchdata lark uvloop pyyaml
  "hydra-core==1.4.0.dev1" "omegaconf==2.4.0.dev2" numba pillow orjson einops aiofiles
  psutil pybase64
)
# renderers 0.1.12: renderers.client.generate, what verifiers' TrainClient and prime-rl call
# (it imports httpx and openai, already here, and pydantic_config); verifiers 0.4.0's
# TrainClient itself, with what its client modules import (and openai 2: verifiers asks for
# <3, which ART 0.5.18 needs too).
renderers=(renderers==0.1.12 prime-pydantic-config==0.4.3 verifiers==0.4.0)
renderers_needs=(
  "openai>=2.54,<3" openai-harmony anthropic prime-sandboxes tomli-w math-verify
)
# SkyRL 0.4.0: its RemoteInferenceClient and SkyrlWeightSyncClient, in a venv of its own
# (.venv-skyrl): SkyRL needs Python 3.12, and its client module imports torch (PyPI's build
# for 3.12: the CUDA one, which runs on the CPU); tests/trainers/skyrl_driver.py runs there,
# the server in .venv-trainers. SkyRL 0.3.0 (its last release that claims Python 3.11, where
# it does not import: pydantic refuses its typing.TypedDict) goes to a folder of its own in
# that venv, ahead of 0.4.0 on the drivers' path; its weight sync imports ray, omegaconf and
# skyrl-gym. The drivers' training loop needs transformers (SkyRL's own pin) and httpx; its
# checkpoint-delta publisher, zstandard and xxhash (its own requirements).
skyrl_venv=${RLSERVE_SKYRL_VENV:-.venv-skyrl}
skyrl=(skyrl==0.4.0)
skyrl_previous=skyrl==0.3.0
skyrl_needs=(
  torch==2.13.0 aiohttp orjson numpy pybase64 loguru rich pydantic cloudpathlib requests
  "ray==2.60.0" omegaconf "skyrl-gym==0.4.0" "transformers==5.16.1" "tokenizers>=0.23.1" httpx
  zstandard xxhash
)
# ART (openpipe-art 0.5.23): its TrainableModel's OpenAI client, trajectory capture and
# tokenizing, in a venv of its own (.venv-art: ART needs Python 3.12). `import art` loads
# openai, polars, anthropic, ... (python-dotenv, which it imports, is not among its declared
# dependencies); weave once a TrainableModel's client makes a call. No torch, no vLLM.
art_venv=${RLSERVE_ART_VENV:-.venv-art}
art=(openpipe-art==0.5.23)
art_needs=(
  python-dotenv "openai>=2.14,<3" "pydantic>=2.12" "numpy>=1.26" "polars>=1.26"
  "anthropic>=0.77" aiohttp requests tqdm "weave>=0.52.41"
)
# ART 0.5.18, the newest release for Python 3.11, beside AReaL in .venv-trainers, in a folder
# of its own (the venv's ART is none; .venv-art holds 0.5.23); its tokenizing for training
# imports torch and transformers, already here.
art_previous=(openpipe-art==0.5.18)
art_previous_needs=(
  "polars>=1.26" "weave>=0.52.24" "litellm>=1.71.1,<=1.82.0" nest-asyncio setproctitle tblib
  typer python-dotenv "openai>=2.54,<3"
)
# verl 0.9.1's reward loop (verl.experimental.reward_loop: its discriminative reward model over
# HTTP) and OpenRLHF 0.11.2's HTTP reward call (openrlhf.utils.agent), from their releases with
# --no-deps: their import chains need only what is here already (ray, omegaconf, tensordict,
# aiohttp, sympy, transformers, torch) plus codetiming (verl) and pylatexenc (OpenRLHF). TRL
# 1.0.0's OpenAI judges (trl.experimental.judges; TRL removed them after 1.0), --no-deps too:
# they import openai, numpy and accelerate, here already.
rewards=(verl==0.9.1 openrlhf==0.11.2 trl==1.0.0)
rewards_needs=(codetiming pylatexenc)
stamp="$venv/.rlserve-installed"
wanted="$(cat pyproject.toml clients/python/pyproject.toml "$0" | sha256sum | cut -c1-16)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ]; then
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet torch==2.13.0
# One editable install of the project at a time (scripts/test.sh builds venvs side by side).
# (the silenced UserWarning: setuptools' editable-install notice, see install.sh)
PYTHONWARNINGS=ignore::UserWarning flock pyproject.toml \
  "$venv/bin/python" -m pip install --quiet -e ".[test]" -e "clients/python[torch]"
"$venv/bin/python" -m pip install --quiet --no-deps "${areal[@]}" "${renderers[@]}" "${rewards[@]}"
"$venv/bin/python" -m pip install --quiet "${areal_needs[@]}" "${renderers_needs[@]}" \
  "${rewards_needs[@]}" torch==2.13.0
"$venv/bin/python" -m pip install --quiet --no-deps --upgrade --target "$venv/art-0.5.18" \
  "${art_previous[@]}"
"$venv/bin/python" -m pip install --quiet "${art_previous_needs[@]}" torch==2.13.0
scripts/install-model.sh "$venv/bin/python"
python312=$(ls /root/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -1 || true)
if [ -z "$python312" ] && python3.12 --version > /dev/null 2>&1; then python312=$(command -v python3.12); fi
if [ -n "$python312" ]; then
  "$python312" -m venv "$skyrl_venv"
  "$skyrl_venv/bin/python" -m pip install --quiet --upgrade pip
  "$skyrl_venv/bin/python" -m pip install --quiet --no-deps "${skyrl[@]}"
  "$skyrl_venv/bin/python" -m pip install --quiet "${skyrl_needs[@]}"
  "$skyrl_venv/bin/python" -m pip install --quiet --no-deps --upgrade \
    --target "$skyrl_venv/skyrl-0.3.0" "$skyrl_previous"
  "$python312" -m venv "$art_venv"
  "$art_venv/bin/python" -m pip install --quiet --upgrade pip
  "$art_venv/bin/python" -m pip install --quiet --no-deps "${art[@]}"
  "$art_venv/bin/python" -m pip install --quiet "${art_needs[@]}"
else
  echo "note: no Python 3.12 here: SkyRL's and ART's clients (tests/trainers) will skip" >&2
fi
echo "$wanted" > "$stamp"
