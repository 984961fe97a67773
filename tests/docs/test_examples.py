"""Every example in the README and the docs runs, against a real server on the default model
(SmolLM2-135M-Instruct, with its frozen copy as the reference, and the built-in reward model
beside it, as `./scripts/serve.sh --reward-model builtin:tiny-reward` serves them), so a
renamed route, field or script breaks the build rather than the reader, and what an example
prints is what the page shows after it. The blocks' `localhost:8000` is that server. See
`tests/docs/examples.py` for what counts as an example, how one says it cannot run, and how
shown output is compared."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs.examples import ROOT, Example, examples, fresh_server, pages, shown_matches
from tests.e2e.server import Server, running_server

pytestmark = pytest.mark.slow
BLOCK_TIMEOUT_S = 600
PAGES = [page for page in pages() if examples(page)]
# Runs a page's Python blocks, one per line of JSON on stdin, in one interpreter (a block may use
# an earlier block's names); answers each with one line of JSON on the real stdout.
_DRIVER = """
import contextlib, io, json, os, sys, traceback
# Answers go out on a copy of stdout; fd 1 itself joins stderr, where a child process's
# output then lands instead of in the answers.
answers, namespace = os.fdopen(os.dup(1), "w"), {"__name__": "__main__"}
os.dup2(2, 1)
for line in sys.stdin:
    block, out = json.loads(line), io.StringIO()
    error = None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            exec(compile(block["code"], block["name"], "exec"), namespace)
    except SystemExit as stop:
        if stop.code not in (None, 0):
            error = f"exited with {stop.code}"
    except BaseException:
        error = traceback.format_exc()
    answers.write(json.dumps({"error": error, "output": out.getvalue()[-100000:]}) + "\\n")
    answers.flush()
"""


@contextlib.contextmanager
def docs_server(data: Path) -> Iterator[Server]:
    env = {
        "RLSERVE_MODELS__MODEL": "builtin:smollm2-135m-instruct",
        "RLSERVE_MODELS__REWARD_MODEL": "builtin:tiny-reward",
        "RLSERVE_STORAGE__DATA_DIR": str(data),
    }
    with running_server(env=env, log=data / "server.log", ready_timeout=300) as server:
        yield server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with docs_server(tmp_path_factory.mktemp("docs-server")) as server:
        yield server


def _here(code: str, server: Server) -> str:
    address = server.url.removeprefix("http://")
    return code.replace("localhost:8000", address).replace("127.0.0.1:8000", address)


def _run_bash(example: Example, server: Server, env: dict[str, str]) -> str:
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", _here(example.code, server)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    assert done.returncode == 0, (
        f"{example.name} exited with {done.returncode}\n--- code\n{example.code}"
        f"--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}"
    )
    return done.stdout


class _Interpreter:
    """One Python process for a page's blocks."""

    def __init__(self, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _DRIVER],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def run(self, example: Example, server: Server) -> str:
        assert self.process.stdin is not None and self.process.stdout is not None
        block = {"name": example.name, "code": _here(example.code, server)}
        self.process.stdin.write(json.dumps(block) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()  # the per-test timeout bounds the wait
        assert line, f"{example.name}: the interpreter died"
        answer = json.loads(line)
        assert answer["error"] is None, (
            f"{example.name} failed\n--- code\n{example.code}--- output\n"
            f"{answer['output'][-4000:]}\n--- error\n{answer['error']}"
        )
        return str(answer["output"])

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_the_page_examples_run(page: Path, server: Server, tmp_path: Path) -> None:
    """Every example runs, and prints what the page shows after it. The commands a reader
    runs after ./scripts/serve.sh (.venv/bin/python, .venv/bin/rlserve, curl, python3) are
    found as they are: nothing is put on PATH for them."""
    found = examples(page)
    runnable = [e for e in found if e.skip is None]
    unlike: list[str] = []
    with contextlib.ExitStack() as stack:
        if fresh_server(page):  # (its shown output counts on a server of its own)
            (tmp_path / "server").mkdir()
            server = stack.enter_context(docs_server(tmp_path / "server"))
        env = {**os.environ, "RLSERVE_URL": server.url}
        interpreter = _Interpreter(env)
        stack.callback(interpreter.close)
        for example in runnable:
            if example.language == "bash":
                printed = _run_bash(example, server, env)
            else:
                printed = interpreter.run(example, server)
            if example.shown is not None and not shown_matches(example.shown, printed):
                unlike.append(
                    f"{example.name} printed what its page does not show\n--- shown\n"
                    f"{example.shown}\n--- printed\n{printed[-4000:]}"
                )
    assert not unlike, "\n".join(unlike) + "\n(tests/docs/examples.py says how they compare)"
    skipped = [f"{e.name} ({e.skip})" for e in found if e.skip is not None]
    if skipped and not runnable:
        pytest.skip("every example here is marked: " + "; ".join(skipped))


def test_every_skipped_example_says_why() -> None:
    for page in pages():
        for example in examples(page):  # raises on an unclosed fence, a bare or odd tag
            assert example.skip is None or example.skip.strip(), example.name


SMOKED = "the same command runs in CI in tests/bench/test_bench_smoke.py"


def test_examples_left_to_the_bench_smokes_are_their_commands() -> None:
    """A page's benchmark smoke runs are not run twice: the ones marked so are exactly a
    `bench/NAME.py --quick` run that tests/bench/test_bench_smoke.py makes (and checks)."""
    smoke = (ROOT / "tests" / "bench" / "test_bench_smoke.py").read_text()
    left = [e for page in pages() for e in examples(page) if (e.skip or "").startswith(SMOKED)]
    assert left
    for example in left:
        command = re.fullmatch(
            r'\.venv/bin/python bench/(\w+)\.py --quick --output "\$\(mktemp -d\)"(  +#[^\n]*)?\n',
            example.code,
        )
        assert command is not None, example.name
        assert f'run_quick("{command[1]}"' in smoke, example.name
