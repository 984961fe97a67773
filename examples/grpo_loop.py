"""A GRPO loop against a running rlserve server.

The server generates and scores; this process holds a copy of the policy, learns from the
collected groups and pushes its weights back. Each iteration:

1. `collect` groups of episodes on the bundled arithmetic dataset (`repeats` = group size),
2. compute group-normalised advantages (TorchRL `MCAdvantage`),
3. take clipped policy-gradient steps, using the log-probs the server returned while
   sampling as the behaviour log-probs,
4. push the new weights with `upload_weights` and check the policy version advanced and the
   server now scores exactly like the local copy.

The reward is the environment's GSM8K reward plus a small bonus for digits in the reply, so
a random-weights demo model still gets a learning signal.

    RLSERVE_URL=http://127.0.0.1:8000 python examples/grpo_loop.py --iterations 3
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
from rlserve_client import AsyncClient, collect
from rlserve_client.types import RolloutResult, Trajectory
from safetensors.torch import save
from tensordict import TensorDictBase
from transformers import AutoModelForCausalLM


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="default: RLSERVE_URL or 127.0.0.1:8000")
    parser.add_argument(
        "--model",
        default=None,
        help="local copy of the policy (default: "
        "the path the server reports, when it is on this host)",
    )
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--groups", type=int, default=2, help="prompts per iteration")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--updates", type=int, default=2, help="optimizer steps per batch")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def shaped_reward(trajectory: Trajectory) -> float:
    """The environment's reward plus 0.1 x the share of digits in the last reply."""
    reply = trajectory.steps[-1].text.response if trajectory.steps[-1].text else ""
    digits = sum(c.isdigit() for c in reply or "") / max(len(reply or ""), 1)
    return trajectory.reward + 0.1 * digits


def advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    groups = rewards.view(-1, group_size)
    mean, std = groups.mean(1, keepdim=True), groups.std(1, keepdim=True).clamp_min(1e-6)
    return ((groups - mean) / std).flatten()


def response_log_probs(model: torch.nn.Module, td: TensorDictBase) -> torch.Tensor:
    """log p(token) of every response token, [num_steps, max_response_len] right-padded like
    the server's ("log_probs", "response")."""
    tokens, attention = td["tokens", "full"], td["masks", "all_attention_mask"]
    positions = (attention.long().cumsum(-1) - 1).clamp_min(0)  # prompts are left-padded
    logits = model(input_ids=tokens, attention_mask=attention.long(), position_ids=positions).logits
    log_probs = torch.log_softmax(logits[:, :-1].float(), -1)
    per_token = log_probs.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    num_prompt = td["tokens", "prompt"].shape[-1]
    return per_token[:, num_prompt - 1 :]  # position t predicts token t + 1


def policy_gradient_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, td: TensorDictBase, clip: float
) -> tuple[float, float]:
    """One clipped-ratio step; returns the loss and max |log-prob drift| vs the behaviour."""
    num_response = td["masks", "all_assistant_mask"].sum(-1)
    width = td["log_probs", "response"].shape[-1]
    mask = torch.arange(width)[None, :] < num_response[:, None]
    behaviour = td["log_probs", "response"]
    current = response_log_probs(model, td)
    ratio = torch.exp(current - behaviour)
    advantage = td["advantage"]
    objective = torch.minimum(ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage)
    loss = -(objective * mask).sum() / mask.sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    drift = ((current - behaviour).abs() * mask).max().item()
    return loss.item(), drift


async def push_and_check(
    api: AsyncClient, model: torch.nn.Module, td: TensorDictBase, version: int
) -> int:
    """Upload every tensor; the version must advance and the server must score like `model`."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    updated = await api.upload_weights(payload=save(state))
    assert updated.policy_version == version + 1, (updated.policy_version, version)
    full = td["tokens", "full"][0][td["masks", "all_attention_mask"][0]]
    served = (await api.logprobs(tokens=[full.tolist()])).outputs[0].log_probs
    with torch.no_grad():
        local = torch.log_softmax(model(full[None]).logits[0, :-1].float(), -1)
        local = local.gather(-1, full[1:, None]).squeeze(-1)
    gap = (torch.tensor((served.full if served else [])[1:]) - local).abs().max().item()
    assert gap < 1e-3, f"the server scores differently from the pushed weights ({gap})"
    return updated.policy_version


async def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    async with AsyncClient(base_url=args.url) as api:
        await api.ready()
        source = args.model or (await api.models()).models[0].source
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        version = (await api.weights_version()).policy_version
        batch_size = args.groups * args.group_size
        env = {
            "dataset": "arithmetic",
            "reward": "gsm8k",
            "batch_size": batch_size,
            "repeats": args.group_size,
            "max_turns": 1,
            "seed": args.seed,
        }
        generation = {"max_new_tokens": args.max_new_tokens, "temperature": 1.0}
        print(f"policy {source} at version {version}; {args.groups} groups of {args.group_size}")
        for iteration in range(args.iterations):
            started = time.perf_counter()
            batches: list[RolloutResult] = [
                b
                async for b in collect(
                    api, env=env, total_dialog_turns=batch_size, generation=generation
                )
            ]
            trajectories = [t for b in batches for t in b.trajectories][:batch_size]
            rewards = torch.tensor([shaped_reward(t) for t in trajectories])
            result = RolloutResult(
                trajectories=trajectories,
                num_dialog_turns=batch_size,
                policy_version=version,
                pad_token_id=batches[0].pad_token_id,
            )
            td = result.to_tensordict()
            td["advantage"] = advantages(rewards, args.group_size)[:, None]
            assert all(s.policy_version == version for t in trajectories for s in t.steps)
            for update in range(args.updates):
                loss, drift = policy_gradient_step(model, optimizer, td, args.clip)
                if update == 0:  # server log-probs are this model's own, before any step
                    assert drift < 1e-3, f"behaviour log-probs drift {drift}"
            version = await push_and_check(api, model, td, version)
            print(
                f"iteration {iteration}: {len(trajectories)} episodes, "
                f"mean reward {rewards.mean():.4f}, loss {loss:+.4f}, "
                f"policy_version -> {version} ({time.perf_counter() - started:.1f} s)"
            )


if __name__ == "__main__":
    asyncio.run(main())
