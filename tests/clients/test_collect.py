"""`collect`: LLMCollector semantics over the client, in-process."""

from __future__ import annotations

import contextlib

import pytest
import torch
from rlserve_client import collect
from rlserve_client.types import RolloutResult

from tests.conftest import assert_close

ENV = {"dataset": "arithmetic", "reward": "gsm8k", "batch_size": 4, "max_turns": 2}


async def gather(api, **options) -> list[RolloutResult]:  # type: ignore[no-untyped-def]
    return [batch async for batch in collect(api, progress=False, **options)]


async def test_collect_yields_finished_trajectories_with_server_log_probs(api):
    before = (await api.list_envs()).total
    batches = await gather(
        api, env=ENV, num_envs=2, total_dialog_turns=16, generation={"max_new_tokens": 6}
    )
    trajectories = [t for b in batches for t in b.trajectories]
    assert all(len(b.trajectories) == 4 for b in batches)
    # rounds in flight finish: at most one extra round per other session
    assert 16 <= sum(b.num_dialog_turns for b in batches) <= 16 + 8
    for trajectory in trajectories:
        assert [(s.done, s.truncated) for s in trajectory.steps] == [(False, False), (True, True)]
        for step in trajectory.steps:
            assert step.policy_version == 0
            assert step.tokens.full == (step.tokens.prompt or []) + (step.tokens.response or [])
            scored = await api.logprobs(
                prompt_tokens=[step.tokens.prompt], response_tokens=[step.tokens.response]
            )
            assert scored.outputs[0].log_probs is not None and step.log_probs is not None
            expected = scored.outputs[0].log_probs.response or []
            assert_close(step.log_probs.response or [], expected, 1e-4)
    assert (await api.list_envs()).total == before


async def test_collect_groups_get_advantages_and_match_the_rollouts_shape(api):
    env = {**ENV, "batch_size": 4, "repeats": 2, "max_turns": 1}
    (batch,) = await gather(api, env=env, total_dialog_turns=4, generation={"max_new_tokens": 4})
    assert [t.group for t in batch.trajectories] == [0, 0, 1, 1]
    assert all(t.advantage == 0.0 for t in batch.trajectories)  # equal rewards: std clamped
    served = await api.rollouts(env=env, num_episodes=4, generation={"max_new_tokens": 4})
    mine, theirs = batch.trajectories[0], served.trajectories[0]
    assert mine.model_dump().keys() == theirs.model_dump().keys()
    assert mine.steps[0].model_dump(exclude_none=True).keys() == (
        theirs.steps[0].model_dump(exclude_none=True).keys()
    )
    td = batch.to_tensordict()
    assert td.batch_size == torch.Size([4])
    assert td["next", "reward"].shape == (4, 1) and td["advantage"].shape == (4, 1)
    assert td["trajectory"].tolist() == [0, 1, 2, 3]


async def test_batches_hold_at_least_dialog_turns_per_batch(api):
    env = {**ENV, "batch_size": 2, "max_turns": 1}
    batches = await gather(api, env=env, total_dialog_turns=8, dialog_turns_per_batch=3)
    assert [b.num_dialog_turns for b in batches] == [4, 4]


async def test_stopping_early_still_deletes_the_sessions(api):
    before = (await api.list_envs()).total
    batches = collect(api, env=ENV, num_envs=2, total_dialog_turns=1000, progress=False)
    async with contextlib.aclosing(batches):
        async for _ in batches:
            break
    assert (await api.list_envs()).total == before


async def test_collect_refuses_episodes_that_never_end(api):
    with pytest.raises(ValueError, match="max_turns"):
        await gather(api, env={"dataset": "arithmetic"}, total_dialog_turns=1)


@pytest.mark.parametrize(("progress", "shown"), [(True, True), (False, False), (None, False)])
async def test_progress_bar_shows_on_request_or_on_a_terminal(api, capsys, progress, shown):
    env = {**ENV, "batch_size": 2, "max_turns": 1}
    async for _ in collect(api, env=env, total_dialog_turns=2, progress=progress):
        pass
    # pytest's captured stderr is not a terminal, so None (the default) stays quiet here
    assert ("turn" in capsys.readouterr().err) is shown


async def test_the_same_seed_gives_the_same_trajectories_as_rollouts(api):
    env = {**ENV, "batch_size": 2, "repeats": 2, "max_turns": 2, "seed": 3}
    generation = {"max_new_tokens": 5, "seed": 21, "temperature": 1.0}
    batches = await gather(api, env=env, total_dialog_turns=8, generation=generation)
    mine = [t for b in batches for t in b.trajectories]
    served = (await api.rollouts(env=env, num_episodes=4, generation=generation)).trajectories
    assert len(mine) == len(served) == 4

    def essence(trajectory):  # type: ignore[no-untyped-def]
        return [
            (s.tokens.full, s.reward, s.done, s.advantage) for s in trajectory.steps
        ], trajectory.group

    assert [essence(t) for t in mine] == [essence(t) for t in served]
    # a different seed samples other tokens
    other = await api.rollouts(env=env, num_episodes=4, generation={**generation, "seed": 22})
    assert [essence(t) for t in other.trajectories] != [essence(t) for t in served]


async def test_an_episodes_requests_carry_its_session_for_sticky_routing(app):
    """Every request of one session (its resets, its turns' generations, its steps) carries
    the session's id in `x-session-id`, the header Ray Serve's consistent-hash router routes
    by; requests of no session carry none."""
    import httpx
    from rlserve_client import AsyncClient
    from rlserve_client._base import SESSION_HEADER

    seen: list[httpx.Request] = []

    async def record(request: httpx.Request) -> None:
        seen.append(request)

    transport = httpx.ASGITransport(app=app)
    async with AsyncClient(base_url="http://rlserve", transport=transport) as api:
        api._http.event_hooks["request"].append(record)
        await gather(api, env=ENV, num_envs=2, total_dialog_turns=8)
        env_id = (await api.create_env(kind="tokens")).env_id
        await api.get_env(env_id)
        await api.delete_env(env_id)
    by_path: dict[str, set[str | None]] = {}
    for request in seen:
        by_path.setdefault(request.url.path, set()).add(request.headers.get(SESSION_HEADER))
    sessions = {p.split("/")[3] for p in by_path if p.startswith("/v1/envs/") and "/" in p[9:]}
    assert len(sessions) == 2
    for session in sessions:
        assert by_path[f"/v1/envs/{session}/reset"] == {session}
        assert by_path[f"/v1/envs/{session}/step"] == {session}
    assert by_path["/v1/generate"] == sessions  # each turn's generation: its session's id
    assert by_path[f"/v1/envs/{env_id}"] == {env_id}
    assert by_path["/v1/envs"] == {None}
