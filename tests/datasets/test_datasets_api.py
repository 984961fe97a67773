"""Uploaded datasets: checked line by line (a refused upload leaves nothing behind), owned by
the key that sent them, listed, deleted, read from the import directory only, and used by
environments by name. Runs on the fake model pair, so no model is loaded."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from app.envs import ifeval
from tests.fake.backend import FakeBackend, fake_app

KEYS = ["alice-key", "bob-key"]
NEEDS_IFEVAL = pytest.mark.skipif(ifeval.unavailable() is not None, reason="ifeval extra")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def jsonl(rows: list[object]) -> str:
    return "\n".join(json.dumps(r) for r in rows) + "\n"


QUESTIONS = [{"question": f"What is {i} + {i}?", "solution": f"#### {2 * i}"} for i in range(5)]
MAPPED = {"query": "question", "answer": "solution"}
INSTRUCTED = [
    {
        "prompt": "Describe a kite without commas.",
        "ids": ["punctuation:no_comma"],
        "args": [{}],
    },
    {
        "prompt": "Describe rain in fewer than 9 words.",
        "ids": ["length_constraints:number_words"],
        "args": [{"num_words": 9, "relation": "less than"}],
    },
]
INSTRUCTED_MAP = {
    "query": "prompt",
    "answer": None,
    "extra": {"instruction_id_list": "ids", "kwargs": "args"},
}


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    pair = FakeBackend("policy", lambda t: -0.5), FakeBackend("reference", lambda t: -0.5)
    async with fake_app(
        tmp_path,
        *pair,
        auth={"api_keys": KEYS},
        datasets={"max_per_key": 3, "max_rows": 6, "max_bytes": 4096},
    ) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as c:
            yield c


async def upload(
    client: httpx.AsyncClient, body: dict[str, object], status: int = 201, key: str = KEYS[0]
) -> dict[str, object]:
    response = await client.post("/v1/datasets", json=body, headers=bearer(key))
    assert response.status_code == status, response.text
    out: dict[str, object] = response.json()
    return out


async def names(client: httpx.AsyncClient, key: str = KEYS[0]) -> list[str]:
    listed = (await client.get("/v1/datasets", headers=bearer(key))).json()
    return [d["name"] for d in listed["datasets"] if not d["bundled"]]


async def test_an_upload_with_a_field_mapping_serves_an_environment(client):
    info = await upload(client, {"name": "sums", "jsonl": jsonl(QUESTIONS), "fields": MAPPED})
    assert (info["rows"], info["bundled"], info["fields"]) == (5, False, [])
    listed = (await client.get("/v1/datasets", headers=bearer(KEYS[0]))).json()["datasets"]
    assert {d["name"] for d in listed if d["bundled"]} == {"addition", "arithmetic", "ifeval"}
    assert await names(client) == ["sums"]
    env = {"dataset": "sums", "reward": "gsm8k", "batch_size": 5, "seed": 1}
    created = await client.post("/v1/envs", json=env, headers=bearer(KEYS[0]))
    assert created.status_code == 201, created.text
    env_id = created.json()["env_id"]
    reset = await client.post(f"/v1/envs/{env_id}/reset", json={}, headers=bearer(KEYS[0]))
    shown = {o["history"][-1]["content"] for o in reset.json()["observations"]}
    assert shown == {q["question"] for q in QUESTIONS}  # every row drawn once
    # the mapped answer is the one the reward checks
    actions = []
    for o in reset.json()["observations"]:
        number = int(o["history"][-1]["content"].split()[2])
        actions.append({"text": f"<answer>{2 * number}</answer>"})
    step = await client.post(
        f"/v1/envs/{env_id}/step", json={"actions": actions}, headers=bearer(KEYS[0])
    )
    assert [o["reward"] for o in step.json()["outputs"]] == [1.0] * 5


@pytest.mark.parametrize(
    ("text", "fields", "line", "words"),
    [
        ('{"question": "a", "solution": "1"}\n{"question": "b"\n', MAPPED, 2, "not JSON"),
        ('{"question": "a", "solution": "1"}\n\n["b", "2"]\n', MAPPED, 3, "JSON object"),
        ('{"question": "a", "solution": "1"}\n{"solution": "2"}\n', MAPPED, 2, "'question'"),
        (
            '{"question": "a", "solution": "1"}\n{"question": " ", "solution": "2"}',
            MAPPED,
            2,
            "'question'",
        ),
        ('{"question": "a"}\n', MAPPED, 1, "'solution'"),
        ('{"question": "a", "solution": [1]}\n', MAPPED, 1, "'solution'"),
        ('{"prompt": "a", "ids": []}\n', INSTRUCTED_MAP, 1, "'args'"),
    ],
)
async def test_a_bad_line_is_refused_by_number_and_field_and_nothing_is_stored(
    client, text, fields, line, words
):
    error = (await upload(client, {"name": "bad", "jsonl": text, "fields": fields}, 422))["error"]
    assert error["param"] == "jsonl"  # type: ignore[index]
    assert f"line {line}" in error["message"] and words in error["message"]  # type: ignore[index]
    assert await names(client) == []
    assert (await client.get("/v1/datasets/bad", headers=bearer(KEYS[0]))).status_code == 404


@NEEDS_IFEVAL
async def test_rows_are_checked_for_the_reward_named_at_upload_and_at_session_creation(client):
    broken = [*INSTRUCTED, {"prompt": "p", "ids": ["keywords:existence"], "args": [{}]}]
    body = {"name": "inst", "jsonl": jsonl(broken), "fields": INSTRUCTED_MAP, "reward": "ifeval"}
    error = (await upload(client, body, 422))["error"]
    assert "line 3, field 'kwargs[0]'" in error["message"]  # type: ignore[index]
    assert await names(client) == []
    # stored without naming the reward, the bad row is caught when a session would use it
    await upload(client, {**body, "reward": None})
    env = {"dataset": "inst", "reward": "ifeval", "batch_size": 1}
    refused = await client.post("/v1/envs", json=env, headers=bearer(KEYS[0]))
    assert refused.status_code == 422
    assert refused.json()["error"]["param"] == "dataset"
    assert "row 3 of 'inst', field 'kwargs[0]'" in refused.json()["error"]["message"]
    # an explicit reset must carry the fields the reward reads
    created = await client.post("/v1/envs", json={**env, "dataset": None}, headers=bearer(KEYS[0]))
    env_id = created.json()["env_id"]
    reset = {"query": ["q"], "fields": [{"instruction_id_list": ["no:such"], "kwargs": [{}]}]}
    bad = await client.post(f"/v1/envs/{env_id}/reset", json=reset, headers=bearer(KEYS[0]))
    assert bad.status_code == 422
    assert bad.json()["error"]["param"] == "fields[0].instruction_id_list[0]"
    bare = await client.post(
        f"/v1/envs/{env_id}/reset", json={"query": ["q"]}, headers=bearer(KEYS[0])
    )
    assert bare.status_code == 422
    assert bare.json()["error"]["param"] == "fields[0].instruction_id_list"


@NEEDS_IFEVAL
async def test_an_ifeval_episode_on_uploaded_rows_scores_each_rows_instructions(client):
    body = {"name": "inst", "jsonl": jsonl(INSTRUCTED), "fields": INSTRUCTED_MAP}
    await upload(client, {**body, "reward": "ifeval"})
    env = {"dataset": "inst", "reward": "ifeval", "batch_size": 2, "seed": 0}
    env_id = (await client.post("/v1/envs", json=env, headers=bearer(KEYS[0]))).json()["env_id"]
    reset = await client.post(f"/v1/envs/{env_id}/reset", json={}, headers=bearer(KEYS[0]))
    prompts = [o["history"][-1]["content"] for o in reset.json()["observations"]]
    text = "<answer>A red kite, high up, dances in the wind all day long</answer>"
    step = await client.post(
        f"/v1/envs/{env_id}/step",
        json={"actions": [{"text": text}] * 2},
        headers=bearer(KEYS[0]),
    )
    by_prompt = {p: o for p, o in zip(prompts, step.json()["outputs"], strict=True)}
    comma = by_prompt["Describe a kite without commas."]
    words = by_prompt["Describe rain in fewer than 9 words."]
    assert comma["info"]["reward"]["instruction_id_list"] == ["punctuation:no_comma"]
    assert comma["info"]["reward"]["inst_level_strict_acc"] == [False]  # it has commas
    assert words["info"]["reward"]["inst_level_strict_acc"] == [False]  # 13 words
    assert comma["reward"] == pytest.approx(0.1) and comma["terminated"]


async def test_datasets_belong_to_the_key_that_uploaded_them(client):
    alice, bob = KEYS
    await upload(client, {"name": "mine", "jsonl": jsonl(QUESTIONS), "fields": MAPPED})
    assert await names(client, bob) == []
    for method in ("GET", "DELETE"):
        theirs = await client.request(method, "/v1/datasets/mine", headers=bearer(bob))
        assert theirs.status_code == 404
    env = {"dataset": "mine", "reward": "none"}
    refused = await client.post("/v1/envs", json=env, headers=bearer(bob))
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "dataset"
    # bob may use the same name for his own rows
    await upload(client, {"name": "mine", "jsonl": jsonl(QUESTIONS[:2]), "fields": MAPPED}, key=bob)
    assert (await client.get("/v1/datasets/mine", headers=bearer(bob))).json()["rows"] == 2
    assert (await client.get("/v1/datasets/mine", headers=bearer(alice))).json()["rows"] == 5


async def test_names_quotas_and_size_limits(client):
    body = {"name": "a", "jsonl": jsonl(QUESTIONS), "fields": MAPPED}
    await upload(client, body)
    taken = (await upload(client, body, 409))["error"]
    assert taken["param"] == "name"  # type: ignore[index]
    bundled = (await upload(client, {**body, "name": "arithmetic"}, 409))["error"]
    assert "bundled" in bundled["message"]  # type: ignore[index]
    assert (await client.delete("/v1/datasets/ifeval", headers=bearer(KEYS[0]))).status_code == 409
    bad_name = (await upload(client, {**body, "name": "../x"}, 422))["error"]
    assert bad_name["param"] == "name"  # type: ignore[index]
    both = (await upload(client, {**body, "name": "b", "path": "x.jsonl"}, 422))["error"]
    assert both["param"] == "jsonl"  # type: ignore[index]
    many = [QUESTIONS[0]] * 7  # the fixture allows 6 rows
    rows = (await upload(client, {**body, "name": "b", "jsonl": jsonl(many)}, 422))["error"]
    assert "more than 6 rows" in rows["message"]  # type: ignore[index]
    big = [{"question": "x" * 3000, "solution": "1"}, {"question": "y" * 2000, "solution": "2"}]
    size = (await upload(client, {**body, "name": "b", "jsonl": jsonl(big)}, 413))["error"]
    assert size["param"] == "jsonl"  # type: ignore[index]
    await upload(client, {**body, "name": "b"})
    await upload(client, {**body, "name": "c"})
    full = await client.post("/v1/datasets", json={**body, "name": "d"}, headers=bearer(KEYS[0]))
    assert full.status_code == 429
    assert await names(client) == ["a", "b", "c"]
    assert (await client.delete("/v1/datasets/a", headers=bearer(KEYS[0]))).status_code == 204
    assert (await client.delete("/v1/datasets/a", headers=bearer(KEYS[0]))).status_code == 404
    await upload(client, {**body, "name": "d"})


async def test_a_session_whose_dataset_was_deleted_says_so_at_reset(client):
    await upload(client, {"name": "gone", "jsonl": jsonl(QUESTIONS), "fields": MAPPED})
    env = {"dataset": "gone", "reward": "none", "batch_size": 1}
    env_id = (await client.post("/v1/envs", json=env, headers=bearer(KEYS[0]))).json()["env_id"]
    assert (await client.delete("/v1/datasets/gone", headers=bearer(KEYS[0]))).status_code == 204
    reset = await client.post(f"/v1/envs/{env_id}/reset", json={}, headers=bearer(KEYS[0]))
    assert reset.status_code == 409
    assert reset.json()["error"]["param"] == "dataset"
    # rows given explicitly still work: nothing is drawn from the dataset
    given = await client.post(
        f"/v1/envs/{env_id}/reset", json={"query": ["1+1?"]}, headers=bearer(KEYS[0])
    )
    assert given.status_code == 200, given.text


async def test_files_are_read_from_the_import_directory_only(client, tmp_path):
    imports = tmp_path / "data" / "imports"
    imports.mkdir(parents=True)
    (imports / "sums.jsonl").write_text(jsonl(QUESTIONS))
    secret = tmp_path / "secret.jsonl"
    secret.write_text(jsonl(QUESTIONS))
    (imports / "link.jsonl").symlink_to(secret)
    info = await upload(client, {"name": "sums", "path": "sums.jsonl", "fields": MAPPED})
    assert info["rows"] == 5
    absolute = await upload(
        client, {"name": "abs", "path": str(imports / "sums.jsonl"), "fields": MAPPED}
    )
    assert absolute["rows"] == 5
    strange = ("0" * 300, "a\x00b", "link-loop.jsonl")
    (imports / "link-loop.jsonl").symlink_to(imports / "link-loop.jsonl")
    for path in (
        "../secret.jsonl",
        str(secret),
        "link.jsonl",
        "missing.jsonl",
        "/etc/passwd",
        ".",
        *strange,
    ):
        error = (await upload(client, {"name": "x", "path": path, "fields": MAPPED}, 422))["error"]
        assert error["param"] == "path", path  # type: ignore[index]
        # (a name no file call can take is refused before any: tests/api/test_server_paths.py)
        unusable = path in strange[:2]
        why = "a path" if unusable else "import directory"
        assert why in error["message"], (path, error)  # type: ignore[index]
    (imports / "latin1.jsonl").write_bytes(b'{"question": "caf\xe9", "solution": "1"}\n')
    error = await upload(client, {"name": "x", "path": "latin1.jsonl", "fields": MAPPED}, 422)
    assert "UTF-8" in error["error"]["message"]  # type: ignore[index]
    assert sorted(await names(client)) == ["abs", "sums"]
