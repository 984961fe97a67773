"""An OpenAI request checked and ready to sample (`Job`), and the parts its reply is made of:
messages, reasoning, log-probs, echoed prompts, rlserve's extensions and usage."""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from app.common.containers import wire_spans
from app.common.inputs import Prepared
from app.common.routed_experts import npy_base64
from app.common.service import Resolved
from app.common.text import final_text
from app.config_groups import ReasoningParser
from app.dialects.openai.answers import PromptLogprob, Usage
from app.dialects.openai.protocol import SamplingFields, ToolCall
from app.dialects.openai.reasoning import ReasoningReader, prompt_opens_thinking
from app.dialects.openai.tokens import TokenTexts
from app.dialects.openai.tools import parse_tool_calls
from app.engine.served import ServedModel
from app.engine.types import Generation, SamplingConfig, Scores

Kind = Literal["chat", "completion"]
ROUTES: dict[Kind, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


@dataclass
class Job:
    """A checked OpenAI request, ready to sample."""

    kind: Kind
    model: str
    served: ServedModel
    prompts: list[Prepared]
    resolved: Resolved
    request: SamplingFields
    logprobs: int | None
    """None: no log-probs; k: the chosen token's and the k most likely."""
    tool_names: set[str] | None
    trajectory_id: str | None
    owner: str
    texts: TokenTexts
    as_ids: bool = False
    """Name tokens in log-probs as 'token_id:<id>' (the request's return_tokens_as_token_ids,
    else the server's)."""
    reasoning: ReasoningParser | None = None
    """The reasoning parser a chat reply is read with (None: the text is all content)."""
    show_reasoning: bool = True
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def n(self) -> int:
        return self.request.n

    @property
    def config(self) -> SamplingConfig:
        return self.resolved.config

    @property
    def processed(self) -> bool:
        return self.request.logprobs_mode == "processed"

    def prompt_of(self, choice: int) -> Prepared:
        return self.prompts[choice // self.n]


def chat_message(
    job: Job, g: Generation
) -> tuple[str | None, list[ToolCall], ReasoningReader | None]:
    """A chat reply's content (its reasoning and tool calls taken out), its tool calls, and
    the reader that took the reasoning out (None without a reasoning parser)."""
    reader = reasoning_reader(job)
    text = reply_text(job, g)
    content: str | None = text
    if reader is not None:
        reader.feed(text, last=True)
        content = reader.result()[1]
    calls: list[ToolCall] = []
    if job.tool_names is not None and content is not None:
        content, calls = parse_tool_calls(content, job.tool_names)
    return content, calls, reader


def reply_text(job: Job, g: Generation) -> str:
    """What the reply shows: the sampled text without special tokens, cut at a stop string."""
    return final_text(job.served.preparer.decode(g.token_ids, skip_special=True), job.request.stops)


def reasoning_reader(job: Job) -> ReasoningReader | None:
    """A reader for one chat reply's reasoning, where the server runs a parser."""
    if job.reasoning is None or job.kind != "chat":
        return None
    opened = prompt_opens_thinking(job.prompts[0].text or "")
    return ReasoningReader(job.reasoning, opened=opened)


def reasoning_of(
    job: Job, reader: ReasoningReader | None, text: str | None = None
) -> dict[str, Any]:
    """The reply's (or a delta's) reasoning fields: `text`, or the reader's whole reasoning."""
    if reader is None or not job.show_reasoning:
        return {}
    if text is None:
        text = reader.result()[0]
    return {"reasoning": text, "reasoning_content": text} if text else {}


def echoes(job: Job) -> bool:
    return bool(getattr(job.request, "echo", False))


def echoed_scores(
    ids: list[int], scores: Scores | None, k: int
) -> tuple[list[float | None], list[list[tuple[int, float]]]]:
    """An echoed prompt's log-probs as a completion's: null for the first token (and where a
    prompt aborted before it was scored, or a log-prob is -infinity), then each token's; and
    at each position the k most likely tokens (k = 0: the token itself, as vLLM answers)."""
    if scores is None:
        return [None] * len(ids), [[] for _ in ids]
    own = scores.log_probs.tolist()
    values = [None, *(v if math.isfinite(v) else None for v in own[1 : len(ids)])]
    if k == 0 or scores.top_ids is None or scores.top_log_probs is None:
        return values, [[] if v is None else [(t, v)] for t, v in zip(ids, values, strict=True)]
    rows = zip(scores.top_ids.tolist(), scores.top_log_probs.tolist(), strict=True)
    tops = [[], *([(i, v) for i, v in zip(r[:k], lp[:k], strict=True)] for r, lp in rows)]
    return values, tops[: len(ids)]


def prompt_logprobs_of(
    job: Job, ids: list[int], scores: Scores, k: int
) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's layout: null for the first token, then per token id -> log-prob, rank, text
    (the prompt's own token first, then the k most likely in order)."""
    texts = job.texts
    as_ids = job.as_ids

    def entry(token: int, value: float, rank: int) -> PromptLogprob:
        name = f"token_id:{token}" if as_ids else texts.text(token)[0]
        return PromptLogprob(
            logprob=value if math.isfinite(value) else None, rank=rank, decoded_token=name
        )

    out: list[dict[str, PromptLogprob] | None] = [None]
    own = scores.log_probs.tolist()
    ranks = scores.ranks.tolist() if scores.ranks is not None else []
    top_ids = scores.top_ids.tolist() if scores.top_ids is not None else [[] for _ in ranks]
    top_values = scores.top_log_probs.tolist() if scores.top_log_probs is not None else top_ids
    for p in range(1, len(ids)):
        row = {str(ids[p]): entry(ids[p], own[p], ranks[p - 1])}
        row_tops = zip(top_ids[p - 1][:k], top_values[p - 1][:k], strict=True)
        for r, (token, value) in enumerate(row_tops):
            row.setdefault(str(token), entry(token, value, r + 1))
        out.append(row)
    return out


def values_of(job: Job, g: Generation) -> list[float]:
    """The log-probs the request asked for (processed ones exist wherever they may be asked
    for: checked against the engine's capabilities; an aborted row has none at all)."""
    values = g.processed_log_probs if job.processed else g.log_probs
    return values if values is not None else []


def decoder_of(job: Job) -> Any:
    preparer = job.served.preparer

    def decode(ids: list[int]) -> str:
        return preparer.decode(ids, skip_special=True)

    return decode


def extensions_of(job: Job, g: Generation) -> dict[str, Any]:
    extensions: dict[str, Any] = {"stop_reason": g.stop_reason}
    routing = job.served.backend.routing
    if g.routed_experts is not None and routing is not None:
        start = job.request.routed_experts_prompt_start
        extensions["routed_experts"] = npy_base64(g.routed_experts[start:], routing)
    if job.request.return_token_ids:
        extensions |= {"token_ids": g.token_ids, "policy_versions": wire_spans(g.versions)}
    return extensions


def usage_of(job: Job, generations: list[Generation]) -> Usage:
    prompt = sum(len(p.ids) for p in job.prompts)
    completion = sum(len(g.token_ids) for g in generations)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )
