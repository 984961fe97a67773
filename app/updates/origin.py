"""The checkpoint a served model started from, for `POST /v1/weights/restore`: its folder (a
hub id's snapshot in the local cache), refused when a file in it changed after the server read
it, since it would no longer hold the weights the server started with."""

from __future__ import annotations

from pathlib import Path

from app.common.failures import Conflict, NotFound
from app.common.roles import Role
from app.engine.registry import Origin
from app.weights.checkpoint import checkpoint_files


def origin_checkpoint(origin: Origin, role: Role = Role.MODEL) -> Path:
    """The folder (or file) to load to serve `origin`'s weights again."""
    path = Path(origin.source)
    if not path.exists():
        path = _hub_snapshot(origin.source, role)
    files = checkpoint_files(path, role)
    changed = [f.name for f in files if f.stat().st_ctime > origin.read_at]
    if changed:
        raise Conflict(
            f"{path} changed after the server loaded it ({', '.join(changed)}), so it "
            "no longer holds the weights the server started with; load the ones you want with "
            "POST /v1/weights/load",
            role=role,
        )
    return path


def _hub_snapshot(repo_id: str, role: Role) -> Path:
    """The local cache's copy of a hub model (never a download)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError) as exc:
        raise NotFound(
            f"the model was loaded from {repo_id!r}, which is no folder and not in the "
            f"local hub cache any more ({exc})",
            role=role,
        ) from None
