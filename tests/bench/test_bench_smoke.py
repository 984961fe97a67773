"""The benchmarks keep running: a quick pass on the small model writes a complete report."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def run_quick(bench: str, output: Path) -> dict:  # type: ignore[type-arg]
    """`bench/BENCH.py --quick` into `output`; its JSON report."""
    command = [sys.executable, f"bench/{bench}.py", "--quick", "--output", str(output)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{bench}.py exited {done.returncode}:\n{done.stderr[-6000:]}"
    return json.loads((output / f"{bench}-quick.json").read_text())


def test_batching_benchmark_quick(tmp_path):
    report = run_quick("batching", tmp_path)
    assert set(report["http"]) == {"on", "off"}
    for mode in ("on", "off"):
        for route in ("logprobs", "generate"):
            assert set(report["http"][mode][route]) == {"1", "8"}
            assert report["http"][mode][route]["8"]["requests"] == 16
    assert report["in_process"]["generate"]["requests_per_s"] > 0
    assert (tmp_path / "batching-quick.png").stat().st_size > 0
    assert "| /v1/generate | 8 |" in (tmp_path / "batching-quick.md").read_text()


def test_adapters_benchmark_quick(tmp_path):
    """Throughput with 1 and 4 adapters resident against the policy alone, and load times."""
    report = run_quick("adapters", tmp_path)
    for key in ("base_alone", "1_adapters", "4_adapters", "base_beside_4_resident"):
        assert report[key]["score_tok_s"] > 0 and report[key]["generate_tok_s"] > 0
    assert report["4_adapters"]["score_tok_s_vs_base"] > 0
    assert 0 < report["load_ms"]["median"] <= report["load_ms"]["max"]


def test_adapters_tenants_benchmark_quick(tmp_path):
    """Two trainers, each with its own key and adapter, trained at once through one server:
    each took its step, pushed its adapter (version 0 first, one push a step) and the server's
    memory was read."""
    report = run_quick("adapters_tenants", tmp_path)
    assert report["alone"]["adapter_versions"] == [1]
    assert [run["adapter_versions"] for run in report["together"]] == [[1], [1]]
    assert all(ratio > 0 for ratio in report["steps_per_s_together_over_alone"])
    assert 0 < report["server_rss_loaded_mib"] <= report["server_rss_peak_all_trainers_mib"]


def test_moe_routing_benchmark_quick(tmp_path):
    """Both dtypes measured; in float32 the server's replay of the sampled routing scores the
    sampled tokens within float32's floor."""
    report = run_quick("moe_routing", tmp_path)["tiny-moe"]
    for dtype in ("float32", "bfloat16"):
        figures = report[dtype]
        assert figures["tokens_fed"] > 0
        assert 0 <= figures["tokens_routed_differently_share"] <= 1
    assert report["float32"]["server_logprobs_with_replay_gap"]["max"] < 1e-4


def test_batch_invariance_benchmark_quick(tmp_path):
    """The script checks that invariant mode's gaps are 0.0; here, that it measured both modes
    in both dtypes."""
    report = run_quick("batch_invariance", tmp_path)
    for dtype in ("float32", "bfloat16"):
        for mode in ("default", "invariant"):
            figures = report[dtype][mode]
            assert set(figures["score_gap_alone_vs"]) == {
                "batch_8",
                "batch_32",
                "beside_7_requests",
            }
            assert figures["score_tok_s"] > 0 and figures["generate_tok_s"] > 0
        assert report[dtype]["invariant"]["sampled_vs_scored_gap"] == 0.0


def test_rollouts_benchmark_quick(tmp_path):
    report = run_quick("rollouts", tmp_path)
    for parallel in ("2", "4"):
        row = report["parallel_episodes"][parallel]
        assert row["collect"]["episodes"] == row["rollouts"]["episodes"] == int(parallel)
        assert row["rollouts"]["dialog_turns"] == 2 * int(parallel)


def test_scoring_benchmark_quick(tmp_path):
    """Both wire formats run; the script itself checks they hand over identical tensors."""
    report = run_quick("scoring", tmp_path)
    assert set(report["cases"]) == {"json", "binary", "json_top20", "binary_top20"}
    cases = report["cases"]
    assert cases["binary_top20"]["reply_bytes"] < cases["json_top20"]["reply_bytes"]
    assert cases["binary_top20"]["request_bytes"] < cases["json_top20"]["request_bytes"]


