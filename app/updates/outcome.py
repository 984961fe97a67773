"""What a committed weight update answers: the new versions, its size and its pause."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from app.updates.types import AdapterVersion, Applied, Versions
from app.weights.lora import LoraAdapter

logger = logging.getLogger(__name__)


def updated(
    versions: Mapping[str, int],
    model: str,
    version: int,
    num_tensors: int,
    num_bytes: int,
    paused: float,
    start: float,
    adapter: LoraAdapter | None = None,
    *,
    digest: str | None = None,
    snapshot: str | None = None,
) -> Applied:
    """The answer to a committed update of `model`; `version` is the one it published, and
    `versions` the served ones (the others' stay as they are). With `adapter`, the update
    served that adapter's new version, and every model keeps its own. `digest`: the weights'
    digest `model` serves after it."""
    if adapter is None:
        logger.info(
            "loaded %d tensors (%d bytes) into %s as version %d; serving paused %.3f s",
            num_tensors,
            num_bytes,
            model,
            version,
            paused,
        )
        now = dict(versions, **{model: version})
    else:
        logger.info(
            "received %d tensors (%d bytes) as adapter '%s' version %d",
            num_tensors,
            num_bytes,
            adapter.name,
            adapter.version,
        )
        now = dict(versions)
    return Applied(
        model=model,
        versions=Versions(policy=now["policy"], reference=now["reference"]),
        version=now[model],
        num_tensors=num_tensors,
        num_bytes=num_bytes,
        paused_s=paused,
        total_s=time.perf_counter() - start,
        adapter=AdapterVersion(adapter.name, adapter.version) if adapter is not None else None,
        digest=digest,
        snapshot=snapshot,
    )
