"""Every route as a `Call`; the clients only send them. Keyword-only, like the clients."""

from __future__ import annotations

from typing import Any

from rlserve_client._base import Call, inputs


def generate(*, messages: Any, text: Any, tokens: Any, model: str, params: dict[str, Any]) -> Call:
    return Call("POST", "/v1/generate", inputs(messages, text, tokens, model=model, **params))


def logprobs(*, messages: Any, text: Any, tokens: Any, model: str, split: dict[str, Any]) -> Call:
    return Call("POST", "/v1/logprobs", inputs(messages, text, tokens, model=model, **split))


def kl(*, messages: Any, text: Any, tokens: Any, options: dict[str, Any]) -> Call:
    return Call("POST", "/v1/kl", inputs(messages, text, tokens, **options))


def get(path: str, **params: Any) -> Call:
    return Call("GET", path, params={k: v for k, v in params.items() if v is not None})


def load_weights(*, path: str, model: str) -> Call:
    return Call("POST", "/v1/weights/load", {"path": path, "model": model})


def upload_weights(*, payload: bytes, model: str) -> Call:
    return Call("PUT", "/v1/weights", params={"model": model}, content=payload)


def create_env(config: dict[str, Any]) -> Call:
    return Call("POST", "/v1/envs", {k: v for k, v in config.items() if v is not None})


def reset_env(env_id: str, body: dict[str, Any]) -> Call:
    return Call(
        "POST", f"/v1/envs/{env_id}/reset", {k: v for k, v in body.items() if v is not None}
    )


def step_env(env_id: str, actions: list[Any]) -> Call:
    return Call("POST", f"/v1/envs/{env_id}/step", {"actions": actions})


def delete_env(env_id: str) -> Call:
    return Call("DELETE", f"/v1/envs/{env_id}")
