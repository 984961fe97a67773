"""GRPO through rlserve: the server samples and scores, this process learns and pushes weights.

Each step, one `/v1/rollouts` call runs `prompts` x `group_size` single-turn episodes of the
bundled `addition` task ("What is 7 + 5?", rewarded 1 when the reply ends on the right number)
and returns every reply's tokens, the raw log-probs it was sampled with, its reward and its
group-normalised advantage (TorchRL's MCAdvantage). The trainer takes one policy-gradient step
on a local copy of the policy (decoupled PPO: each token weighted by how much more likely the
trainer's weights make it than the weights that sampled it) and sends the new weights to the
server over a torch.distributed group (the collective transfer).

With `--max-staleness 0` the next batch is sampled by the weights just pushed (synchronous);
with 1 it is sampled while the trainer learns from this one (one-step-off), the push pausing
the server in 'keep' mode so replies in flight finish under the new weights.

    ./scripts/serve.sh &     # SmolLM2-135M-Instruct
    .venv/bin/python examples/grpo.py --steps 40 [--max-staleness 1] [--restore]
    .venv/bin/python examples/grpo.py --steps 40 --lora      # train a LoRA adapter instead
    python examples/grpo.py --device cuda --transport gloo  # trainer and server on one GPU

The trained weights stay on the server (every later request samples them) unless `--restore`
puts back the weights it started with when the run ends (`POST /v1/weights/restore`).

With `--lora` the trainer trains a LoRA adapter of the policy (PEFT, every linear layer): the
server serves it by name from its first push, samples the rollouts with it, and each step
pushes the adapter's tensors alone (`PUT /v1/adapters/{name}`: megabytes, no pause). The
policy itself is left as it was; the adapter is unloaded when the run ends.

The same loop without a server is `bench/learning.py --loop local`.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from rlserve_client import Client
from rlserve_client.async_collector import AsyncCollector
from rlserve_client.lora import adapter_file
from rlserve_client.offpolicy import decoupled_ppo_loss
from rlserve_client.types import Trajectory
from transformers import AutoModelForCausalLM

from app.envs.rewards import Sample, score_reward

# PEFT 0.21 reads an attribute transformers 5 deprecates: its warning says nothing to act on.
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")


@dataclass
class Rollout:
    """One sampled reply: what GRPO needs of it."""

    prompt: list[int]
    response: list[int]
    reward: float | None  # None: a judge gave no score (advantage 0: no gradient)
    advantage: float
    behaviour: list[float] | None = None  # log-probs the sampler saw; None: on-policy now
    exact: bool | None = None  # the reply ends on the right sum (when the server says the sum)


def arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="default: RLSERVE_URL or 127.0.0.1:8000")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=4, help="GRPO groups per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--lr", type=float, default=None, help="default: 3e-5, 2e-4 with --lora")
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter (PEFT)")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--lora-name", default="grpo-lora", help="the adapter's name on the server")
    parser.add_argument(
        "--reward",
        default="number",
        help="the episodes' reward: number (the reply's last number is the sum), model (the "
        "server's --reward-model), judge:NAME; besides another reward, each step also logs the "
        "exact-answer rate",
    )
    parser.add_argument(
        "--kl-coeff",
        type=float,
        default=None,
        help="subtract this times each reply's KL to the server's reference (k1, summed over "
        "its tokens) from its reward (the server must serve a reference)",
    )
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument(
        "--max-staleness",
        type=int,
        default=0,
        help="policy versions a sampled token may be behind the trainer (0: synchronous)",
    )
    parser.add_argument(
        "--weight-cap",
        type=float,
        default=None,
        help="leave out tokens whose importance weight exceeds this",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="the trainer's model (cuda, cuda:1, ...)")
    parser.add_argument(
        "--transport",
        default="auto",
        choices=["auto", "nccl", "gloo"],
        help="the collective transfer's (auto: nccl where CUDA is; one GPU holding both the "
        "trainer and the server needs gloo: NCCL takes one rank per device)",
    )
    parser.add_argument(
        "--restore",
        action="store_true",
        help="when done, serve again the weights the server started with",
    )
    parser.add_argument("--log", type=Path, help="append one JSON line per step here")
    parser.add_argument(
        "--fixed-length",
        action="store_true",
        help="every reply runs max_new_tokens, past end-of-sequence (timing at equal work)",
    )
    args = parser.parse_args(argv)
    if args.lr is None:
        args.lr = 2e-4 if args.lora else 3e-5
    return args


def response_log_probs(model: torch.nn.Module, rollouts: list[Rollout]) -> list[torch.Tensor]:
    """log p(token) of each reply's tokens under `model`: one right-padded forward through the
    decoder, then the output layer on the positions that predict reply tokens only."""
    rows = [r.prompt + r.response for r in rollouts]
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)], attention[i, : len(row)] = torch.tensor(row), 1
    device = next(model.parameters()).device
    ids, attention = ids.to(device), attention.to(device)
    if hasattr(model, "get_base_model"):  # a PEFT model: the transformers model it adapts
        model = model.get_base_model()
    hidden = model.base_model(input_ids=ids, attention_mask=attention).last_hidden_state
    # position t predicts the token at t + 1
    at = [
        (i, t) for i, r in enumerate(rollouts) for t in range(len(r.prompt) - 1, len(rows[i]) - 1)
    ]
    rows_at, positions = (torch.tensor(x, device=device) for x in zip(*at, strict=True))
    logits = model.get_output_embeddings()(hidden[rows_at, positions])
    tokens = ids[rows_at, positions + 1]
    picked = logits.gather(-1, tokens[:, None]).squeeze(-1) - logits.logsumexp(-1)
    return list(picked.split([len(r.response) for r in rollouts]))


def grpo_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rollouts: list[Rollout],
    clip: float,
    weight_cap: float | None = None,
) -> dict[str, float]:
    """One decoupled-PPO step over every reply token (token-mean loss): the importance weight
    of a token is exp(now - behaviour), 1 where the rollout has no behaviour log-probs
    (sampled by this very model)."""
    current = response_log_probs(model, rollouts)
    now = torch.cat(current)
    behaviour = torch.cat(
        [
            torch.tensor(r.behaviour, device=now.device) if r.behaviour is not None else lp.detach()
            for r, lp in zip(rollouts, current, strict=True)
        ]
    )
    advantages = torch.cat(
        [torch.full((len(r.response),), r.advantage, device=now.device) for r in rollouts]
    )
    out = decoupled_ppo_loss(
        now,
        now.detach(),
        behaviour,
        advantages,
        torch.ones_like(now, dtype=torch.bool),
        clip=clip,
        weight_cap=weight_cap,
    )
    optimizer.zero_grad()
    out.loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
    optimizer.step()
    return {
        "loss": out.loss.item(),
        "grad_norm": grad_norm,
        "behaviour_drift": (now.detach() - behaviour).abs().max().item(),
        "max_weight": out.max_weight,
        "capped_tokens": out.capped_tokens,
    }


def rollouts_of(trajectories: list[Trajectory]) -> list[Rollout]:
    """Single-turn episodes as GRPO rows: the server's tokens, log-probs and advantages."""
    out = []
    for trajectory in trajectories:
        (step,) = trajectory.steps
        assert step.log_probs is not None and step.log_probs.response is not None
        answer = step.info.get("answer")
        text = step.text.response if step.text else None
        out.append(
            Rollout(
                prompt=list(step.tokens.prompt or []),
                response=list(step.tokens.response or []),
                reward=step.reward,
                advantage=trajectory.advantage or 0.0,
                behaviour=list(step.log_probs.response),
                exact=None if answer is None or text is None else ends_on(text, answer),
            )
        )
    return out


