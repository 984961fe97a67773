"""How far the log-probs a token was sampled with are from `/v1/logprobs` of the same tokens,
on SmolLM2-135M-Instruct in float32, and where the difference comes from.

Both sides take a log-prob one way (`app.engine.distribution.log_probs_of`: logit minus
logsumexp), so what is left is the forward's own float32 rounding: decoding feeds one token at
a time against a key/value cache, scoring feeds the whole sequence, and a matrix product's bits
depend on its shape. The report sets that beside the float64 truth and beside transformers
itself:

- `sampled_vs_scored`: rlserve's decode loop (eager, and compiled over a static cache) against
  its scoring of each finished sequence alone, rows decoded alone and together;
- `*_vs_float64`: each side against the same forward in float64;
- `transformers_generate_vs_forward`: `generate(output_logits=True)`'s log-probs against
  one forward of the finished sequence, the same arithmetic on both sides;
- `float32_trunk_vs_float64`: the float64 output head and logsumexp over the float32 trunk's
  hidden states, against float64 throughout: what computing only the log-prob more exactly
  could gain.

Maximum absolute differences over every generated token. Writes
`bench/results/sampled_vs_scored.json`.

    python bench/sampled_vs_scored.py [--quick]
"""

from __future__ import annotations

import json
from typing import Any

import torch
from common import bench_arguments

from app.config import Settings
from app.engine.distribution import log_probs_of
from app.engine.loader import resolve_model
from app.engine.transformers import decode as hf_decode
from app.engine.transformers.compiled import CompiledDecode
from app.engine.types import GenerateItem, SamplingConfig

QUESTIONS = [
    "What is 17 times 23?",
    "Name three rivers in Europe.",
    "Write a haiku about rain.",
    "Explain gravity briefly.",
    "Give me a word that rhymes with orange.",
    "What is the capital of Australia?",
]


def worst(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    return max(float((a.double() - b.double()).abs().max()) for a, b in pairs)


@torch.inference_mode()
def forward_scores(model: Any, sequence: list[int], start: int) -> torch.Tensor:
    """Log-probs of `sequence[start:]` from one forward, computed as rlserve computes them."""
    ids = torch.tensor([sequence])
    logits = model(input_ids=ids).logits[0, start - 1 : -1]
    return log_probs_of(logits.to(torch.promote_types(logits.dtype, torch.float32)), ids[0, start:])


@torch.inference_mode()
def trunk_in_float32(model: Any, model64: Any, sequence: list[int], start: int) -> torch.Tensor:
    """The float32 trunk's last hidden states through the float64 head and logsumexp."""
    ids = torch.tensor([sequence])
    hidden = model.get_decoder()(input_ids=ids)[0][0, start - 1 : -1]
    logits = model64.get_output_embeddings()(hidden.double())
    return log_probs_of(logits, ids[0, start:])


def main() -> None:
    parser = bench_arguments(__doc__)
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    new_tokens = 12 if args.quick else args.new_tokens
    questions = QUESTIONS[:2] if args.quick else QUESTIONS
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model(Settings().models, "builtin:smollm2-135m-instruct")[0]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model64 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}],
                tokenize=True,
                add_generation_prompt=True,
                return_dict=True,
            )["input_ids"]
        )
        for q in questions
    ]
    items = [
        GenerateItem(tuple(p), SamplingConfig(max_new_tokens=new_tokens), seed=k)
        for k, p in enumerate(prompts)
    ]
    eos = frozenset({tokenizer.eos_token_id})

    def decode(batch: list[GenerateItem], compiled: CompiledDecode | None) -> list[Any]:
        return hf_decode.generate(
            model, batch, pad_id=0, eos_ids=eos, decode=tokenizer.decode, compiled=compiled
        )

    report: dict[str, Any] = {
        "model": "builtin:smollm2-135m-instruct",
        "dtype": "float32",
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "rows": len(items),
        "new_tokens": new_tokens,
    }
    compiled = CompiledDecode(model)
    runs = {
        "alone": [decode([item], None)[0] for item in items],
        "together": decode(items, None),
        "compiled_together": decode(items, compiled),
    }
    for name, generations in runs.items():
        sampled, scored, truth = [], [], []
        for prompt, generation in zip(prompts, generations, strict=True):
            sequence = prompt + generation.token_ids
            sampled.append(torch.tensor(generation.log_probs))
            scored.append(torch.tensor(hf_decode.score(model, [sequence], 0)[0][len(prompt) :]))
            truth.append(forward_scores(model64, sequence, len(prompt)))
        report[name] = {
            "sampled_vs_scored": worst(list(zip(sampled, scored, strict=True))),
            "sampled_vs_float64": worst(list(zip(sampled, truth, strict=True))),
            "scored_vs_float64": worst(list(zip(scored, truth, strict=True))),
        }
        print(name, report[name], flush=True)
    pairs, trunk = [], []
    for k, prompt in enumerate(prompts):
        torch.manual_seed(k)
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]),
                do_sample=True,
                top_k=0,
                max_new_tokens=new_tokens,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=tokenizer.eos_token_id,
            )
        new = out.sequences[0, len(prompt) :]
        sampled = log_probs_of(torch.stack(out.logits, 1)[0].float(), new)
        sequence = out.sequences[0].tolist()
        pairs.append((sampled, forward_scores(model, sequence, len(prompt))))
        truth = forward_scores(model64, sequence, len(prompt))
        trunk.append((trunk_in_float32(model, model64, sequence, len(prompt)), truth))
    report["transformers_generate_vs_forward"] = worst(pairs)
    report["float32_trunk_vs_float64"] = worst(trunk)
    print(json.dumps(report, indent=2))
    if not args.quick:
        path = args.output / "sampled_vs_scored.json"
        path.write_text(json.dumps(report, indent=2) + "\n")
        print("wrote", path)


if __name__ == "__main__":
    main()
