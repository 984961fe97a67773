"""The host's share of the transformers backend's decode and scoring loops.

The model's forward is replaced by a precomputed answer of the right shape (logits for the
decode loop; hidden states and output-head logits for scoring), so what is timed is the work
around the forward: sampling, log-probs, stop checks, book-keeping, copies to the host. On a
GPU that work is host time plus kernel launches while the GPU waits.

Two vocabularies: 16 tokens (the arithmetic is negligible: what remains is the per-operation
and per-row overhead, the part a GPU cannot take over) and SmolLM2's 49,152 (here on the CPU
the full-vocabulary arithmetic is real compute, which a GPU does in microseconds). Prints
host milliseconds per decode step and per scored sequence at batch 1/8/32/64 and writes them
to `bench/results/decode_host.json` under `--label` (beside the labels already there).

    python bench/decode_host.py --label after [--quick]
"""

from __future__ import annotations

import json
import statistics
import time
from types import SimpleNamespace
from typing import Any

import torch
from common import bench_arguments

from app.engine.transformers import decode as hf_decode
from app.engine.types import GenerateItem, SamplingConfig, ScoreSpec

BATCHES = (1, 8, 32, 64)
VOCABS = {"overhead (vocab 16)": 16, "SmolLM2 (vocab 49152)": 49152}


class _Cache:
    """Stands for a key/value cache: the loop only reorders it (shared prompts)."""

    def reorder_cache(self, index: torch.Tensor) -> None:
        pass


class ReplayedModel(torch.nn.Module):
    """A causal LM whose forward answers from precomputed tensors (no model work): the
    decode loop's forwards get one position of logits per row, the scoring trunk hidden
    states, and its output head logits for up to `width` positions."""

    def __init__(
        self, vocab: int, device: torch.device, hidden: int = 64, rows: int = 64, width: int = 128
    ) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.config = SimpleNamespace()
        self.step = torch.randn(rows, 1, vocab, generator=generator).to(device)
        self.hidden = torch.randn(rows, width, hidden, generator=generator).to(device)
        self.head = _ReplayedHead(torch.randn(width, vocab, generator=generator).to(device))
        self.cache = _Cache()
        self._device = device

    @property
    def device(self) -> torch.device:
        return self._device

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool = True,
        logits_to_keep: int = 0,
    ) -> SimpleNamespace:
        if input_ids.shape[1] > 1 and logits_to_keep != 1:
            raise ValueError("replayed forwards answer the last position alone")
        logits = self.step[: input_ids.shape[0]]
        return SimpleNamespace(logits=logits, past_key_values=self.cache, cache=None)

    def get_decoder(self) -> Any:
        def decoder(input_ids: torch.Tensor, **_: Any) -> tuple[torch.Tensor]:
            rows, width = input_ids.shape
            return (self.hidden[:rows, :width],)

        return decoder

    def get_output_embeddings(self) -> Any:
        return self.head


class _ReplayedHead:
    """The output head: logits for up to `width` positions of hidden states."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits
        self.weight = torch.empty(logits.shape[-1], 1)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits[: hidden.shape[0]]


def _timed(fn: Any, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_step_ms(model: ReplayedModel, batch: int, steps: int, repeats: int) -> float:
    """Host ms per decode step: sampled rows (temperature 1), distinct prompts of 16 tokens."""
    config = SamplingConfig(max_new_tokens=steps, ignore_eos=True)
    items = [
        GenerateItem(prompt_ids=tuple(range(row, row + 16)), config=config, seed=row)
        for row in range(batch)
    ]

    def run() -> None:
        hf_decode.generate(model, items, pad_id=0, eos_ids=frozenset({1}), decode=lambda ids: "")

    # The prefill (one forward, its logits) is timed with a one-token generation and taken off.
    one = [GenerateItem(i.prompt_ids, SamplingConfig(1, ignore_eos=True), i.seed) for i in items]
    prefill = _timed(
        lambda: hf_decode.generate(
            model, one, pad_id=0, eos_ids=frozenset({1}), decode=lambda ids: ""
        ),
        repeats,
    )
    return (_timed(run, repeats) - prefill) / (steps - 1) * 1000


def score_ms(model: ReplayedModel, batch: int, length: int, repeats: int) -> float:
    """Host ms per scored sequence (log-probs alone, `length` tokens each)."""
    vocab = model.head.logits.shape[-1]
    items = [([(row * 7 + t) % vocab for t in range(length)], ScoreSpec()) for row in range(batch)]
    seconds = _timed(lambda: hf_decode.score_detailed(model, items, pad_id=0), repeats)
    return seconds / batch * 1000


def main() -> None:
    parser = bench_arguments(__doc__)
    parser.add_argument("--label", default="now", help="the key the figures go under")
    parser.add_argument("--device", type=torch.device, default=torch.device("cpu"))
    args = parser.parse_args()
    out = args.output / ("decode_host-quick.json" if args.quick else "decode_host.json")
    steps, repeats = (6, 2) if args.quick else (32, 5)
    figures: dict[str, Any] = {
        "device": str(args.device),
        "threads": torch.get_num_threads(),
        "steps": steps,
    }
    if args.device.type == "cuda":
        figures["device_name"] = torch.cuda.get_device_name(args.device)
    for name, vocab in VOCABS.items():
        model = ReplayedModel(vocab, args.device)
        # (three significant figures: a fixed number of decimals rounds a fast path to 0)
        decode = {b: float(f"{decode_step_ms(model, b, steps, repeats):.3g}") for b in BATCHES}
        score = {b: float(f"{score_ms(model, b, 128, repeats):.3g}") for b in BATCHES}
        figures[name] = {"decode_step_ms": decode, "score_ms_per_sequence": score}
        print(f"{name}: host ms per decode step {decode}; per scored sequence {score}")
    results = json.loads(out.read_text()) if out.exists() else {}
    results[args.label] = figures
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"written to {out} under {args.label!r}")


if __name__ == "__main__":
    main()
