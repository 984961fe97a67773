"""Every route once, as a keyword-only function building a `Call`: these signatures are the
methods of both `Client` and `AsyncClient` (see `_client._Route`)."""

from __future__ import annotations

import uuid
from typing import Any

from rlserve_client import types
from rlserve_client._base import NOT_GIVEN, Call, Retry, Timeout, _given, session, tensor_call
from rlserve_client.sampling import check_generation_parameters


def generate(
    *,
    messages: Any = None,
    text: Any = None,
    tokens: Any = None,
    model: str = "policy",
    chat_template_kwargs: dict[str, Any] | None = None,
    tensors: bool = False,
    sticky: str | None = None,
    timeout: Timeout = NOT_GIVEN,
    **params: Any,
) -> Call[types.GenerateResult]:
    """Sample continuations. `params`: any of `rlserve_client.sampling.GENERATION_PARAMETERS`
    (refused here otherwise), e.g. max_new_tokens/max_tokens, n, temperature, top_p, top_k,
    min_p, repetition_penalty, presence_penalty, frequency_penalty, logit_bias, min_tokens,
    stop, stop_token_ids, allowed_token_ids, bad_words, seed, return_prompt_log_probs,
    top_logprobs (k most likely tokens at every generated step), entropy,
    return_routed_experts (mixture-of-experts models: each sample's `routed_experts`, for
    `rlserve_client.moe.replay_experts`), batch_invariant.
    `tensors=True`: the reply travels as binary and its arrays are torch tensors (for
    building TensorDicts); tensors given as inputs always travel as binary.
    `sticky`: an episode's id, so that its turns reach one replica of several (its prefix
    cache holds the episode so far)."""
    check_generation_parameters(params, "generate")
    inputs = _given(messages=messages, text=text, tokens=tokens, model=model)
    body = {**inputs, **_given(chat_template_kwargs=chat_template_kwargs, **params)}
    return tensor_call(
        "/v1/generate",
        types.GenerateResult,
        body,
        tensors=tensors,
        timeout=timeout,
        headers=session(sticky),
    )


def logprobs(
    *,
    messages: Any = None,
    text: Any = None,
    tokens: Any = None,
    prompt_text: Any = None,
    response_text: Any = None,
    prompt_tokens: Any = None,
    response_tokens: Any = None,
    model: str = "policy",
    top_logprobs: int | None = None,
    entropy: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    token_ids: list[int] | None = None,
    reference_log_probs: Any = None,
    mismatch_threshold: float | None = None,
    span: str | None = None,
    batch_invariant: bool | None = None,
    routed_experts: Any = None,
    tensors: bool = False,
    timeout: Timeout = NOT_GIVEN,
) -> Call[types.LogProbsResult]:
    """Score given sequences: `log_probs.full` (and prompt/response with a split). On request,
    per position of the span (the response when split, else the full sequence): the
    `top_logprobs` most likely tokens, the `entropy`, log-probs under `temperature`/`top_k`/
    `top_p` (`processed`), the log-probs of candidate `token_ids`; and a `mismatch` report
    against `reference_log_probs` (one list per input, over the span). `batch_invariant`:
    each sequence scored alone, bitwise the same whatever else the server is sent (None: the
    server's setting). `routed_experts`: per input, the routing a mixture-of-experts model
    replays (a sample's `routed_experts` from generation, or None). `tensors=True`: the
    reply travels as binary and its arrays are torch tensors (NaN / -1 where JSON has null,
    -inf for a token top-k/top-p removed); tensors given as inputs always travel as binary."""
    body = _given(
        messages=messages,
        text=text,
        tokens=tokens,
        prompt_text=prompt_text,
        response_text=response_text,
        prompt_tokens=prompt_tokens,
        response_tokens=response_tokens,
        model=model,
        top_logprobs=top_logprobs,
        entropy=entropy,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        token_ids=token_ids,
        reference_log_probs=reference_log_probs,
        mismatch_threshold=mismatch_threshold,
        span=span,
        batch_invariant=batch_invariant,
        routed_experts=routed_experts,
    )
    return tensor_call("/v1/logprobs", types.LogProbsResult, body, tensors=tensors, timeout=timeout)


