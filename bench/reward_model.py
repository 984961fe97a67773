"""The reward model served beside the policy.

Throughput (`--part throughput`): rewards per second at 1, 8 and 32 concurrent clients, each
request one sequence of `--tokens` tokens on `/v1/rewards`, against in-process
`AutoModelForSequenceClassification` forwards of batches of the same size (as many sequences
as clients: what the server's batcher can put in one call). Each figure is the median of
`--repeats` passes (the server's after a warm-up pass at 32 clients). The server's rewards are
checked against the in-process ones (1e-5).

Learning (`--part learning`): a reward model trained here, then GRPO with it as the only
reward. SmolLM2-135M-Instruct samples replies to the bundled sums at temperature 1; each is
labelled by whether it ends on the right sum; a score head on SmolLM2's own (frozen) last hidden
state learns that label (logistic regression), with each training reply also made right and
made wrong by its last number alone (so form alone cannot earn the score). The reward model
(SmolLM2 with that head) is served with `--reward-model`, and `examples/grpo.py --reward model`
trains the policy on its scores alone. Every `--refit-every` steps the head is fit again with
the policy's latest replies added, labelled the same way, and loaded into the served reward
model (`POST /v1/rewards/weights`) before the next batch is sampled, as RLHF refreshes a reward
model on its policy's samples (0: fit once). The log shows, step by step, the served reward,
the exact-answer rate (which the policy never sees), how well the served head ranks the
policy's replies, and each step's replies' mean reward under the last head (one scale for all).

    python bench/reward_model.py            # both parts
    python bench/reward_model.py --quick    # throughput alone, the built-in tiny model
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from common import bench_arguments, drive, rss_bytes, running_server, thirds
from learning import train_rlserve
from rlserve_client import Client
from rlserve_client.types import Trajectory
from safetensors.torch import save_file
from transformers import AutoModelForSequenceClassification

from app.config import Settings
from app.config_groups import DEFAULT_MODEL
from app.datasets.bundled import sum_problems
from app.datasets.rows import Problem
from app.engine.builtin_model import BUILDER_VERSION, build_model
from app.engine.loader import smollm2_dir
from app.engine.transformers.decode import padded
from app.envs.rewards import NUMBER, ground_truth
from examples.grpo import arguments, ends_on

CLIENTS = (1, 8, 32)


def reward_model(output: Path, hidden: int, layers: int) -> Path:
    """A random-weights Qwen2 reward model of benchmark size, built once into `output`."""
    path = output / f".reward-v{BUILDER_VERSION}-h{hidden}-l{layers}"
    if not (path / "config.json").exists():
        build_model(path, hidden_size=hidden, num_layers=layers, reward=True)
    return path


@torch.inference_mode()
def in_process(path: Path, sequences: list[list[int]], batch: int) -> tuple[float, list[float]]:
    """Rewards per second of plain batched forwards (left-padded, as the server pads; the
    median of `--repeats` passes), and each sequence's reward."""
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    pad = int(model.config.pad_token_id)
    rewards: list[float] = []

    def run(chunk: list[list[int]]) -> list[float]:
        width = max(len(s) for s in chunk)
        ids = torch.full((len(chunk), width), pad)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, s in enumerate(chunk):
            ids[row, width - len(s) :] = torch.tensor(s)
            mask[row, width - len(s) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        return model(ids, attention_mask=mask, position_ids=positions).logits[:, 0].tolist()

    run(sequences[:batch])  # warm-up
    rates = []
    for _ in range(ARGS.repeats):
        rewards = []
        start = time.perf_counter()
        for i in range(0, len(sequences), batch):
            rewards += run(sequences[i : i + batch])
        rates.append(len(sequences) / (time.perf_counter() - start))
    return statistics.median(rates), rewards


def main() -> None:
    if ARGS.part in ("throughput", "all"):
        throughput()
    if ARGS.part == "learning" or (ARGS.part == "all" and not ARGS.quick):
        learning()
    if ARGS.part == "footprint" or (ARGS.part == "all" and not ARGS.quick):
        footprint()


def throughput() -> None:
    output: Path = ARGS.output
    quick = ARGS.quick
    hidden, layers = (64, 2) if quick else (512, 6)
    requests, tokens = (16, 32) if quick else (ARGS.requests, ARGS.tokens)
    path = reward_model(output, hidden, layers)
    generator = torch.Generator().manual_seed(0)
    sequences = [
        torch.randint(0, 256, (tokens,), generator=generator).tolist() for _ in range(requests)
    ]
    env = {
        "RLSERVE_STORAGE__DATA_DIR": str(output / ".data"),
        "RLSERVE_MODELS__BACKEND": "transformers",
        "RLSERVE_MODELS__LOAD_REFERENCE": "false",
        "RLSERVE_MODELS__REWARD_MODEL": str(path),
        "RLSERVE_BATCHING__MAX_BATCH_SIZE": "32",
    }
    served: dict[int, Any] = {}
    with running_server(env=env, log=output / ".reward_model-server.log") as server:
        bodies = [{"tokens": [s]} for s in sequences]
        asyncio.run(drive(server.url, "/v1/rewards", bodies, max(CLIENTS), tokens))  # warm-up
        for clients in CLIENTS:
            # (the median pass of `--repeats`: one pass varies by a tenth on a shared CPU)
            passes = [
                asyncio.run(drive(server.url, "/v1/rewards", bodies, clients, tokens)).as_dict()
                for _ in range(ARGS.repeats)
            ]
            passes.sort(key=lambda figures: figures["requests_per_s"])
            served[clients] = passes[len(passes) // 2]
        answer = httpx.post(f"{server.url}/v1/rewards", json={"tokens": sequences}, timeout=600)
        server_rewards = [o["reward"] for o in answer.json()["outputs"]]
    results: dict[str, Any] = {
        "model": f"random-weights Qwen2 reward model, hidden {hidden}, {layers} layers, "
        "float32, CPU",
        "workload": {"requests": requests, "tokens_per_request": tokens},
        "rlserve": served,
        "in_process_rewards_per_s": {},
        "rlserve_over_in_process": {},
    }
    for clients in CLIENTS:
        rate, local = in_process(path, sequences, clients)
        results["in_process_rewards_per_s"][clients] = round(rate, 3)
        ratio = served[clients]["requests_per_s"] / rate
        results["rlserve_over_in_process"][clients] = round(ratio, 3)
        worst = max(abs(a - b) for a, b in zip(server_rewards, local, strict=True))
        assert worst <= 1e-5, f"served rewards differ from in-process by {worst}"
    results["max_abs_diff_vs_in_process"] = worst
    print(json.dumps(results, indent=1))
    name = "reward_model-quick.json" if quick else "reward_model.json"
    (output / name).write_text(json.dumps(results, indent=1) + "\n")


Labelled = tuple[list[dict[str, str]], str, bool]  # a conversation, its sum, right or not


@torch.inference_mode()
def sampled_replies(
    model: Any, tokenizer: Any, problems: list[Problem], per_prompt: int, seed: int
) -> list[Labelled]:
    """SmolLM2's replies at temperature 1 (what GRPO shows the reward model), each conversation
    with its sum and whether the reply ends on it."""
    torch.manual_seed(seed)
    out = []
    for problem in problems:
        chat = [{"role": "user", "content": problem.query}]
        ids = tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        replies = model.generate(
            torch.tensor([ids]),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=ARGS.max_new_tokens,
            num_return_sequences=per_prompt,
            pad_token_id=tokenizer.pad_token_id,
        )
        answer = problem.answer or ""
        for row in replies[:, len(ids) :].tolist():
            text = tokenizer.decode(row, skip_special_tokens=True)
            out.append(
                ([*chat, {"role": "assistant", "content": text}], answer, ends_on(text, answer))
            )
    return out


@torch.inference_mode()
def features(model: Any, tokenizer: Any, chats: list[list[dict[str, str]]]) -> torch.Tensor:
    """The base model's last hidden state where the reward model reads a conversation (its last
    token), in batches padded on the right (a causal model's states before the padding are
    those of the sequence alone)."""
    encoded = [tokenizer.apply_chat_template(c, tokenize=True, return_dict=False) for c in chats]
    rows = []
    for i in range(0, len(encoded), 16):
        chunk = encoded[i : i + 16]
        ids, mask = padded(chunk, 0, torch.device("cpu"), left=False)
        hidden = model.model(ids, attention_mask=mask).last_hidden_state
        rows.append(hidden[torch.arange(len(chunk)), mask.sum(-1) - 1])
    return torch.cat(rows) if rows else torch.zeros((0, model.config.hidden_size))


def counterfactuals(labelled: list[Labelled], rng: random.Random) -> list[Labelled]:
    """Each reply that ends on a number, with that number replaced by the right sum and by a
    wrong one."""
    out = []
    for chat, answer, _ in labelled:
        text = chat[-1]["content"]
        numbers = list(NUMBER.finditer(text))
        if not numbers:
            continue
        last = numbers[-1]
        right = int(ground_truth(answer))
        wrong = right + rng.choice([-3, -2, -1, 1, 2, 3])
        for value, label in ((right, True), (wrong, False)):
            changed = text[: last.start()] + str(value) + text[last.end() :]
            out.append(([*chat[:-1], {"role": "assistant", "content": changed}], answer, label))
    return out


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float | None:
    """How often a right reply outscores a wrong one (what a group's ranking needs)."""
    right, wrong = scores[labels > 0], scores[labels == 0]
    if not len(right) or not len(wrong):
        return None
    return float((right[:, None] > wrong[None, :]).float().mean())


class ScoreHead:
    """A score head on SmolLM2's frozen last hidden state, fit to its replies' correctness
    (balanced logistic regression), and refit as labelled replies are added. Each reply added
    comes twice more, its last number made right and made wrong: pairs that differ in the
    answer alone, so the head cannot score a reply's form instead of its sum."""

    def __init__(self, base: Any, tokenizer: Any) -> None:
        self.base, self.tokenizer = base, tokenizer
        self.rng = random.Random(7)
        self.x = torch.zeros((0, base.config.hidden_size))
        self.y = torch.zeros(0)
        self.weight = torch.zeros(base.config.hidden_size)

    def labelled(self, replies: list[Labelled]) -> tuple[torch.Tensor, torch.Tensor]:
        x = features(self.base, self.tokenizer, [chat for chat, _, _ in replies])
        return x, torch.tensor([float(right) for _, _, right in replies])

    def add(self, replies: list[Labelled], known: torch.Tensor | None = None) -> None:
        """`replies` and their counterfactuals; `known`: the replies' features, when they were
        taken already."""
        if known is None:
            known, _ = self.labelled(replies)
        x, y = self.labelled(counterfactuals(replies, self.rng))
        right = torch.tensor([float(right) for _, _, right in replies])
        self.x, self.y = torch.cat([self.x, known, x]), torch.cat([self.y, right, y])

    def fit(self) -> None:
        x, y = self.x, self.y
        mean, std = x.mean(0), x.std(0) + 1e-6
        weight, bias = (
            torch.zeros(x.shape[1], requires_grad=True),
            torch.zeros(1, requires_grad=True),
        )
        optimizer = torch.optim.Adam([weight, bias], lr=1e-2)
        positive = float(y.mean())
        balance = torch.where(y > 0, 0.5 / max(positive, 1e-3), 0.5 / max(1 - positive, 1e-3))
        for _ in range(400):
            optimizer.zero_grad()
            logits = ((x - mean) / std) @ weight + bias
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y, balance)
            (loss + 1e-3 * weight.square().sum()).backward()
            optimizer.step()
        # The head reads the raw hidden state: fold the standardisation into its weights (the
        # reward model's head has no bias: a constant would not change a group's advantages).
        self.weight = (weight / std).detach()

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def train_reward_model(output: Path) -> tuple[Path, ScoreHead, dict[str, Any]]:
    """SmolLM2 with a score head fit to its own replies' correctness; its folder, the head (to
    refit) and the fit's figures (its held-out AUC)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = smollm2_dir(Settings().models)
    tokenizer = AutoTokenizer.from_pretrained(source)
    base = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    start = time.perf_counter()
    problems = sum_problems(ARGS.rm_prompts, seed=7)
    labelled = sampled_replies(base, tokenizer, problems, 8, seed=7)
    cut = len(labelled) * 3 // 4  # (the last quarter's prompts are held out)
    head = ScoreHead(base, tokenizer)
    head.add(labelled[:cut])
    head.fit()
    x, y = head.labelled(labelled[cut:])
    with torch.no_grad():
        held = head.scores(x)
    reward = AutoModelForSequenceClassification.from_pretrained(
        source, num_labels=1, dtype=torch.float32
    )
    reward.score.weight.data = head.weight[None, :].clone()
    reward.config.pad_token_id = tokenizer.pad_token_id
    path = output / ".reward-smollm2"
    reward.save_pretrained(path)
    tokenizer.save_pretrained(path)
    fit = {
        "replies": len(head.y) + len(y),
        "right_share": float(torch.cat([head.y, y]).mean()),
        "held_out_auc": auc(held, y),
        "held_out_right_share": float(y.mean()),
        "seconds": time.perf_counter() - start,
    }
    print("reward model", json.dumps(fit), flush=True)
    return path, head, fit


class Refit:
    """`examples/grpo.py`'s `before_push`: every `every` steps, the head is fit again with the
    policy's latest replies added, each labelled by whether it ends on its sum (what a labeller
    would say of it), and the new head is loaded into the served reward model
    (`POST /v1/rewards/weights`, its `score.weight` alone) before the next batch is sampled.
    Each step also records how well the served head ranks the policy's replies (its AUC on
    them before any refit): how far the policy has moved off what the head was fit on."""

    def __init__(self, head: ScoreHead, folder: Path, every: int) -> None:
        self.head, self.folder, self.every = head, folder, every
        self.pending: list[Labelled] = []
        self.steps: list[dict[str, Any]] = []
        self.features: list[torch.Tensor] = []
        """Each step's replies as the head reads them."""

    def last_head_rewards(self) -> list[float]:
        """Each step's mean reward under the last head served: one scale for every step (the
        served reward changes scale at each refit)."""
        return [float(self.head.scores(x).mean()) for x in self.features]

    def __call__(self, client: Client, trajectories: list[Trajectory]) -> None:
        replies = []
        for trajectory in trajectories:
            (step,) = trajectory.steps
            answer = str(step.info["answer"])
            chat = [{"role": m.role, "content": str(m.content)} for m in trajectory.history or []]
            replies.append((chat, answer, ends_on(chat[-1]["content"], answer)))
        x, y = self.head.labelled(replies)
        self.features.append(x)
        record: dict[str, Any] = {"on_policy_auc": auc(self.head.scores(x), y)}
        self.pending += replies
        if self.every and len(self.steps) % self.every == self.every - 1:
            started = time.perf_counter()
            taken = self.features[-self.every :]
            self.head.add(self.pending, torch.cat(taken))
            self.pending = []
            self.head.fit()
            checkpoint = self.folder / f"score-{len(self.steps)}.safetensors"
            save_file({"score.weight": self.head.weight[None, :].contiguous()}, checkpoint)
            loaded = client.load_reward_weights(path=str(checkpoint))
            record |= {
                "refit_replies": len(self.head.y),
                "reward_version": loaded.reward_version,
                "refit_s": time.perf_counter() - started,
            }
        print("reward head", json.dumps(record), flush=True)
        self.steps.append(record)


