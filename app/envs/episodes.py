"""Episode state and its transitions (TorchRL ChatEnv / LLMEnv semantics), free of HTTP and
storage. Every row keeps its exact token history: a token action enters it as sent, and the
next prompt is the previous prompt + the action + what the chat template adds after it
(`app.common.turns`), never a re-encoding of decoded text.

The transitions tokenize, template and decode: they block, and run on the tokenizer thread
(`app.envs.engine`), never on the event loop."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, fields
from typing import Any

from app.common.failures import Conflict, invalid
from app.common.inputs import Conversation, InputPreparer
from app.common.turns import continuation_ids, continuation_text
from app.datasets.rows import Problem
from app.envs.hashing import chain_hash
from app.envs.spec import EnvSpec


@dataclass
class Row:
    """One episode. `ids` is the exact token history: the prompt of the next turn."""

    ids: list[int]
    answer: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)  # the dataset row's extra fields
    history: Conversation | None = None  # chat environments
    text: str | None = None  # text environments
    turns: int = 0
    done: bool = False
    terminated: bool = False
    truncated: bool = False
    total_reward: float | None = 0.0
    """The sum of the turns' rewards; None once a turn had none (a judge gave no score)."""


def _row_json(row: Row) -> dict[str, Any]:
    data = {f.name: getattr(row, f.name) for f in fields(Row)}
    data["ids"] = list(row.ids)
    data["fields"] = _json_copy(row.fields)
    data["history"] = _json_copy(row.history)
    return data


