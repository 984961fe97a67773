"""The GPU check: the default model (SmolLM2-135M-Instruct) served by the transformers backend on
a CUDA device, in float32 and bfloat16, against transformers itself on the same device.

    scripts/gpu-check.sh                      # on a GPU host: bench/results/gpu-check.json
    .venv/bin/python bench/gpu_check.py --device cpu --quick   # the same steps, small, on CPU

Per dtype, one server (`--device cuda --dtype D`) and one in-process model of the same dtype:
- scoring: `/v1/logprobs` of mixed-length sequences sent together (so the server pads and
  batches them) against a plain forward of each sequence alone; in bfloat16 also against the
  float32 forward, the error that bfloat16 itself brings;
- greedy: `/v1/generate` at temperature 0, each prompt sent alone and all at once, against
  `generate(do_sample=False)` of each prompt alone: prompts with identical tokens, and where
  the others first differ;
- throughput: bench/real_model.py's workload (64 requests; 32 sampled tokens past EOS; 128
  scored tokens) from 8 and 32 concurrent clients, against `generate` and a forward in batches
  of the same size, and against the CPU figures in bench/results/real_model.json;
- weight push (float32): new weights by upload (`PUT /v1/weights`) and by the collective
  transfer over gloo (one GPU cannot hold two NCCL ranks), each timed, then scored against a
  forward of the pushed weights;
- peak memory: the device memory in use at its peak while each server ran, less what was in use
  before it started (nvidia-smi, sampled every 0.25 s).

`compiled`, per dtype: a server with `models.compile_decode` (decoding steps compiled over a
static cache, as CUDA graphs): the first generation's wait for the compile, greedy tokens
against `generate` as above, generation throughput, and its ratio to the plain server's and to
in-process `generate` where `serve` ran too.

Then the benchmarks whose features exist only on this backend, each run on the device as it
runs on CPU (`--device cuda`), its report folded into this one with its wall time and peak
memory: `adapters` (bench/adapters.py: 1, 4 and 16 LoRA adapters resident against the policy
alone), `moe` (bench/moe_routing.py in bfloat16: routed-expert replay), `invariance`
(bench/batch_invariance.py: what batch-invariant mode costs, and that it stays bitwise), and
`grpo` (examples/grpo.py, 10 steps, with the trainer and the server on the one device, weights
over gloo). `--sections` runs some of them (the report is then named after them), so a short
device lease can take the check in parts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import torch
from common import ROOT, bench_arguments, running_server, throughput_ratios
from real_model import SCORE_TOKENS, in_process, workloads
from vs_vllm_serve import measure, rlserve_bodies

from app.config import Settings
from app.config_groups import DEFAULT_MODEL
from app.engine.loader import resolve_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SECTIONS = ("serve", "compiled", "adapters", "moe", "invariance", "grpo")
GRPO_STEPS = 10
SCORE_LENGTHS = (17, 40, 64, 96, 128, 128, 7, 111)  # mixed, so the server pads its batches
GREEDY_TOKENS = 48


def device_facts(device: torch.device) -> dict[str, Any]:
    facts: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    import transformers

    facts["transformers"] = transformers.__version__
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        facts.update(
            name=properties.name,
            memory_gib=round(properties.total_memory / 2**30, 1),
            multiprocessors=properties.multi_processor_count,
            cuda=torch.version.cuda,
        )
        try:
            smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            facts["driver"] = subprocess.run(smi, capture_output=True, text=True).stdout.strip()
        except OSError:
            pass
    else:
        facts["name"] = f"CPU ({platform.processor() or platform.machine()})"
    return facts


class PeakDeviceMemory:
    """The device's memory in use at its peak while `with` runs, less what was in use when it
    began (MiB; nvidia-smi, sampled every `every_s`): the footprint of what ran inside, CUDA
    context included. None off CUDA or without nvidia-smi."""

    def __init__(self, device: torch.device, every_s: float = 0.25) -> None:
        self.index = (device.index or 0) if device.type == "cuda" else None
        self.every_s, self.baseline, self.peak = every_s, None, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def used_mib(self) -> int | None:
        query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        try:
            out = subprocess.run([*query, "-i", str(self.index)], capture_output=True, text=True)
            return int(out.stdout.strip())
        except (OSError, ValueError):
            return None

    def _sample(self) -> None:
        while not self._stop.is_set():
            if (used := self.used_mib()) is not None:
                self.peak = max(self.peak or 0, used)
            self._stop.wait(self.every_s)

    def __enter__(self) -> PeakDeviceMemory:
        if self.index is not None and (used := self.used_mib()) is not None:
            self.baseline = used
            self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def mib(self) -> int | None:
        if self.baseline is None or self.peak is None:
            return None
        return self.peak - self.baseline


@torch.inference_mode()
def forward_log_probs(model: Any, sequence: list[int]) -> torch.Tensor:
    """Log-probs of tokens 1.. of `sequence`, one plain forward of it alone, in float64."""
    ids = torch.tensor([sequence], device=model.device)
    logits = model(input_ids=ids).logits[0, :-1].double()
    return logits.log_softmax(-1).gather(-1, ids[0, 1:, None].long())[:, 0].cpu()


def served_log_probs(url: str, sequences: list[list[int]]) -> list[torch.Tensor]:
    """`/v1/logprobs` of every sequence, all sent at once (one request each)."""

    async def all_at_once() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            calls = (client.post("/v1/logprobs", json={"tokens": [s]}) for s in sequences)
            return await asyncio.gather(*calls)

    out = []
    for response in asyncio.run(all_at_once()):
        response.raise_for_status()
        full = response.json()["outputs"][0]["log_probs"]["full"]
        out.append(torch.tensor(full[1:], dtype=torch.float64))  # the first token has none
    return out


def gaps(served: list[torch.Tensor], expected: list[torch.Tensor]) -> dict[str, float]:
    diffs = torch.cat([(s - e).abs() for s, e in zip(served, expected, strict=True)])
    return {"max_abs": float(diffs.max()), "mean_abs": float(diffs.mean())}


def scoring(url: str, model: Any, sequences: list[list[int]], fp32: list[torch.Tensor]) -> Any:
    served = served_log_probs(url, sequences)
    alone = [forward_log_probs(model, s) for s in sequences]
    return {
        "sequences": len(sequences),
        "tokens": sum(len(s) - 1 for s in sequences),
        "vs_forward_same_dtype": gaps(served, alone),
        "vs_forward_float32": gaps(served, fp32),
    }


@torch.inference_mode()
def greedy(url: str, model: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """Served greedy tokens (alone, then all at once) against `generate` of each prompt alone."""
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=GREEDY_TOKENS,
            pad_token_id=model.generation_config.pad_token_id,
        )
        expected.append(out[0, len(prompt) :].tolist())
    body = {"max_tokens": GREEDY_TOKENS, "temperature": 0}

    async def serve(together: bool) -> list[list[int]]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            calls = [client.post("/v1/generate", json={**body, "tokens": [p]}) for p in prompts]
            if together:
                responses = await asyncio.gather(*calls)
            else:
                responses = [await call for call in calls]
        for response in responses:
            response.raise_for_status()
        return [r.json()["outputs"][0][0]["tokens"]["response"] for r in responses]

    report: dict[str, Any] = {"prompts": len(prompts), "max_new_tokens": GREEDY_TOKENS}
    for name, together in (("alone", False), ("together", True)):
        served = asyncio.run(serve(together))
        differ = [first_difference(s, e) for s, e in zip(served, expected, strict=True)]
        report[name] = {
            "identical": sum(d is None for d in differ),
            "first_difference_at": [d for d in differ if d is not None],
        }
    return report


def first_difference(served: list[int], expected: list[int]) -> int | None:
    """Where the served tokens first leave `generate`'s (None: identical). `generate` stops at
    EOS like the server, so a shorter one differs where it ends."""
    for at, (a, b) in enumerate(zip(served, expected, strict=False)):
        if a != b:
            return at
    return None if len(served) == len(expected) else min(len(served), len(expected))


@torch.no_grad()
def perturbed(model: Any, seed: int) -> dict[str, torch.Tensor]:
    """The model's parameters moved by 1% of each one's spread (a stand-in for a training
    step). Named as `named_parameters` names them: a tied tensor (SmolLM2's embedding and
    output layer) once."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    out = {}
    for name, tensor in model.named_parameters():
        noise = torch.randn(tensor.shape, generator=generator).to(tensor.device, tensor.dtype)
        out[name] = (tensor + 0.01 * tensor.float().std().to(tensor.dtype) * noise).contiguous()
    return out