def learning() -> None:
    output: Path = ARGS.output
    output.mkdir(parents=True, exist_ok=True)
    path, head, fit = train_reward_model(output)
    argv = ["--steps", str(ARGS.steps), "--reward", "model"]
    served = {"RLSERVE_MODELS__REWARD_MODEL": str(path)}
    if ARGS.kl_coeff:
        argv += ["--kl-coeff", str(ARGS.kl_coeff)]
        served["RLSERVE_MODELS__LOAD_REFERENCE"] = "true"
    args = arguments(argv)
    refit = Refit(head, path, ARGS.refit_every)
    records = train_rlserve(args, output, served, name="reward_learning", before_push=refit)
    last_head = refit.last_head_rewards()
    for record, head_record, reward in zip(records, refit.steps, last_head, strict=True):
        record |= head_record | {"last_head_reward": reward}

    report = {
        "model": "SmolLM2-135M-Instruct policy; reward model: SmolLM2 with a score head fit "
        "here, served with --reward-model; 2-core CPU",
        "reward_model_fit": fit,
        "refit_every": ARGS.refit_every,
        "hyper_parameters": {k: v for k, v in vars(args).items() if k not in ("url", "log")},
        "served_reward": thirds([r["reward"] for r in records]),
        "last_head_reward": thirds(last_head),
        "exact_answer_rate": thirds([r["exact"] for r in records]),
        "wall_s": sum(r["step_s"] for r in records),
        "steps": records,
    }
    name = "reward_model_learning" + ("" if ARGS.refit_every else "-fit_once")
    name += "" if ARGS.kl_coeff else "-no_kl"
    (output / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "steps"}, indent=1))


