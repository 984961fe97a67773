"""Episode state transitions (TorchRL ChatEnv / LLMEnv semantics), free of HTTP and storage.

State is plain JSON: {"started", "cursor", "rows": [{history | text | tokens, answer, turns,
done, terminated, truncated, total_reward}]}."""

from __future__ import annotations

import random
from typing import Any

from app.common.inputs import InputPreparer
from app.envs.datasets import Problem
from app.envs.hashing import chain_hash
from app.envs.protocol import Action, EnvConfig, Message, Observation, ResetRequest
from app.errors import invalid

Row = dict[str, Any]


def new_state() -> dict[str, Any]:
    return {"started": False, "cursor": 0, "rows": []}


def _fresh_row(
    config: EnvConfig,
    preparer: InputPreparer,
    *,
    query: str | None = None,
    messages: list[dict[str, str]] | None = None,
    tokens: list[int] | None = None,
    answer: str | None = None,
) -> Row:
    row: Row = {
        "answer": answer,
        "turns": 0,
        "done": False,
        "terminated": False,
        "truncated": False,
        "total_reward": 0.0,
    }
    if config.kind == "chat":
        system = (
            [{"role": "system", "content": config.system_prompt}] if config.system_prompt else []
        )
        if messages is not None:
            has_system = messages[0]["role"] == "system"
            row["history"] = messages if has_system else system + messages
        else:
            row["history"] = [*system, {"role": "user", "content": query or ""}]
    elif config.kind == "text":
        row["text"] = query if query is not None else preparer.decode(tokens or [])
    else:
        row["tokens"] = tokens if tokens is not None else preparer.encode(query or "")
    return row


def dataset_problems(config: EnvConfig, problems: list[Problem], cursor: int) -> list[Problem]:
    """The next batch of prompts: a seeded order, each prompt repeated `repeats` times."""
    order = list(range(len(problems)))
    random.Random(config.seed).shuffle(order)
    distinct = config.batch_size // config.repeats
    picked = [problems[order[(cursor + i) % len(order)]] for i in range(distinct)]
    return [p for p in picked for _ in range(config.repeats)]


def reset(
    config: EnvConfig,
    state: dict[str, Any],
    request: ResetRequest,
    preparer: InputPreparer,
    problems: list[Problem] | None,
) -> None:
    size = config.batch_size
    answers = request.answer
    given = request.query or request.messages or request.tokens
    if given is not None and len(given) != size:
        name = "query" if request.query else "messages" if request.messages else "tokens"
        raise invalid(name, f"has {len(given)} entries for batch_size {size}")
    if answers is not None and len(answers) != size:
        raise invalid("answer", f"has {len(answers)} entries for batch_size {size}")
    if request.messages is not None and config.kind != "chat":
        raise invalid("messages", f"needs kind 'chat', this environment is '{config.kind}'")
    if request.tokens is not None and config.kind == "chat":
        raise invalid("tokens", "a chat environment takes query or messages")
    rows: list[Row]
    if request.query is not None:
        rows = [
            _fresh_row(config, preparer, query=q, answer=answers[i] if answers else None)
            for i, q in enumerate(request.query)
        ]
    elif request.messages is not None:
        rows = [
            _fresh_row(config, preparer, messages=[m.model_dump() for m in conv])
            for conv in request.messages
        ]
    elif request.tokens is not None:
        rows = [
            _fresh_row(config, preparer, tokens=list(t), answer=answers[i] if answers else None)
            for i, t in enumerate(request.tokens)
        ]
    else:
        if problems is None:
            raise invalid("query", "required: this environment has no dataset to draw from")
        drawn = dataset_problems(config, problems, state["cursor"])
        state["cursor"] += size // config.repeats
        rows = [_fresh_row(config, preparer, query=p.query, answer=p.answer) for p in drawn]
    state["rows"], state["started"] = rows, True


def prompt_tokens(config: EnvConfig, row: Row, preparer: InputPreparer) -> list[int]:
    """The ids to generate from (chat: templated with the generation prompt)."""
    if config.kind == "chat":
        return preparer.template(row["history"], generation_prompt=True).ids
    return preparer.encode(row["text"]) if config.kind == "text" else list(row["tokens"])


def turn_tokens(config: EnvConfig, row: Row, preparer: InputPreparer) -> list[int]:
    """The ids of the row through its last action (chat: without a generation prompt)."""
    if config.kind == "chat":
        return preparer.template(row["history"], generation_prompt=False).ids
    return prompt_tokens(config, row, preparer)


def observation(config: EnvConfig, row: Row, preparer: InputPreparer) -> Observation:
    if config.kind == "chat":
        prepared = preparer.template(row["history"], generation_prompt=True)
        prompt_text, prompt_tokens = prepared.text or "", prepared.ids
        history: list[Message] | None = [Message(**m) for m in row["history"]]
        text = None
    elif config.kind == "text":
        prompt_text, prompt_tokens = row["text"], preparer.encode(row["text"])
        history, text = None, row["text"]
    else:
        prompt_tokens = row["tokens"]
        prompt_text = preparer.decode(prompt_tokens)
        history, text = None, prompt_text
    return Observation(
        history=history,
        text=text,
        prompt_text=prompt_text,
        prompt_tokens=prompt_tokens,
        hash=chain_hash(prompt_tokens) if config.hashing else None,
    )


def action_text(action: Action, preparer: InputPreparer) -> str:
    if action.text is not None:
        return action.text
    return preparer.decode(list(action.tokens or []), skip_special=True)


def apply_action(config: EnvConfig, row: Row, action: Action, preparer: InputPreparer) -> str:
    """Append the action to the row's observation; return the action as text."""
    text = action_text(action, preparer)
    if config.kind == "chat":
        row["history"].append({"role": "assistant", "content": text})
    elif config.kind == "text":
        row["text"] += text
    else:
        row["tokens"] += (
            list(action.tokens)
            if action.tokens is not None
            else preparer.encode(text, special=False)
        )
    return text


def finish_turn(config: EnvConfig, row: Row, reward: float, ends_episode: bool) -> None:
    row["turns"] += 1
    row["total_reward"] += reward
    row["terminated"] = ends_episode
    row["truncated"] = (
        not ends_episode and config.max_turns is not None and row["turns"] >= config.max_turns
    )
    row["done"] = row["terminated"] or row["truncated"]