def test_openai_routes_benchmark_quick(tmp_path):
    report = run_quick("openai_routes", tmp_path)
    point = report["results"]["transformers"]["8"]
    assert point["chat"]["requests"] == point["generate"]["requests"] == 16
    assert point["chat_stream_first_chunk_ms_p50"] > 0
    assert set(report["ratios"]) == {"transformers_chat_over_generate"}


def test_ray_serve_benchmark_quick(tmp_path):
    pytest.importorskip("ray", reason="ray is installed with the distributed extra")
    report = run_quick("ray_serve", tmp_path)
    for setup in ("plain", "ray_serve_1_replica"):
        for kind in ("generate", "score"):
            assert report["results"][setup]["8"][kind]["requests"] == 16


def test_weight_sync_benchmark_quick(tmp_path):
    pytest.importorskip("ray", reason="ray is installed with the distributed extra")
    report = run_quick("weight_sync", tmp_path)
    for setup in ("plain", "ray_serve_2_replicas"):
        for kind in ("load", "transfer"):
            figures = report["results"][setup][kind]
            assert figures["runs"] == 2 and figures["median_s"] > 0
            assert figures["versions"] == sorted(set(figures["versions"]))  # one per update
    adapter = report["results"]["plain_adapter"]
    assert adapter["upload"]["versions"] == [0, 1] and adapter["transfer"]["versions"] == [2, 3]
    assert (
        adapter["transfer"]["median_ms"] > 0
        and 0 < adapter["bytes"] < report["results"]["plain"]["bytes"]
    )


@pytest.mark.beside
def test_weight_delta_benchmark_quick(tmp_path):
    pytest.importorskip("ray", reason="ray is installed with the distributed extra")
    report = run_quick("weight_delta", tmp_path)
    for name, runs in report["results"].items():
        assert [r["version"] % 3 for r in runs] == [1, 2, 0], name  # (transfers: 4, 5, 6)
        assert runs[0]["delta"] is False, name
        if name != "transfer_float32":  # (whose deltas may be over `delta_max_share`: whole)
            assert [r["delta"] for r in runs[1:]] == [True, True], name
        assert all(r["digest_ok"] for r in runs), name
    # bfloat16 rounds most of a small step away: its deltas are a fraction of a whole push
    bf16 = report["summaries"]["one_server_bfloat16"]
    assert bf16["median_changed_elements"] < 0.5 and bf16["median_full_over_sent"] > 2
    assert report["memory_copy_gb_per_s"] > 0


def test_agent_turns_benchmark_quick(tmp_path):
    report = run_quick("agent_turns", tmp_path)
    off, on = report["without_cache"], report["with_cache"]
    assert off["prompt_tokens"] == on["prompt_tokens"]  # greedy: the same histories
    assert off["cache_hit_tokens"] == 0 and on["cache_hit_tokens"] > 0
    assert on["prefilled_tokens"] == on["prompt_tokens"] - on["cache_hit_tokens"]
    assert 0 < on["cache_bytes_at_end"] <= report["cache_bytes"]
    assert report["prefill_tokens_ratio"] > 1


def test_datasets_benchmark_quick(tmp_path):
    pytest.importorskip("lm_eval")
    report = run_quick("datasets", tmp_path)
    for shape in ("gsm8k", "ifeval"):
        case = report["uploads"][shape]
        assert case["rows"] == 2000 and case["rows_per_s"] > 0
        assert case["first_reset_s"] > 0 and case["cached_reset_s"] > 0
    assert report["uploads"]["ifeval"]["checked_for_reward"] == "ifeval"
    assert report["scoring"]["ifeval_ms_per_response"] > 0


def test_stream_text_benchmark_quick(tmp_path):
    report = run_quick("stream_text", tmp_path)
    for figures in report["results"].values():  # it exits non-zero if the texts differ
        assert figures["windowed_s"] > 0 and figures["whole_list_s"] > 0