def weight_push(url: str, model: Any, sequence: list[int]) -> dict[str, Any]:
    """Push new float32 weights by upload and by the collective transfer (gloo); each timed and
    then checked: the served log-probs equal a forward of the pushed weights."""
    from rlserve_client import Client
    from safetensors.torch import save

    report: dict[str, Any] = {}
    original = {k: v.clone() for k, v in model.state_dict().items()}
    with Client(base_url=url, timeout=600) as client:
        for seed, way in ((1, "upload"), (2, "transfer_gloo")):
            weights = perturbed(model, seed)
            nbytes = sum(t.numel() * t.element_size() for t in weights.values())
            started = time.perf_counter()
            if way == "upload":
                payload = save({k: v.cpu() for k, v in weights.items()})
                serialized = time.perf_counter() - started
                updated = client.upload_weights(payload=payload)
            else:
                serialized = 0.0
                with client.weight_transfer(transport="gloo") as sync:
                    joined = time.perf_counter() - started
                    started = time.perf_counter()
                    updated = sync.send(weights)
            seconds = time.perf_counter() - started
            model.load_state_dict(weights, strict=False)
            served = served_log_probs(url, [sequence])
            report[way] = {
                "bytes": nbytes,
                "seconds": round(seconds, 3),
                "gb_per_s": round(nbytes / seconds / 1e9, 3),
                "policy_version": updated.policy_version,
                "vs_forward_of_pushed": gaps(served, [forward_log_probs(model, sequence)]),
            }
            if way == "upload":
                report[way]["serialize_s"] = round(serialized, 3)
            else:
                report[way]["join_s"] = round(joined, 3)
    model.load_state_dict(original)
    return report


