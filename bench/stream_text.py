"""What showing a stream's text costs the event loop, in-process on the built-in model's
tokenizer: the text of an OpenAI stream (`app.dialects.openai.streaming.IncrementalText`) fed
one token at a time, against decoding the whole token list at every token (what a stream
cost before the windowed decode). Both must show the same text.

    python bench/stream_text.py          # streams of 1,000, 4,000 and 16,000 tokens
    python bench/stream_text.py --quick  # smoke run
"""

from __future__ import annotations

import time
from collections.abc import Callable

from common import bench_arguments, bench_model, save_report

from app.common.text import IncrementalText

# Multi-byte characters split over byte tokens, and a stop string that never occurs.
TEXT = "The answer is 42: naïve café, 你好, 世界 🙂 — step by step. "
STOPS = ["</answer>"]


def windowed(decode: Callable[[list[int]], str], ids: list[int]) -> str:
    text = IncrementalText(decode, STOPS)
    return "".join(text.add([token]) for token in ids) + text.finish()


def whole_list(decode: Callable[[list[int]], str], ids: list[int]) -> str:
    """Decode everything at every token and show what grew (no stop found in TEXT)."""
    shown = ""
    for end in range(1, len(ids) + 1):
        text = decode(ids[:end]).rstrip("\ufffd")
        shown += text[len(shown) :]
    return shown + decode(ids)[len(shown) :]


def timed(run: Callable[[], str]) -> tuple[float, str]:
    start = time.perf_counter()
    out = run()
    return time.perf_counter() - start, out


def main() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bench_model(args.output, 64, 2))

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=True))

    lengths = [500, 1_000] if args.quick else [1_000, 4_000, 16_000]
    base = tokenizer.encode(TEXT * (max(lengths) // 20))
    results = {}
    for n in lengths:
        ids = base[:n]
        reference = decode(ids)
        new_s, new = timed(lambda ids=ids: windowed(decode, ids))
        old_s, old = timed(lambda ids=ids: whole_list(decode, ids))
        if new != reference or old != reference:
            raise SystemExit(f"{n} tokens: a stream's text differs from the whole decode")
        results[str(n)] = {
            "windowed_s": round(new_s, 4),
            "whole_list_s": round(old_s, 4),
            "windowed_us_per_token": round(new_s / n * 1e6, 1),
            "whole_list_us_per_token": round(old_s / n * 1e6, 1),
        }
        print(n, results[str(n)], flush=True)
    report = {
        "tokenizer": "the built-in model's (byte-level BPE, 256 byte tokens), one token a step",
        "host": "one CPU core of a 2-core host",
        "results": results,
    }
    save_report(args, "stream_text", report)


if __name__ == "__main__":
    parser = bench_arguments(__doc__)
    args = parser.parse_args()
    main()