def _json_copy(value: Any) -> Any:
    """A copy of a JSON-like value (dicts, lists and scalars): new containers all the way
    down, as `asdict` makes, without its per-item dataclass checks; a list of scalars (token
    ids) is copied at once."""
    if isinstance(value, dict):
        return {key: _json_copy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        if all(type(item) in _SCALARS for item in value):
            return list(value)
        return [_json_copy(item) for item in value]
    return value


_SCALARS = frozenset({int, float, str, bool, type(None)})


@dataclass
class EpisodeState:
    """A session's episodes; serialized only by the session store (`to_json`/`from_json`)."""

    started: bool = False
    cursor: int = 0
    rows: list[Row] = field(default_factory=list)
    last_step: dict[str, Any] | None = None
    """The last applied step's idempotency key, actions digest and response, so a retried
    step (same key) gets the same answer instead of being applied twice."""

    def to_json(self) -> dict[str, Any]:
        # Built field by field: `asdict` walks every token id of every row, which made up a
        # quarter of an environment step's cost (bench/overhead.py, env_step).
        return {
            "started": self.started,
            "cursor": self.cursor,
            "rows": [_row_json(row) for row in self.rows],
            "last_step": _json_copy(self.last_step),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EpisodeState:
        rows = data.get("rows", [])
        if any("ids" not in row for row in rows):  # stored before token histories: reset it
            return cls(started=False, cursor=int(data.get("cursor", 0)))
        return cls(
            started=bool(data["started"]),
            cursor=int(data["cursor"]),
            rows=[Row(**row) for row in rows],
            last_step=data.get("last_step"),
        )


@dataclass(frozen=True)
class ActionTokens:
    """A row's action: its exact ids, its text (what rewards and tools read), and the prompt
    it answered."""

    prompt: list[int]
    ids: list[int]
    text: str

    @property
    def full(self) -> list[int]:
        return self.prompt + self.ids


def _fresh_row(
    config: EnvSpec,
    preparer: InputPreparer,
    *,
    query: str | None = None,
    messages: Conversation | None = None,
    tokens: list[int] | None = None,
    answer: str | None = None,
    fields: dict[str, Any] | None = None,
) -> Row:
    row = _templated_row(config, preparer, query, messages, tokens)
    row.answer, row.fields = answer, dict(fields or {})
    return row


def _templated_row(
    config: EnvSpec,
    preparer: InputPreparer,
    query: str | None,
    messages: Conversation | None,
    tokens: list[int] | None,
) -> Row:
    if config.kind == "chat":
        system = (
            [{"role": "system", "content": config.system_prompt}] if config.system_prompt else []
        )
        if messages is not None:
            history = messages if messages[0]["role"] == "system" else system + messages
        else:
            history = [*system, {"role": "user", "content": query or ""}]
        ids = preparer.template(history, generation_prompt=True).ids
        return Row(ids=ids, history=history)
    if config.kind == "text":
        text = query if query is not None else preparer.decode(tokens or [])
        ids = list(tokens) if tokens is not None else preparer.encode(text)
        return Row(ids=ids, text=text)
    ids = list(tokens) if tokens is not None else preparer.encode(query or "")
    return Row(ids=ids)


@dataclass(frozen=True)
class Prompts:
    """What a reset starts from: queries (with ground-truth answers and reward fields per
    row), conversations, or token prompts; none of them draws from the session's dataset."""

    query: list[str] | None = None
    answer: list[str | None] | None = None
    fields: list[dict[str, Any]] | None = None
    messages: list[Conversation] | None = None
    tokens: list[list[int]] | None = None

    @property
    def given(self) -> bool:
        return any(p is not None for p in (self.query, self.messages, self.tokens))


def dataset_problems(config: EnvSpec, problems: list[Problem], cursor: int) -> list[Problem]:
    """The next batch of prompts: a seeded order, each prompt repeated `repeats` times."""
    order = list(range(len(problems)))
    random.Random(config.seed).shuffle(order)
    distinct = config.batch_size // config.repeats
    picked = [problems[order[(cursor + i) % len(order)]] for i in range(distinct)]
    return [p for p in picked for _ in range(config.repeats)]


def reset(
    config: EnvSpec,
    state: EpisodeState,
    prompts: Prompts,
    preparer: InputPreparer,
    problems: list[Problem] | None,
) -> None:
    size = config.batch_size
    answers = prompts.answer
    given = prompts.query or prompts.messages or prompts.tokens
    if given is not None and len(given) != size:
        name = "query" if prompts.query else "messages" if prompts.messages else "tokens"
        raise invalid(name, f"has {len(given)} entries for batch_size {size}")
    if answers is not None and len(answers) != size:
        raise invalid("answer", f"has {len(answers)} entries for batch_size {size}")
    if prompts.messages is not None and config.kind != "chat":
        raise invalid("messages", f"needs kind 'chat', this environment is '{config.kind}'")
    if prompts.tokens is not None and config.kind == "chat":
        raise invalid("tokens", "a chat environment takes query or messages")
    fields = prompts.fields
    if fields is not None and len(fields) != size:
        raise invalid("fields", f"has {len(fields)} entries for batch_size {size}")

    def given_row(i: int, **prompt: Any) -> Row:
        answer = answers[i] if answers else None
        return _fresh_row(
            config, preparer, answer=answer, fields=fields[i] if fields else None, **prompt
        )

    if prompts.query is not None:
        rows = [given_row(i, query=q) for i, q in enumerate(prompts.query)]
    elif prompts.messages is not None:
        rows = [
            given_row(i, messages=[dict(m) for m in conv])
            for i, conv in enumerate(prompts.messages)
        ]
    elif prompts.tokens is not None:
        rows = [given_row(i, tokens=list(t)) for i, t in enumerate(prompts.tokens)]
    else:
        if problems is None:
            raise Conflict(  # the body is fine; this session has nothing to draw from
                "query: required: this environment has no dataset to draw from", param="query"
            )
        drawn = dataset_problems(config, problems, state.cursor)
        state.cursor += size // config.repeats
        rows = [
            _fresh_row(config, preparer, query=p.query, answer=p.answer, fields=p.fields)
            for p in drawn
        ]
    state.rows, state.started = rows, True


@dataclass(frozen=True)
class Observation:
    """What the policy sees of a row: its history (chat) or text, and the prompt to generate
    from, as text and as exact ids."""

    history: Conversation | None
    text: str | None
    prompt_text: str
    prompt_tokens: list[int]
    hash: int | None

    def to_json(self) -> dict[str, Any]:
        return {
            "history": _json_copy(self.history),
            "text": self.text,
            "prompt_text": self.prompt_text,
            "prompt_tokens": list(self.prompt_tokens),
            "hash": self.hash,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Observation:
        return cls(**data)


def observation(config: EnvSpec, row: Row, preparer: InputPreparer) -> Observation:
    history = [dict(m) for m in row.history] if row.history is not None else None
    prompt_text = preparer.decode(row.ids)
    text = None if config.kind == "chat" else row.text if row.text is not None else prompt_text
    return Observation(
        history=history,
        text=text,
        prompt_text=prompt_text,
        prompt_tokens=list(row.ids),
        hash=chain_hash(row.ids) if config.hashing else None,
    )


@dataclass(frozen=True)
class Act:
    """One row's action as the services take it: text, or exact token ids."""

    text: str | None = None
    tokens: list[int] | None = None


def action_tokens(row: Row, action: Act, preparer: InputPreparer) -> ActionTokens:
    """The action as exact ids (token actions as sent; text actions encoded once, without
    special tokens) and as text (token actions decoded without special tokens)."""
    if action.tokens is not None:
        ids = list(action.tokens)
        return ActionTokens(list(row.ids), ids, preparer.decode(ids, skip_special=True))
    text = action.text or ""
    return ActionTokens(list(row.ids), preparer.encode(text, special=False), text)


def apply_action(
    config: EnvSpec,
    row: Row,
    action: ActionTokens,
    preparer: InputPreparer,
    following: Conversation | None = None,
) -> None:
    """Append the action, then (chat) the `following` messages (tool results) and the next
    generation prompt, as the chat template writes them."""
    row.ids = action.full
    if config.kind == "chat":
        history = row.history or []
        after = following or []
        text = continuation_text(preparer, history, action.text, after)
        row.ids += continuation_ids(preparer, action.ids, text)
        row.history = [*history, {"role": "assistant", "content": action.text}, *after]
    elif config.kind == "text":
        row.text = (row.text or "") + action.text


def finish_turn(
    config: EnvSpec, row: Row, reward: float | None, ends_episode: bool, max_model_len: int
) -> None:
    """Count the turn; the episode is truncated at max_turns, or once its history leaves no
    room for another generated token."""
    row.turns += 1
    if row.total_reward is not None:
        row.total_reward = None if reward is None else row.total_reward + reward
    row.terminated = ends_episode
    out_of_turns = config.max_turns is not None and row.turns >= config.max_turns
    row.truncated = not ends_episode and (out_of_turns or len(row.ids) >= max_model_len)
    row.done = row.terminated or row.truncated