def cpu_figures() -> dict[str, Any] | None:
    path = ROOT / "bench" / "results" / "real_model.json"
    if not path.exists():
        return None
    results = json.loads(path.read_text())["results"]
    return {
        "rlserve": results["rlserve_transformers"],
        "in_process": results["in_process_transformers"],
    }


@contextlib.contextmanager
def dtype_server(
    args: argparse.Namespace, name: str, log: str, **settings: str
) -> Iterator[tuple[Any, PeakDeviceMemory]]:
    """A server of the check's model in dtype `name` on the device (`settings`: more
    RLSERVE_MODELS__ variables), its log in `log`, and the peak device memory while it ran."""
    env = {
        "RLSERVE_STORAGE__DATA_DIR": str(args.output / ".data"),
        "RLSERVE_MODELS__BACKEND": "transformers",
        "RLSERVE_MODELS__DEVICE": str(args.device),
        "RLSERVE_MODELS__DTYPE": name,
        "RLSERVE_MODELS__LOAD_REFERENCE": "false",
        **{f"RLSERVE_MODELS__{key.upper()}": value for key, value in settings.items()},
    }
    with (
        PeakDeviceMemory(args.device) as memory,
        running_server(
            "--model", args.model, env=env, log=args.output / log, ready_timeout=600
        ) as server,
    ):
        yield server, memory


def in_process_model(args: argparse.Namespace, model_dir: Path, name: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[name])
    return model.to(args.device).eval()


def released(args: argparse.Namespace) -> None:
    """The device memory of a model just dropped, handed back."""
    if args.device.type == "cuda":
        torch.cuda.empty_cache()


def check_dtype(
    args: argparse.Namespace,
    name: str,
    model_dir: Path,
    work: dict[str, list[list[int]]],
    fp32: list[torch.Tensor],
) -> dict[str, Any]:
    model = in_process_model(args, model_dir, name)
    report: dict[str, Any] = {}
    with dtype_server(args, name, f"gpu-check-{name}.log") as (server, memory):
        report["startup_s"] = round(server.startup_seconds, 1)
        report["scoring"] = scoring(server.url, model, work["mixed"], fp32)
        print(name, "scoring", report["scoring"], flush=True)
        report["greedy"] = greedy(server.url, model, work["generate"][: args.greedy_prompts])
        print(name, "greedy", report["greedy"], flush=True)
        bodies = rlserve_bodies({k: work[k] for k in ("generate", "score")}, args.new_tokens)
        served = measure(f"rlserve {name}", server.url, bodies, args)
        report["throughput"] = {"rlserve": served}
        if name == "float32":
            report["weight_push"] = weight_push(server.url, model, work["mixed"][-1])
            print(name, "weight push", report["weight_push"], flush=True)
    report["server_peak_device_memory_mib"] = memory.mib
    same = {k: work[k] for k in ("generate", "score")}
    report["throughput"]["in_process"] = in_process(model, same, args)
    kinds = ("generate", "score")
    report["throughput"]["rlserve_over_in_process"] = throughput_ratios(
        served, report["throughput"]["in_process"], kinds
    )
    if (cpu := cpu_figures()) is not None and not args.quick:
        report["throughput"]["rlserve_over_rlserve_cpu"] = throughput_ratios(
            served, cpu["rlserve"], kinds
        )
    del model
    released(args)
    return report