def footprint() -> None:
    """Start time (to /ready) and resident memory of a server with one, two, three and four
    models: SmolLM2 as the policy, its reference, the reward model fit by `learning` (fit now
    when it is not there), and SmolLM2 again as the judge model."""
    output: Path = ARGS.output
    path = output / ".reward-smollm2"
    if not (path / "config.json").exists():
        path, _, _ = train_reward_model(output)
    smollm2_dir(Settings().models)  # (converted once, not charged to the first start)
    base = {"RLSERVE_MODELS__BACKEND": "transformers"}
    configurations = {
        "policy": {"RLSERVE_MODELS__LOAD_REFERENCE": "false"},
        "policy + reference": {},
        "policy + reference + reward model": {"RLSERVE_MODELS__REWARD_MODEL": str(path)},
        "policy + reference + reward model + judge model": {
            "RLSERVE_MODELS__REWARD_MODEL": str(path),
            "RLSERVE_MODELS__JUDGE_MODEL": DEFAULT_MODEL,
        },
    }
    figures: dict[str, Any] = {}
    for name, env in configurations.items():
        env = {**base, **env, "RLSERVE_STORAGE__DATA_DIR": str(output / ".data-footprint")}
        log = output / ".reward_footprint-server.log"
        with running_server("--model", DEFAULT_MODEL, env=env, log=log, ready_timeout=600) as s:
            models = httpx.get(f"{s.url}/v1/models", timeout=60).json()["data"]
            figures[name] = {
                "models": sorted(card["id"] for card in models),
                "start_s": round(s.startup_seconds, 2),
                "rss_mib": round(rss_bytes(s.process.pid) / 2**20, 1),
            }
        print("footprint", name, json.dumps(figures[name]), flush=True)
    report = {
        "machine": "2-core CPU, float32, transformers backend",
        "models": "SmolLM2-135M-Instruct (policy, reference, judge); the reward model: "
        "SmolLM2-135M with a score head",
        "servers": figures,
    }
    (output / "reward_model_footprint.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    parser = bench_arguments(__doc__)
    parser.add_argument(
        "--part", choices=["throughput", "learning", "footprint", "all"], default="all"
    )
    parser.add_argument("--steps", type=int, default=40, help="GRPO steps (learning)")
    parser.add_argument("--rm-prompts", type=int, default=64, help="prompts to fit the head on")
    parser.add_argument(
        "--refit-every",
        type=int,
        default=3,
        help="refit the head on the policy's latest replies every N GRPO steps (0: fit once)",
    )
    parser.add_argument(
        "--kl-coeff",
        type=float,
        default=0.1,
        help="the rewards' KL penalty to the served reference (0: none)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument(
        "--repeats", type=int, default=3, help="passes per figure (throughput: the median)"
    )
    parser.add_argument("--tokens", type=int, default=256)
    ARGS = parser.parse_args()
    main()