@pytest.mark.beside
def test_learning_benchmark_quick(tmp_path):
    """The in-process loop (the rlserve one is tests/e2e/test_grpo_example.py) for 2 steps."""
    command = [sys.executable, "bench/learning.py", "--quick", "--loops", "local"]
    subprocess.run([*command, "--output", str(tmp_path)], cwd=ROOT, check=True, timeout=600)
    report = json.loads((tmp_path / "learning-quick.json").read_text())
    assert [r["step"] for r in report["steps"]["local"]] == [0, 1]
    assert report["summary"]["local"]["max_behaviour_drift"] == 0.0  # on-policy by definition
    assert report["equal_work"]["local"]["steps"] == 1
    assert report["hyper_parameters"]["group_size"] == 8
    assert (tmp_path / "learning-quick.png").stat().st_size > 0


@pytest.mark.beside
def test_real_model_benchmark_quick(tmp_path):
    report = run_quick("real_model", tmp_path)
    for name in ("rlserve_transformers", "in_process_transformers"):
        for kind in ("generate", "score"):
            assert report["results"][name]["8"][kind]["requests"] == 16
    assert report["ratios"]["rlserve_transformers_over_in_process"]["8"]["score"] > 0


def test_load_benchmark_quick(tmp_path):
    """Mixed traffic with idle pauses as long as a client keeps its connections: every
    request is answered (the script exits 1 on a 5xx or a dropped connection)."""
    report = run_quick("load", tmp_path)
    routes = {key.split()[0] for key in report["outcomes"]}
    assert routes == {
        "env_create",
        "env_reset",
        "env_step",
        "env_get",
        "env_delete",
        "generate",
        "logprobs",
    }
    assert report["failed"] == 0 and report["requests"] == sum(report["outcomes"].values())


@pytest.mark.beside
def test_async_training_benchmark_quick(tmp_path):
    report = run_quick("async_training", tmp_path)
    assert set(report["summary"]) == {
        "staleness 0",
        "staleness 0, seed 1",
        "staleness 1",
        "staleness 2",
    }
    for name, run in report["summary"].items():
        assert run["steps"] == 2 and run["samples"] == 64, name
    bounds = [r["max_staleness"] for r in report["overlap"]["runs"]]
    assert bounds == [0, 1, 2] == [r["max_staleness"] for r in report["equal_work"]]
    assert all(r["steps"] == 1 and r["steps_per_s"] > 0 for r in report["equal_work"])
    for run in report["overlap"]["runs"]:
        assert max(int(s) for s in run["staleness"]) <= run["max_staleness"]
    assert (tmp_path / "async_training-quick.png").stat().st_size > 0


def test_overhead_benchmark_quick(tmp_path):
    """Every workload, in both wire formats (environment steps in JSON), on the small model,
    under wrk where it is installed (scripts/system-deps.sh), else the Python load generator."""
    report = run_quick("overhead", tmp_path)
    assert report["load"] == ("wrk" if shutil.which("wrk") else "httpx")
    for name in ("transformers", "none"):  # none: the service with models that cost nothing
        backend = report["backends"][name]
        for kind in ("json", "binary"):
            assert set(backend[kind]) >= {"score_1", "score_32", "generate_16"}
            assert all(point["per_s"] > 0 for point in backend[kind].values())
        steps = backend["json"]["env_step"]
        cycle = 32 * (steps["episode_turns"] + 1)  # whole episodes, a reset before each
        assert steps["requests"] == cycle if report["load"] == "httpx" else steps["requests"] > 0
        assert steps["server_cpu_ms"] > 0


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed")
def test_env_steps_ab_benchmark_quick(tmp_path):
    """Two servers, alternating: this checkout against a worktree of HEAD."""
    command = [sys.executable, "bench/env_steps_ab.py", "--quick", "--against", "HEAD"]
    command += ["--turns", "4", "--output", str(tmp_path)]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, timeout=600)
    report = json.loads((tmp_path / "env_steps_ab-quick.json").read_text())
    runs = report["runs"]
    assert set(runs) == {report["against"], "this checkout"}
    for by_length in runs.values():
        (run,) = by_length["4"]
        assert run["per_s"] > 0 and run["episode_turns"] == 4
    ratio = report["ratios"]["4 turns"]
    expected = ratio["this checkout steps/s"] / ratio[f"{report['against']} steps/s"]
    assert ratio["ratio"] == pytest.approx(expected, abs=0.01)