def check_compiled(
    args: argparse.Namespace,
    name: str,
    model_dir: Path,
    work: dict[str, list[list[int]]],
    plain: dict[str, Any] | None,
) -> dict[str, Any]:
    """The dtype's server with `models.compile_decode`: its compile, greedy exactness and
    generation rate (`plain`: the `serve` section's figures of the same dtype, if it ran)."""
    model = in_process_model(args, model_dir, name)
    report: dict[str, Any] = {}
    log = f"gpu-check-compiled-{name}.log"
    with dtype_server(args, name, log, compile_decode="true") as (server, memory):
        started = time.perf_counter()
        first = {"tokens": [work["generate"][0]], "max_tokens": 4, "temperature": 0}
        httpx.post(f"{server.url}/v1/generate", json=first, timeout=900).raise_for_status()
        report["first_generation_s"] = round(time.perf_counter() - started, 1)
        report["greedy"] = greedy(server.url, model, work["generate"][: args.greedy_prompts])
        generate = rlserve_bodies({"generate": work["generate"], "score": []}, args.new_tokens)
        bodies = {"generate": generate["generate"]}
        report["throughput"] = measure(f"rlserve compiled {name}", server.url, bodies, args)
    report["server_peak_device_memory_mib"] = memory.mib
    if plain is not None:
        throughput = plain["throughput"]
        report["over_rlserve"] = throughput_ratios(
            report["throughput"], throughput["rlserve"], ("generate",)
        )
        report["over_in_process"] = throughput_ratios(
            report["throughput"], throughput["in_process"], ("generate",)
        )
    print(name, "compiled", json.dumps(report), flush=True)
    del model
    released(args)
    return report


def bench_section(args: argparse.Namespace, script: str, *options: str) -> dict[str, Any]:
    """`bench/SCRIPT --device D [--quick] OPTIONS` in a process of its own, writing into a
    scratch folder: its report, wall time and peak device memory, or its failure's tail."""
    scratch = args.output / ".sections" / Path(script).stem
    scratch.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(ROOT / "bench" / script), "--device", str(args.device)]
    command += ["--output", str(scratch), *(["--quick"] if args.quick else []), *options]
    started = time.perf_counter()
    with PeakDeviceMemory(args.device) as memory:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.section_s)
    section: dict[str, Any] = {
        "command": " ".join(["bench/" + script, *command[2:]]).replace(str(scratch), "SCRATCH"),
        "seconds": round(time.perf_counter() - started, 1),
        "peak_device_memory_mib": memory.mib,
    }
    if done.returncode != 0:
        section["failed"] = {"returncode": done.returncode, "tail": done.stderr[-3000:]}
    reports = sorted(scratch.glob("*.json"), key=lambda f: f.stat().st_mtime)
    if reports:
        section["report"] = json.loads(reports[-1].read_text())
    print(script, json.dumps(section, indent=1)[:4000], flush=True)
    return section


