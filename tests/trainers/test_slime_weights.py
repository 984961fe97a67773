"""slime's join of its weight-update group (`connect_rollout_engines_from_distributed`) against
a real rlserve whose policy is already in another trainer's live group: the refusal reaches
slime's own call at once, where before slime waited at its rendezvous for its timeout (30
minutes by default) and then raised that instead. Its rendezvous is slime's own
`slime.utils.distributed_utils.init_process_group` (torch and packaging are all it imports);
the engine's request is `SGLangEngine.init_weights_update_group`'s POST with its
`raise_for_status`, replayed (its module imports SGLang), sent as slime sends it: fired
first, then the rendezvous, then its result. slime is on no package registry: this runs where
`SLIME_SOURCE` names a checkout of THUDM/slime (checked at `624b824a`), and skips elsewhere, CI
included (`tests/weights/test_dialect_transfer.py` lets the same rendezvous go, with SGLang's
recipe, in CI)."""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import requests
import torch.distributed as dist
from rlserve_client import Client

from tests.e2e.server import free_port
from tests.trainers.conftest import served_beside

pytestmark = pytest.mark.trainers
SOURCE = os.environ.get("SLIME_SOURCE")
if not SOURCE:
    pytest.skip("SLIME_SOURCE names no slime checkout", allow_module_level=True)
sys.path.insert(0, SOURCE)
distributed_utils = pytest.importorskip(
    "slime.utils.distributed_utils", reason="slime's distributed_utils does not import"
)


def init_weights_update_group(url: str, **payload: object) -> object:
    """`SGLangEngine.init_weights_update_group` (`_make_request`), as slime 624b824a has it."""
    response = requests.post(f"{url}/init_weights_update_group", json=payload)
    response.raise_for_status()
    return response.json()


def test_a_refused_group_reaches_slimes_own_call_at_once(tmp_path: Path) -> None:
    with served_beside(tmp_path) as server:
        # another trainer's live group holds the policy (rlserve's own, through the client)
        with Client(base_url=server.url) as client, client.weight_transfer():
            port = free_port()
            payload = {
                "master_address": "127.0.0.1",
                "master_port": port,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": "slime-pp_0",
                "backend": "gloo",
            }
            started = time.monotonic()
            with ThreadPoolExecutor(1) as pool:
                ref = pool.submit(init_weights_update_group, server.url, **payload)
                group = distributed_utils.init_process_group(
                    backend="gloo",
                    init_method=f"tcp://127.0.0.1:{port}",
                    world_size=2,
                    rank=0,
                    group_name="slime-pp_0",
                    timeout=timedelta(seconds=120),  # (slime's default is 30 minutes)
                )
                with pytest.raises(requests.HTTPError) as refused:
                    ref.result()
            took = time.monotonic() - started
            assert refused.value.response.status_code == 409
            assert "/v1/weights/transfer/close" in refused.value.response.text
            assert took < 60, took  # the rendezvous was let go, not waited out
            dist.destroy_process_group(group)
        assert httpx.get(f"{server.url}/v1/weights/transfer").json()["state"] == "idle"
