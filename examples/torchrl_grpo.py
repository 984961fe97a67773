"""TorchRL's GRPO loop (sota-implementations/grpo) with rlserve as the inference engine.

The same TorchRL classes as the recipe, used the same way: `ChatEnv` over a dataloader with
`repeats` (GRPO groups), `LLMCollector`, a `ReplayBuffer` with `MCAdvantage` applied on write,
`GRPOLoss` on a local `TransformersWrapper` (tokens mode, as the recipe trains), optionally
`RetrieveKL` against the served reference model. What changes is how the policy and the weight
updater are built: `RemotePolicy` in place of `vLLMWrapper`, `RLServeWeightUpdater` in place of
the vLLM weight sender. Every other difference from the recipe, and why, is listed in
docs/guides/torchrl.md.

With `--max-staleness N > 0` collection runs ahead of the trainer (`AsyncLLMCollector`) and the
loss is decoupled PPO: `GRPOLoss` with its ratio taken against the trainer's own log-probs
before the update (the proximal policy) and each token's advantage multiplied by
`exp(proximal - behaviour)`, the importance weight of the policy version that sampled it.

    ./scripts/serve.sh &          # SmolLM2-135M-Instruct (with a reference copy)
    .venv-torchrl/bin/python examples/torchrl_grpo.py --steps 20
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from rlserve_client import Client
from rlserve_client.policy import RemotePolicy
from rlserve_client.torchrl_async import AsyncLLMCollector
from rlserve_client.torchrl_weights import RLServeWeightUpdater
from tensordict import TensorDict, TensorDictBase, set_list_to_stack
from torch.utils.data import DataLoader
from torchrl.collectors.llm import LLMCollector
from torchrl.data import LazyStackStorage, ReplayBuffer, SamplerWithoutReplacement
from torchrl.envs import StepCounter, Transform
from torchrl.envs.llm import ChatEnv
from torchrl.envs.llm.transforms.kl import RetrieveKL
from torchrl.modules.llm import TransformersWrapper
from torchrl.objectives.llm import GRPOLoss, MCAdvantage
from transformers import AutoModelForCausalLM, AutoTokenizer

NUMBER = re.compile(r"-?\d+")


def arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="default: RLSERVE_URL or 127.0.0.1:8000")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=2, help="GRPO groups per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--kl-coeff", type=float, default=0.0, help="RetrieveKL to the reference")
    parser.add_argument("--max-staleness", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", type=Path, help="append one JSON line per step here")
    return parser.parse_args(argv)


def addition_rows(seed: int, count: int = 512) -> list[dict[str, str]]:
    """The bundled `addition` task's kind of rows: "What is 7 + 5?" and the sum."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append({"query": f"What is {a} + {b}?", "answer": str(a + b)})
    return rows


class LastNumberReward(Transform):
    """Reward 1.0 when the reply's last number is the answer (rlserve's `number` reward)."""

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        replies = tensordict.get(("text", "response")).tolist()  # strings, not NonTensorData
        answers = tensordict.get("answer").tolist()
        reward = torch.zeros(len(replies), 1, 1)
        for i, (reply, answer) in enumerate(zip(replies, answers, strict=True)):
            numbers = NUMBER.findall(reply)
            reward[i] = float(bool(numbers) and numbers[-1] == str(answer))
        next_tensordict.set("reward", reward.view(*next_tensordict.batch_size, 1, 1))
        return next_tensordict

    def transform_reward_spec(self, reward_spec: Any) -> Any:
        return reward_spec


def make_env(tokenizer: Any, args: argparse.Namespace) -> ChatEnv:
    def collate(rows: list[dict[str, str]]) -> TensorDict:
        return torch.stack([TensorDict.from_dict(r) for r in rows])

    loader = DataLoader(
        addition_rows(args.seed),
        batch_size=1,
        shuffle=True,
        collate_fn=collate,
        generator=torch.Generator().manual_seed(args.seed),
    )
    env = ChatEnv.from_dataloader(
        loader,
        batch_size=(args.group_size,),
        repeats=args.group_size,
        tokenizer=tokenizer,
        input_mode="history",
    )
    env.append_transform(LastNumberReward())
    env.append_transform(StepCounter(max_steps=1))  # single-turn episodes, as the recipe's
    return env


def make_buffer(args: argparse.Namespace) -> ReplayBuffer:
    """The recipe's buffer: MCAdvantage applied on write, micro-batches without replacement."""
    return ReplayBuffer(
        storage=LazyStackStorage(args.prompts * args.group_size),
        sampler=SamplerWithoutReplacement(),
        transform=MCAdvantage(grpo_size=args.group_size),
        batch_size=args.micro_batch,
    )


