"""The ledger's record of a model's updates: a partial update merges over what came before
(so one checkpoint replays them all), a whole one replaces it. Its dialect session is written
by compare-and-set."""

from __future__ import annotations

import torch
from safetensors.torch import load, save

from app.deploy.ledger import LocalLedger, merged, tensor_names
from app.updates.session import UpdateSession


def test_a_partial_update_merges_over_the_earlier_ones() -> None:
    first = {
        "a.safetensors": save({"x": torch.ones(2), "y": torch.zeros(3)}),
        "b.safetensors": save({"z": torch.ones(1, dtype=torch.bfloat16)}),
    }
    assert tensor_names(first) == {"x", "y", "z"}
    update = {"model.safetensors": save({"y": torch.arange(3.0)})}
    (data,) = merged(first, update).values()
    tensors = load(data)
    assert set(tensors) == {"x", "y", "z"}
    assert torch.equal(tensors["x"], torch.ones(2))
    assert torch.equal(tensors["y"], torch.arange(3.0))  # the later update wins
    assert tensors["z"].dtype == torch.bfloat16


def test_a_whole_update_replaces_the_record() -> None:
    first = {"a.safetensors": save({"x": torch.ones(2)})}
    whole = {"m.safetensors": save({"x": torch.zeros(2), "w": torch.ones(1)})}
    assert merged(first, whole) is whole


async def test_the_session_is_written_by_compare_and_set() -> None:
    """A write names the serial it read: one overtaken by another write, or by a reset, is
    refused and changes nothing; an open session keeps its identity until it is closed."""
    ledger = LocalLedger()
    read = await ledger.session()
    opened = await ledger.swap_session(read.serial, UpdateSession("paused"))
    assert opened is not None and opened.opened == opened.serial == 1
    assert await ledger.swap_session(read.serial, UpdateSession("explicit")) is None
    assert (await ledger.session()).kind == "paused"
    named = await ledger.swap_session(opened.serial, UpdateSession("explicit", version=3))
    assert named is not None and named.opened == 1 and named.serial == 2
    await ledger.reset_session()
    assert await ledger.swap_session(named.serial, UpdateSession("explicit", version=4)) is None
    now = await ledger.session()
    assert now.kind is None and now.opened is None and now.serial == 3
    again = await ledger.swap_session(now.serial, UpdateSession("explicit"))
    assert again is not None and again.opened == 4  # a new session, not the one reset
