"""The Python client against the real app in-process, and its retry and error rules."""

from __future__ import annotations

import httpx
import pytest
from rlserve_client import (
    APIConnectionError,
    Client,
    ConflictError,
    NotFoundError,
    ServiceUnavailableError,
    UnprocessableEntityError,
)
from rlserve_client.types import GenerateResult

from tests.conftest import assert_close


async def test_routes_through_the_async_client(api, reference_log_probs):
    generated = await api.generate(tokens=[[1, 2, 3]], max_tokens=4, temperature=0, ignore_eos=True)
    full = generated.outputs[0][0].tokens.full
    assert isinstance(generated, GenerateResult) and full is not None
    scored = await api.logprobs(tokens=[full])
    assert scored.outputs[0].log_probs is not None
    assert_close(scored.outputs[0].log_probs.full or [], reference_log_probs(full), 1e-5)
    extras = await api.logprobs(
        prompt_tokens=[full[:3]],
        response_tokens=[full[3:]],
        top_logprobs=2,
        entropy=True,
        reference_log_probs=[scored.outputs[0].log_probs.full[3:]],
    )
    (sample,) = extras.outputs
    assert sample.span == "response" and sample.top_logprobs is not None
    assert len(sample.top_logprobs.ids) == len(full) - 3 and sample.entropy is not None
    assert sample.mismatch is not None and sample.mismatch.max_abs < 1e-5
    kl = await api.kl(prompt_tokens=[[1, 2]], response_tokens=[[3, 4]], estimator="k2")
    assert kl.outputs[0].kl == [0.0] * 4
    assert (await api.weights_version()).policy_version == 0
    assert [m.name for m in (await api.models()).models] == ["policy", "reference"]
    env = (await api.create_env(batch_size=1, max_turns=1)).env_id
    await api.reset_env(env, query=["hi"])
    step = await api.step_env(env, actions=[{"text": "yo"}])
    assert step.outputs[0].truncated is True
    assert (await api.get_env(env)).rows[0].turns == 1
    await api.delete_env(env)
    with pytest.raises(NotFoundError):
        await api.get_env(env)


async def test_status_codes_become_typed_errors(api):
    with pytest.raises(UnprocessableEntityError) as error:
        await api.generate(text=["a"], temperature=-1)
    assert (error.value.status_code, error.value.param) == (422, "temperature")
    assert error.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(NotFoundError):
        await api.get_env("env-missing")
    env = (await api.create_env(max_turns=1)).env_id
    await api.reset_env(env, query=["q"])
    await api.step_env(env, actions=[{"text": "a"}])
    with pytest.raises(ConflictError):
        await api.step_env(env, actions=[{"text": "b"}])


def flaky(fail_times: int, status: int, seen: list[httpx.Request], retry_after: str = "0"):  # type: ignore[no-untyped-def]
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if len(seen) <= fail_times:
            body = {
                "error": {
                    "message": "busy",
                    "type": "overloaded_error",
                    "param": None,
                    "code": status,
                }
            }
            return httpx.Response(status, json=body, headers={"Retry-After": retry_after})
        return httpx.Response(200, json={"status": "ok", "model_status": "ready"})

    return handler


def test_retries_on_503_then_succeeds():
    seen: list[httpx.Request] = []
    client = Client(base_url="http://x", transport=httpx.MockTransport(flaky(2, 503, seen)))
    assert client.health().status == "ok"
    assert len(seen) == 3


def test_gives_up_after_max_retries():
    seen: list[httpx.Request] = []
    client = Client(
        base_url="http://x", max_retries=1, transport=httpx.MockTransport(flaky(5, 503, seen))
    )
    with pytest.raises(ServiceUnavailableError):
        client.health()
    assert len(seen) == 2


def test_never_retries_other_4xx():
    seen: list[httpx.Request] = []
    client = Client(base_url="http://x", transport=httpx.MockTransport(flaky(5, 422, seen)))
    with pytest.raises(UnprocessableEntityError):
        client.health()
    assert len(seen) == 1


def test_connection_errors_are_retried_then_raised():
    attempts: list[int] = []

    def refuse(request: httpx.Request) -> httpx.Response:
        attempts.append(1)
        raise httpx.ConnectError("refused", request=request)

    client = Client(base_url="http://x", max_retries=2, transport=httpx.MockTransport(refuse))
    with pytest.raises(APIConnectionError, match=r"^GET http://x/health: no answer \(refused\)"):
        client.health()  # (the error names the URL it tried)
    assert len(attempts) == 3


def test_api_key_and_url_from_the_environment(monkeypatch):
    seen: list[httpx.Request] = []
    monkeypatch.setenv("RLSERVE_URL", "http://from-env:9000")
    monkeypatch.setenv("RLSERVE_API_KEY", "k-123")
    client = Client(transport=httpx.MockTransport(flaky(0, 200, seen)))
    client.health()
    assert str(seen[0].url) == "http://from-env:9000/health"
    assert seen[0].headers["authorization"] == "Bearer k-123"
