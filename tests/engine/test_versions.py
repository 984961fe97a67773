"""The version an update publishes (`resolve_version`): the next one, the trainer's own, or,
for a restarted trainer, the next one in a new lineage; never above MAX_VERSION."""

from __future__ import annotations

import pytest

from app.common.failures import Conflict, InvalidInput
from app.common.roles import Role
from app.engine.gate import Lineage, resolve_version
from app.engine.types import MAX_VERSION


def test_versions_count_up_and_restarted_trainers_open_a_lineage() -> None:
    assert resolve_version("policy", 4, Lineage(), None, restartable=False) == (5, None)
    assert resolve_version("policy", 4, Lineage(), 9, restartable=False) == (9, None)
    with pytest.raises(Conflict, match="not above the current version 4"):
        resolve_version("policy", 4, Lineage(), 4, restartable=False)
    # a restarted trainer's 2 (served 4 now): the next version, its count named
    assert resolve_version("policy", 4, Lineage(), 2, restartable=True) == (5, 2)
    # in the lineage it opened at 5 (as its 2), its 3 is served as 6
    assert resolve_version("policy", 5, Lineage(1, 5, 2), 3, restartable=True) == (6, None)


def test_a_trainers_count_shifted_past_the_largest_version_is_refused() -> None:
    lineage = Lineage(1, since=1000, named=1)  # its k is served as k + 999
    assert resolve_version("policy", 1000, lineage, MAX_VERSION - 999, restartable=True) == (
        MAX_VERSION,
        None,
    )
    with pytest.raises(InvalidInput, match=f"over the largest version, {MAX_VERSION}") as refused:
        resolve_version("policy", 1000, lineage, MAX_VERSION - 998, restartable=True)
    assert refused.value.role == Role.VERSION
