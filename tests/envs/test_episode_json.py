"""Session state and observations serialize as `dataclasses.asdict` would, into containers of
their own (a later change to the live state does not reach a saved snapshot)."""

from __future__ import annotations

import json
from dataclasses import asdict

from app.envs.episodes import EpisodeState, Observation, Row


def _state() -> EpisodeState:
    history = [
        {"role": "system", "content": "Answer."},
        {"role": "user", "content": [{"type": "text", "text": "2 + 2?"}]},
    ]
    rows = [
        Row(ids=[1, 2, 3], answer="4", fields={"tags": ["a", "b"], "n": 1}, history=history),
        Row(ids=list(range(500)), text="x", turns=2, done=True, total_reward=0.5),
    ]
    last = {"key": "k", "response": {"outputs": [{"observation": {"prompt_tokens": [5, 6]}}]}}
    return EpisodeState(started=True, cursor=2, rows=rows, last_step=last)


def test_state_json_equals_asdict_and_shares_no_container() -> None:
    state = _state()
    data = state.to_json()
    assert json.dumps(data, sort_keys=True) == json.dumps(asdict(state), sort_keys=True)
    state.rows[0].ids.append(9)
    state.rows[0].history[1]["content"][0]["text"] = "changed"  # type: ignore[index]
    state.rows[0].fields["tags"].append("c")
    state.last_step["response"]["outputs"][0]["observation"]["prompt_tokens"].append(7)  # type: ignore[index]
    assert data["rows"][0]["ids"] == [1, 2, 3]
    assert data["rows"][0]["history"][1]["content"][0]["text"] == "2 + 2?"
    assert data["rows"][0]["fields"]["tags"] == ["a", "b"]
    assert data["last_step"]["response"]["outputs"][0]["observation"]["prompt_tokens"] == [5, 6]
    assert EpisodeState.from_json(json.loads(json.dumps(data))).rows[1].ids == list(range(500))


def test_observation_json_equals_asdict() -> None:
    history = [{"role": "user", "content": "hi"}]
    seen = Observation(history=history, text=None, prompt_text="p", prompt_tokens=[1, 2], hash=7)
    data = seen.to_json()
    assert data == asdict(seen)
    history[0]["content"] = "changed"
    assert data["history"][0]["content"] == "hi"