def kl(
    *,
    messages: Any = None,
    text: Any = None,
    tokens: Any = None,
    prompt_tokens: Any = None,
    response_tokens: Any = None,
    prompt_text: Any = None,
    response_text: Any = None,
    policy_log_probs: Any = None,
    estimator: str | None = None,
    assistant_only: bool | None = None,
    coeff: float | None = None,
    rewards: Any = None,
    reward_placement: str | None = None,
    model: str = "policy",
    tensors: bool = False,
    timeout: Timeout = NOT_GIVEN,
) -> Call[types.KLResult]:
    """Per-token KL(policy || reference), optionally shaping `rewards`. `model`: the policy or
    one of its LoRA adapters (then against its base with the adapter off). `tensors=True`: the
    reply's arrays come as torch tensors (binary on the wire)."""
    body = _given(
        model=model,
        messages=messages,
        text=text,
        tokens=tokens,
        prompt_tokens=prompt_tokens,
        response_tokens=response_tokens,
        prompt_text=prompt_text,
        response_text=response_text,
        policy_log_probs=policy_log_probs,
        estimator=estimator,
        assistant_only=assistant_only,
        coeff=coeff,
        rewards=rewards,
        reward_placement=reward_placement,
    )
    return tensor_call("/v1/kl", types.KLResult, body, tensors=tensors, timeout=timeout)


def rewards(
    *,
    messages: Any = None,
    text: Any = None,
    tokens: Any = None,
    prompt_text: Any = None,
    response_text: Any = None,
    prompt_tokens: Any = None,
    response_tokens: Any = None,
    token_values: bool | None = None,
    model: str = "reward",
    timeout: Timeout = NOT_GIVEN,
) -> Call[types.RewardsResult]:
    """The served reward model's score of each sequence (conversations templated with its own
    chat template); `token_values`: also the head's output at every token."""
    body = _given(
        model=model,
        messages=messages,
        text=text,
        tokens=tokens,
        prompt_text=prompt_text,
        response_text=response_text,
        prompt_tokens=prompt_tokens,
        response_tokens=response_tokens,
        token_values=token_values,
    )
    return Call("POST", "/v1/rewards", types.RewardsResult, json=body, timeout=timeout)


def models(*, timeout: Timeout = NOT_GIVEN) -> Call[types.Models]:
    return Call("GET", "/v1/models", types.Models, timeout=timeout)


def health(*, timeout: Timeout = NOT_GIVEN) -> Call[types.Health]:
    """Raises `ServiceUnavailableError` (after retries) while the models load, as vLLM's."""
    return Call("GET", "/health", types.Health, timeout=timeout)


def live(*, timeout: Timeout = NOT_GIVEN) -> Call[types.Health]:
    """Answers whenever the server process does: `model_status` says how far it is."""
    return Call("GET", "/live", types.Health, timeout=timeout)


def ready(*, timeout: Timeout = NOT_GIVEN) -> Call[types.Ready]:
    """Raises `ServiceUnavailableError` (after retries) while the models load."""
    return Call("GET", "/ready", types.Ready, timeout=timeout)


def batching(*, timeout: Timeout = NOT_GIVEN) -> Call[types.Json]:
    return Call("GET", "/v1/batching", types.Json, timeout=timeout)


def create_env(
    *,
    kind: str | None = None,
    system_prompt: str | None = None,
    batch_size: int | None = None,
    max_turns: int | None = None,
    reward: str | None = None,
    tools: list[str] | None = None,
    dataset: str | None = None,
    repeats: int | None = None,
    seed: int | None = None,
    kl: dict[str, Any] | None = None,
    hashing: bool | None = None,
    timeout: Timeout = NOT_GIVEN,
) -> Call[types.EnvCreated]:
    body = _given(
        kind=kind,
        system_prompt=system_prompt,
        batch_size=batch_size,
        max_turns=max_turns,
        reward=reward,
        tools=tools,
        dataset=dataset,
        repeats=repeats,
        seed=seed,
        kl=kl,
        hashing=hashing,
    )
    return Call(
        "POST", "/v1/envs", types.EnvCreated, json=body, timeout=timeout, retry=Retry.UNSENT
    )


