"""rlserve with models that cost nothing: the real app, services, batcher and HTTP server, with
`tests/fake`'s backend in place of a loaded model (scores every token -1, writes a fixed
reply). What bench/overhead.py measures against it is the service's own cost per request and
nothing else. Settings come from the environment, as `rlserve serve` reads them.

    .venv/bin/python bench/null_server.py --port 8000
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import uvicorn
from common import ROOT  # noqa: F401  (puts the checkout on sys.path)

from app.config import Settings
from tests.fake.backend import FakeBackend, fake_app

REPLY = [97] * 64  # "aaaa...": generations are cut at their max_new_tokens


async def serve(port: int) -> None:
    settings = Settings()  # the groups the benchmark sets; fake_app chooses the rest
    groups = {name: getattr(settings, name).model_dump() for name in ("batching", "limits", "envs")}
    with tempfile.TemporaryDirectory() as tmp:
        policy = FakeBackend("policy", lambda _token: -1.0, reply=REPLY)
        reference = FakeBackend("reference", lambda _token: -1.0, reply=REPLY)
        async with fake_app(Path(tmp), policy, reference, **groups) as app:
            config = uvicorn.Config(
                app, host="127.0.0.1", port=port, lifespan="off", access_log=False
            )
            await uvicorn.Server(config).serve()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    # the event loop `rlserve serve` runs on (uvicorn's choice: uvloop where installed)
    with asyncio.Runner(loop_factory=uvicorn.Config(None).get_loop_factory()) as runner:
        runner.run(serve(parser.parse_args().port))


if __name__ == "__main__":
    main()
