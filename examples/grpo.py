"""GRPO through rlserve: the server samples and scores, this process learns and pushes weights.

Each step, one `/v1/rollouts` call runs `prompts` x `group_size` single-turn episodes of the
bundled `addition` task ("What is 7 + 5?", rewarded 1 when the reply ends on the right number)
and returns every reply's tokens, the raw log-probs it was sampled with, its reward and its
group-normalised advantage (TorchRL's MCAdvantage). The trainer takes one clipped
policy-gradient step on a local copy of the policy and sends the new weights to the server
over a torch.distributed group (the collective transfer), so the next step samples from them.

    ./scripts/serve.sh &     # SmolLM2-135M-Instruct
    .venv/bin/python examples/grpo.py --steps 40

The same loop without a server is `bench/learning.py --loop local`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from rlserve_client import Client
from rlserve_client.types import RolloutResult
from transformers import AutoModelForCausalLM


@dataclass
class Rollout:
    """One sampled reply: what GRPO needs of it."""

    prompt: list[int]
    response: list[int]
    reward: float
    advantage: float
    behaviour: list[float] | None = None  # log-probs the sampler saw; None: on-policy now


def arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="default: RLSERVE_URL or 127.0.0.1:8000")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=4, help="GRPO groups per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", type=Path, help="append one JSON line per step here")
    parser.add_argument(
        "--fixed-length",
        action="store_true",
        help="every reply runs max_new_tokens, past end-of-sequence (timing at equal work)",
    )
    return parser.parse_args(argv)


def response_log_probs(model: torch.nn.Module, rollouts: list[Rollout]) -> list[torch.Tensor]:
    """log p(token) of each reply's tokens under `model`: one right-padded forward through the
    decoder, then the output layer on the positions that predict reply tokens only."""
    rows = [r.prompt + r.response for r in rollouts]
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)], attention[i, : len(row)] = torch.tensor(row), 1
    hidden = model.base_model(input_ids=ids, attention_mask=attention).last_hidden_state
    # position t predicts the token at t + 1
    at = [
        (i, t) for i, r in enumerate(rollouts) for t in range(len(r.prompt) - 1, len(rows[i]) - 1)
    ]
    rows_at, positions = (torch.tensor(x) for x in zip(*at, strict=True))
    logits = model.get_output_embeddings()(hidden[rows_at, positions])
    tokens = ids[rows_at, positions + 1]
    picked = logits.gather(-1, tokens[:, None]).squeeze(-1) - logits.logsumexp(-1)
    return list(picked.split([len(r.response) for r in rollouts]))


def grpo_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, rollouts: list[Rollout], clip: float
) -> dict[str, float]:
    """One clipped-ratio step over every reply token (token-mean loss); the ratio is against
    the behaviour log-probs, or 1 where the rollout has none (sampled by this very model)."""
    current = response_log_probs(model, rollouts)
    terms, drift = [], 0.0
    for r, now in zip(rollouts, current, strict=True):
        before = torch.tensor(r.behaviour) if r.behaviour is not None else now.detach()
        drift = max(drift, (now.detach() - before).abs().max().item())
        ratio = torch.exp(now - before)
        clipped = ratio.clamp(1 - clip, 1 + clip)
        terms.append(-torch.minimum(ratio * r.advantage, clipped * r.advantage))
    loss = torch.cat(terms).mean()
    optimizer.zero_grad()
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
    optimizer.step()
    return {"loss": loss.item(), "grad_norm": grad_norm, "behaviour_drift": drift}


def rollouts_of(result: RolloutResult) -> list[Rollout]:
    """Single-turn episodes as GRPO rows: the server's tokens, log-probs and advantages."""
    out = []
    for trajectory in result.trajectories:
        (step,) = trajectory.steps
        assert step.log_probs is not None and step.log_probs.response is not None
        out.append(
            Rollout(
                prompt=list(step.tokens.prompt or []),
                response=list(step.tokens.response or []),
                reward=step.reward,
                advantage=trajectory.advantage or 0.0,
                behaviour=list(step.log_probs.response),
            )
        )
    return out


def train(client: Client, args: argparse.Namespace) -> Iterator[dict[str, float]]:
    """The loop: sample groups on the server, learn, push the weights; one record per step."""
    torch.manual_seed(args.seed)
    # The served folder, when the server runs on this host (else pass a copy of the policy).
    source = next(m.source for m in client.models().models if m.name == "policy")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    with client.weight_transfer() as sync:
        for step in range(args.steps):
            started = time.perf_counter()
            env = {
                "dataset": "addition",
                "reward": "number",
                "batch_size": args.prompts * args.group_size,
                "repeats": args.group_size,
                "max_turns": 1,
                "seed": args.seed * 100_003 + step,  # new prompts every step
            }
            generation = {
                "max_new_tokens": args.max_new_tokens,
                "temperature": 1.0,
                "ignore_eos": args.fixed_length,
                "seed": env["seed"],
            }
            result = client.rollouts(env=env, num_episodes=env["batch_size"], generation=generation)
            sampled = time.perf_counter()
            rollouts = rollouts_of(result)
            stats = grpo_step(model, optimizer, rollouts, args.clip)
            trained = time.perf_counter()
            updated = sync.send(model)
            yield {
                "step": step,
                "reward": sum(r.reward for r in rollouts) / len(rollouts),
                **stats,
                "policy_version": updated.policy_version,
                "response_tokens": sum(len(r.response) for r in rollouts),
                "sample_s": sampled - started,
                "train_s": trained - sampled,
                "push_s": time.perf_counter() - trained,
                "step_s": time.perf_counter() - started,
            }


def main(argv: Sequence[str] | None = None) -> None:
    args = arguments(argv)
    with Client(base_url=args.url, timeout=600) as client:
        client.ready()
        for record in train(client, args):
            print(
                f"step {record['step']:3d}  reward {record['reward']:.3f}  "
                f"loss {record['loss']:+.4f}  |logp - behaviour| {record['behaviour_drift']:.1e}"
                f"  version {record['policy_version']}  {record['step_s']:.1f} s",
                flush=True,
            )
            if args.log:
                with args.log.open("a") as sink:
                    sink.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