def reset_env(
    env_id: str,
    /,
    *,
    query: list[str] | None = None,
    answer: list[str | None] | None = None,
    messages: Any = None,
    tokens: Any = None,
    timeout: Timeout = NOT_GIVEN,
) -> Call[types.ResetResult]:
    """Start new episodes; with no inputs the rows draw from the session's dataset."""
    body = _given(query=query, answer=answer, messages=messages, tokens=tokens)
    return Call(
        "POST",
        f"/v1/envs/{env_id}/reset",
        types.ResetResult,
        json=body,
        timeout=timeout,
        retry=Retry.UNSENT,
        headers=session(env_id),
    )


def step_env(
    env_id: str, /, *, actions: list[Any], timeout: Timeout = NOT_GIVEN
) -> Call[types.StepResult]:
    """One action per row (`{"text": ...}` or `{"tokens": [...]}`), None for finished rows.
    Sent with a fresh Idempotency-Key, so a retry after a lost answer is never applied twice."""
    body = {"actions": actions}
    return Call(
        "POST",
        f"/v1/envs/{env_id}/step",
        types.StepResult,
        json=body,
        timeout=timeout,
        retry=Retry.KEYED,
        headers={"Idempotency-Key": uuid.uuid4().hex, **session(env_id)},
    )


def get_env(env_id: str, /, *, timeout: Timeout = NOT_GIVEN) -> Call[types.EnvState]:
    return Call(
        "GET", f"/v1/envs/{env_id}", types.EnvState, timeout=timeout, headers=session(env_id)
    )


def list_envs(
    *, offset: int = 0, limit: int = 50, timeout: Timeout = NOT_GIVEN
) -> Call[types.EnvList]:
    params = {"offset": offset, "limit": limit}
    return Call("GET", "/v1/envs", types.EnvList, params=params, timeout=timeout)


def delete_env(env_id: str, /, *, timeout: Timeout = NOT_GIVEN) -> Call[types.Json]:
    return Call(
        "DELETE", f"/v1/envs/{env_id}", types.Json, timeout=timeout, headers=session(env_id)
    )


def rollouts(
    *,
    num_episodes: int,
    env: dict[str, Any] | None = None,
    env_id: str | None = None,
    num_envs: int | None = None,
    generation: dict[str, Any] | None = None,
    timeout: Timeout = NOT_GIVEN,
) -> Call[types.RolloutResult]:
    """Whole episodes run on the server (`env` config, or an existing `env_id`); the same
    trajectories `collect` yields, with GRPO advantages when `repeats` > 1."""
    body = _given(
        num_episodes=num_episodes,
        env=env,
        env_id=env_id,
        num_envs=num_envs,
        generation=generation,
    )
    return Call(
        "POST",
        "/v1/rollouts",
        types.RolloutResult,
        json=body,
        timeout=timeout,
        retry=Retry.UNSENT,
        headers=session(env_id),
    )


def trajectory(
    trajectory_id: str, /, *, timeout: Timeout = NOT_GIVEN
) -> Call[types.RecordedTrajectory]:
    """The completions recorded under `trajectory_id` (the OpenAI routes' `trajectory_id`
    field or X-Trajectory-ID header), as token sequences: `.to_tensordict()` for a trainer."""
    return Call(
        "GET",
        f"/v1/trajectories/{trajectory_id}",
        types.RecordedTrajectory,
        timeout=timeout,
        headers=session(trajectory_id),
    )


def set_trajectory_reward(
    trajectory_id: str, /, *, reward: float, timeout: Timeout = NOT_GIVEN
) -> Call[types.Json]:
    return Call(
        "POST",
        f"/v1/trajectories/{trajectory_id}/reward",
        types.Json,
        json={"reward": reward},
        timeout=timeout,
        headers=session(trajectory_id),
    )


def delete_trajectory(trajectory_id: str, /, *, timeout: Timeout = NOT_GIVEN) -> Call[types.Json]:
    return Call(
        "DELETE",
        f"/v1/trajectories/{trajectory_id}",
        types.Json,
        timeout=timeout,
        headers=session(trajectory_id),
    )
