"""Progress bars for long work (uploads, `collect`): shown when stderr is a terminal, unless
switched on or off explicitly."""

from __future__ import annotations

from typing import Any

from tqdm.auto import tqdm


def progress_bar(*, total: int | None, enabled: bool | None, **options: Any) -> tqdm[Any]:
    """`enabled` None: a bar only on a terminal (tqdm's `disable=None`)."""
    disable = None if enabled is None else not enabled
    return tqdm(total=total, disable=disable, leave=False, **options)
