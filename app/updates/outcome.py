"""What a committed weight update answers: the new versions, its size and its pause."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from app.updates.protocol import WeightsUpdated
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
) -> WeightsUpdated:
    """The answer to a committed update of `model`; `version` is the one it published, and
    `versions` the served ones (the others' stay as they are). With `adapter`, the update
    served that adapter's new version, and every model keeps its own."""
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
    return WeightsUpdated(
        model=model,  # type: ignore[arg-type]
        policy_version=now["policy"],
        reference_version=now["reference"],
        num_tensors=num_tensors,
        num_bytes=num_bytes,
        seconds=paused,
        total_seconds=time.perf_counter() - start,
        adapter=adapter.name if adapter is not None else None,
        adapter_version=adapter.version if adapter is not None else None,
    )