def test_gpu_check_runs_its_steps_on_cpu(tmp_path):
    """The GPU check's steps, on the tiny model and the CPU, so the script is ready for the day
    a GPU host is: served scores and pushed weights match transformers' own forward, and the
    compiled decoding's greedy tokens match `generate`."""
    command = [sys.executable, "bench/gpu_check.py", "--quick", "--device", "cpu"]
    command += ["--model", "builtin:tiny", "--sections", "serve", "compiled"]
    command += ["--output", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"gpu_check.py exited {done.returncode}:\n{done.stderr[-6000:]}"
    report = json.loads((tmp_path / "gpu-check-quick-serve-compiled.json").read_text())
    float32 = report["dtypes"]["float32"]
    assert float32["scoring"]["vs_forward_same_dtype"]["max_abs"] < 1e-4
    assert float32["greedy"]["alone"]["identical"] == float32["greedy"]["prompts"] == 3
    for way in ("upload", "transfer_gloo"):
        push = float32["weight_push"][way]
        assert push["vs_forward_of_pushed"]["max_abs"] < 1e-5
    assert [float32["weight_push"][w]["policy_version"] for w in ("upload", "transfer_gloo")] == [
        1,
        2,
    ]
    bfloat16 = report["dtypes"]["bfloat16"]
    assert bfloat16["scoring"]["vs_forward_float32"]["max_abs"] > 1e-3  # bfloat16's own error
    assert set(bfloat16["throughput"]["rlserve_over_in_process"]["4"]) == {"generate", "score"}
    compiled = report["compiled"]["float32"]
    assert compiled["greedy"]["alone"]["identical"] == compiled["greedy"]["prompts"] == 3
    assert set(compiled["over_rlserve"]["4"]) == {"generate"}


def test_decode_host_benchmark_quick(tmp_path):
    """Host milliseconds per decode step and per scored sequence, each vocabulary and batch."""
    report = run_quick("decode_host", tmp_path)["now"]
    for vocab in ("overhead (vocab 16)", "SmolLM2 (vocab 49152)"):
        for figure in ("decode_step_ms", "score_ms_per_sequence"):
            assert set(report[vocab][figure]) == {"1", "8", "32", "64"}
        # A scored sequence's time is measured directly; a decode step's is the difference of
        # two timings (the generation less its prefill), which two repeats on a loaded machine
        # can leave at or below 0: that one is only a number here.
        assert all(ms > 0 for ms in report[vocab]["score_ms_per_sequence"].values())
        assert all(math.isfinite(ms) for ms in report[vocab]["decode_step_ms"].values())


def test_gpu_check_sections_run_on_cpu(tmp_path):
    """The GPU check's benchmark and GRPO sections, small and on CPU, so they still run when a
    GPU is next lent: each section's report folded in, no failure, and the GRPO loop's two
    steps each pushed a version."""
    command = [sys.executable, "bench/gpu_check.py", "--device", "cpu", "--quick"]
    command += ["--model", "builtin:tiny", "--sections", "moe", "grpo", "--output", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-6000:]
    report = json.loads((tmp_path / "gpu-check-quick-moe-grpo.json").read_text())
    assert "failed" not in report["moe"], report["moe"]
    assert report["moe"]["report"]["tiny-moe"]["bfloat16"]["tokens_fed"] > 0
    assert "failed" not in report["grpo"], report["grpo"]
    assert report["grpo"]["policy_version"] == [1, 2]
    assert not report["dtypes"]


def test_reward_model_benchmark_quick(tmp_path):
    """Rewards per second served and in-process at 1/8/32 clients; the served rewards equal
    the in-process ones (the benchmark asserts it)."""
    report = run_quick("reward_model", tmp_path)
    assert set(report["rlserve"]) == {"1", "8", "32"}
    for clients in ("1", "8", "32"):
        assert report["rlserve"][clients]["requests"] == 16
        assert report["in_process_rewards_per_s"][clients] > 0
    assert report["max_abs_diff_vs_in_process"] <= 1e-5