def grpo(args: argparse.Namespace) -> dict[str, Any]:
    """examples/grpo.py's loop for GRPO_STEPS steps, the trainer on the device beside the
    server (weights over gloo: one device holds one NCCL rank), the server's weights put back
    at the end: each step's reward and time."""
    steps = 2 if args.quick else GRPO_STEPS
    env = {
        "RLSERVE_STORAGE__DATA_DIR": str(args.output / ".data"),
        "RLSERVE_MODELS__BACKEND": "transformers",
        "RLSERVE_MODELS__DEVICE": str(args.device),
        "RLSERVE_MODELS__LOAD_REFERENCE": "false",
    }
    steps_log = args.output / "gpu-check-grpo-steps.jsonl"
    steps_log.unlink(missing_ok=True)
    started = time.perf_counter()
    with (
        PeakDeviceMemory(args.device) as memory,
        running_server(
            "--model",
            args.model,
            env=env,
            log=args.output / "gpu-check-grpo.log",
            ready_timeout=600,
        ) as server,
    ):
        command = [sys.executable, str(ROOT / "examples" / "grpo.py"), "--url", server.url]
        command += ["--steps", str(steps), "--device", str(args.device), "--transport", "gloo"]
        command += ["--log", str(steps_log), "--restore"]
        command += ["--prompts", "2"] if args.quick else []
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.section_s)
    records = (
        [json.loads(line) for line in steps_log.read_text().splitlines()]
        if (steps_log.exists())
        else []
    )
    section: dict[str, Any] = {
        "command": f"examples/grpo.py --steps {steps} --device {args.device} --transport gloo",
        "seconds": round(time.perf_counter() - started, 1),
        "peak_device_memory_mib": memory.mib,
        "reward": [round(r["reward"], 3) for r in records],
        "step_s": [round(r["step_s"], 2) for r in records],
        "train_s": [round(r["train_s"], 2) for r in records],
        "push_s": [round(r["push_s"], 2) for r in records],
        "policy_version": [r["policy_version"] for r in records],
    }
    if done.returncode != 0:
        section["failed"] = {"returncode": done.returncode, "tail": done.stderr[-3000:]}
    print("grpo", json.dumps(section), flush=True)
    return section


def main() -> None:
    parser = bench_arguments(__doc__)
    parser.add_argument("--device", type=torch.device, default=torch.device("cuda"))
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="builtin:tiny: a first look at a new host, fast"
    )
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--section-s", type=float, default=300, help="each benchmark's limit")
    args = parser.parse_args()
    args.requests = 8 if args.quick else 64
    args.clients = [4] if args.quick else [8, 32]
    args.new_tokens = 8 if args.quick else 32
    args.seq_len = SCORE_TOKENS
    args.greedy_prompts = 3 if args.quick else 16
    args.output.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    from transformers import AutoTokenizer

    model_dir = Path(resolve_model(Settings().models, args.model)[0])
    prepared = time.perf_counter() - started
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    work = workloads(tokenizer, max(args.requests, args.greedy_prompts))
    text = work["score"][0] + work["score"][1]
    work["mixed"] = [text[:length] for length in SCORE_LENGTHS]
    work["score"] = work["score"][: args.requests]
    # The float32 truth of the mixed sequences, for the bfloat16 error.
    reference = in_process_model(args, model_dir, "float32")
    fp32 = [forward_log_probs(reference, s) for s in work["mixed"]]
    del reference
    report: dict[str, Any] = {
        "check": "bench/gpu_check.py" + (" --quick" if args.quick else ""),
        "model": args.model,
        "backend": "transformers",
        "host": device_facts(args.device),
        "model_ready_s": round(prepared, 1),
        "workload": {
            "requests_per_point": args.requests,
            "clients": args.clients,
            "generate_new_tokens": args.new_tokens,
            "score_tokens": SCORE_TOKENS,
            "scoring_lengths": list(SCORE_LENGTHS),
        },
        "dtypes": {},
    }
    if "serve" in args.sections:
        for name in DTYPES:
            report["dtypes"][name] = check_dtype(args, name, model_dir, work, fp32)
    if "compiled" in args.sections:
        report["compiled"] = {
            name: check_compiled(args, name, model_dir, work, report["dtypes"].get(name))
            for name in DTYPES
        }
    model = [] if args.model == DEFAULT_MODEL else ["--model", args.model]
    benches = {
        "adapters": ("adapters.py", *model),
        "moe": ("moe_routing.py", "--dtypes", "bfloat16"),
        "invariance": ("batch_invariance.py", *model),
    }
    for section, (script, *options) in benches.items():
        if section in args.sections:
            report[section] = bench_section(args, script, *options)
    if "grpo" in args.sections:
        report["grpo"] = grpo(args)
    report["seconds"] = round(time.perf_counter() - started, 1)
    stem = "gpu-check-quick" if args.quick or args.model != DEFAULT_MODEL else "gpu-check"
    if set(args.sections) != set(SECTIONS):
        stem += "-" + "-".join(args.sections)
    (args.output / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