def make_kl(client: Client, args: argparse.Namespace) -> RetrieveKL | None:
    """Log-probs of the reference model (served by rlserve) for the loss's KL term (the
    recipe's `kl_coef_in_loss`), scored on the exact sampled tokens; None without
    `--kl-coeff`."""
    if args.kl_coeff <= 0:
        return None
    full = ("tokens", "full")
    scorer = RemotePolicy(client, generate=False, input_mode="tokens", input_key=full)
    reference = RemotePolicy(
        client, model="reference", generate=False, input_mode="tokens", input_key=full
    )
    return RetrieveKL(scorer, reference, add_to_reward=False, assistant_only=False)


def decoupled_advantage(batch: TensorDictBase, actor: TransformersWrapper) -> None:
    """Decoupled PPO through GRPOLoss: write the trainer's log-probs before the update as the
    proximal policy (the ratio's denominator) and multiply each token's advantage by
    exp(proximal - behaviour). min(r*wA, clip(r)*wA) = w*min(r*A, clip(r)*A) since w >= 0."""
    with torch.no_grad():
        scored = actor(batch.select(("tokens", "full"), ("masks", "all_attention_mask")).copy())
    proximal = scored.get(("log_probs", "full"), as_padded_tensor=True, padding_side="left")
    behaviour = batch.get(
        ("log_probs", "full"), as_padded_tensor=True, padding_side="left", padding_value=0.0
    )
    weights = torch.exp(proximal - behaviour).nan_to_num(0.0)
    advantage = batch.get("advantage", as_padded_tensor=True).reshape(len(weights), 1)
    batch.set(("proximal", "full"), proximal)
    batch.set("advantage", (weights * advantage).unsqueeze(-1))


def train(client: Client, args: argparse.Namespace) -> Iterator[dict[str, float]]:
    torch.manual_seed(args.seed)
    source = next(m.source for m in client.models().models if m.name == "policy")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source)
    actor = TransformersWrapper(
        model, tokenizer=tokenizer, input_mode="tokens", generate=False, pad_output=False
    )
    actor.eval()  # as the recipe: no dropout in the scored forward
    loss_fn = GRPOLoss(
        actor,
        clip_epsilon=args.clip,
        entropy_coeff=0.0,
        kl_to_ref_coeff=args.kl_coeff or None,
        masking_strategy="sft",
    )
    if args.max_staleness > 0:
        loss_fn.set_keys(sample_log_prob=("proximal", "full"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    samples = args.prompts * args.group_size
    policy = RemotePolicy(
        client,
        input_mode="history",
        versions_key="token_versions",
        generate_kwargs={"max_new_tokens": args.max_new_tokens, "temperature": 1.0},
    )
    updater = RLServeWeightUpdater(client, model=model)
    collector = LLMCollector(
        make_env(tokenizer, args),
        policy=policy,
        dialog_turns_per_batch=samples,
        weight_updater=updater,
        track_policy_version=True,
    )
    buffer = make_buffer(args)
    kl = make_kl(client, args)
    with AsyncLLMCollector(collector, client, max_staleness=args.max_staleness) as ahead:
        waited = time.perf_counter()
        for step, data in enumerate(ahead):
            wait_s = time.perf_counter() - waited
            started = time.perf_counter()
            data = data.reshape(-1)
            rewards = data.get(("next", "reward"), as_padded_tensor=True).flatten()
            if kl is not None:
                data = kl(data)
            buffer.extend(data)
            losses = []
            optimizer.zero_grad()
            for batch in buffer:
                if args.max_staleness > 0:
                    decoupled_advantage(batch, actor)
                out = loss_fn(batch)
                total = out.loss_objective
                if out.loss_kl_to_ref is not None:
                    total = total + out.loss_kl_to_ref
                loss = total * len(batch) / samples
                loss.backward()
                losses.append(loss.item())
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
            optimizer.step()
            buffer.empty()
            trained = time.perf_counter()
            ahead.update_policy_weights_()
            assert updater.last is not None
            yield {
                "step": step,
                "reward": rewards.mean().item(),
                "loss": sum(losses),
                "grad_norm": grad_norm,
                "policy_version": updater.last.policy_version,
                "collector_version": collector.policy_version,
                "samples": len(rewards),
                "wait_s": wait_s,
                "train_s": trained - started,
                "push_s": time.perf_counter() - trained,
            }
            if step + 1 == args.steps:
                break
            waited = time.perf_counter()
    updater.close()


def main(argv: Sequence[str] | None = None) -> None:
    args = arguments(argv)
    with set_list_to_stack(True), Client(base_url=args.url, timeout=600) as client:
        client.ready()
        for record in train(client, args):
            print(
                f"step {record['step']:3d}  reward {record['reward']:.3f}  "
                f"loss {record['loss']:+.4f}  version {record['policy_version']}",
                flush=True,
            )
            if args.log:
                with args.log.open("a") as sink:
                    sink.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