def kl_of(trajectory: Trajectory) -> float | None:
    """The reply's KL to the reference its reward was penalised by (None: no penalty)."""
    reward = trajectory.steps[0].info.get("reward")
    value = reward.get("kl") if isinstance(reward, dict) else None
    return float(value) if isinstance(value, int | float) else None


def ends_on(text: str, answer: str) -> bool:
    """Whether the reply's last number is the answer (the server's `number` reward)."""
    return bool(score_reward("number", {}, Sample(text, answer)).info["correct"])


def mean(values: Sequence[float | bool | None]) -> float | None:
    known = [float(v) for v in values if v is not None]
    return sum(known) / len(known) if known else None


class FullWeights:
    """Pushes every weight of the model over the collective transfer."""

    def __init__(self, client: Client, transport: str = "auto") -> None:
        self.transfer = client.weight_transfer(transport=transport).open()
        self.model = "policy"

    def push(self, model: torch.nn.Module) -> int:
        return self.transfer.send(model).policy_version

    def close(self) -> None:
        self.transfer.close()


class Adapter:
    """A LoRA adapter of the policy, pushed as its tensors alone each step, with its config
    (`adapter_file`): the first push serves it by name, as version 0."""

    def __init__(self, client: Client, model: torch.nn.Module, name: str) -> None:
        self.client, self.model = client, name
        self.push(model)

    def push(self, model: torch.nn.Module) -> int:
        return self.client.push_adapter(name=self.model, payload=adapter_file(model)).version

    def close(self) -> None:
        self.client.unload_adapter(name=self.model)


def train(
    client: Client,
    args: argparse.Namespace,
    before_push: Callable[[list[Trajectory]], None] | None = None,
) -> Iterator[dict[str, float]]:
    """The loop: take a batch of groups, learn, push the weights; one record per step.
    `before_push` sees each batch's episodes once the step is taken and before the weights
    go (synchronously, the next batch is sampled after it returns: e.g. to refit a served
    reward model on the policy's latest replies)."""
    torch.manual_seed(args.seed)
    # The served folder, when the server runs on this host (else pass a copy of the policy).
    source = next(m.source for m in client.models().models if m.name == "policy")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).to(args.device)
    if args.lora:
        config = LoraConfig(
            r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules="all-linear"
        )
        model = get_peft_model(model, config)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    sync = (
        Adapter(client, model, args.lora_name) if args.lora else FullWeights(client, args.transport)
    )
    env: dict[str, object] = {
        "dataset": "addition",
        "reward": args.reward,
        "repeats": args.group_size,
        "max_turns": 1,
    }
    if args.kl_coeff is not None:
        env["kl"] = {"coeff": args.kl_coeff}
    generation = {
        "model": sync.model,
        "max_new_tokens": args.max_new_tokens,
        "temperature": 1.0,
        "ignore_eos": args.fixed_length,
    }
    collector = AsyncCollector(
        client,
        env=env,
        num_episodes=args.prompts * args.group_size,
        generation=generation,
        max_staleness=args.max_staleness,
        seed=args.seed * 100_003,  # batch j: seed + j, new prompts every step
    )
    try:
        with collector:
            for batch in collector.batches(args.steps):
                started = time.perf_counter()
                rollouts = rollouts_of(batch.trajectories)
                # (a reply a judge gave no score has no advantage: it is left out of the step)
                scored = [r for r in rollouts if r.reward is not None] or rollouts
                stats = grpo_step(model, optimizer, scored, args.clip, args.weight_cap)
                trained = time.perf_counter()
                if before_push is not None:
                    before_push(batch.trajectories)
                pushing = time.perf_counter()
                version = sync.push(model)
                staleness = batch.staleness()
                yield {
                    "step": batch.index,
                    "reward": mean([r.reward for r in rollouts]),
                    "exact": mean([r.exact for r in rollouts]),
                    "kl": mean([kl_of(t) for t in batch.trajectories]),
                    **stats,
                    "policy_version": version,
                    "response_tokens": sum(len(r.response) for r in rollouts),
                    "samples": len(rollouts),
                    "staleness_mean": sum(staleness) / len(staleness),
                    "dropped": batch.dropped,
                    "regenerated": batch.regenerated,
                    "wait_s": batch.wait_s,
                    "train_s": trained - started,
                    "before_push_s": pushing - trained,
                    "push_s": time.perf_counter() - pushing,
                    "step_s": time.perf_counter() - started + batch.wait_s,
                }
    finally:
        sync.close()


def main(argv: Sequence[str] | None = None) -> None:
    args = arguments(argv)
    with Client(base_url=args.url, timeout=600) as client:
        client.ready()
        if (version := client.weights_version().policy_version) != 0:
            replaced = (
                "an adapter of those" if args.lora else "those (its first push replaces them)"
            )
            print(
                f"note: the server serves policy version {version}, not the weights it started "
                f"with; this run trains {replaced}",
                flush=True,
            )
        for record in train(client, args):
            print(
                f"step {record['step']:3d}  reward {record['reward'] or 0:.3f}  "
                f"exact {record['exact'] or 0:.3f}  "
                f"loss {record['loss']:+.4f}  |logp - behaviour| {record['behaviour_drift']:.1e}"
                f"  version {record['policy_version']}  {record['step_s']:.1f} s",
                flush=True,
            )
            if args.log:
                with args.log.open("a") as sink:
                    sink.write(json.dumps(record) + "\n")
        if args.lora:
            print(f"unloaded the adapter {args.lora_name}; the policy is as it was")
        elif args.restore:
            restored = client.restore_weights()
            print(f"restored the starting weights as policy version {restored.policy_version}")
        else:
            version = client.weights_version().policy_version
            print(
                f"the server now serves the trained policy (version {version}) to every "
                "request; to serve the starting weights again: rerun with --restore, or "
                "client.restore_weights() (POST /v1/weights/restore)"
            )


if __name__ == "__main__":
    main()
