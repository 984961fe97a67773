"""Routes of either dialect that rlserve cannot honour, each answering an error that names it
(instead of a bare 404), so a trainer that calls one learns why at once. They are not in the
OpenAPI spec: no request to them can succeed, so they are not operations of this API."""

from __future__ import annotations

from fastapi import APIRouter

from app.common.failures import Unsupported
from app.errors import ERROR_RESPONSES
from app.ops.access import Access, access

REFUSED = {
    "/sleep": "sleep levels: rlserve keeps its weights and cache resident",
    "/wake_up": "sleep levels: rlserve keeps its weights and cache resident",
    "/start_draft_weight_update": "draft models: rlserve serves no speculative draft",
    "/weight_checker": "weight checksums: score a fixed batch to compare weights",
    "/release_memory_occupation": "releasing memory: rlserve keeps its weights resident",
    "/resume_memory_occupation": "releasing memory: rlserve keeps its weights resident",
    "/load_lora_adapter_from_tensors": "LoRA tensors as pickled bytes: rlserve unpickles "
    "nothing; save the adapter (PEFT's save_pretrained) and load its folder "
    "(/load_lora_adapter)",
    "/update_weights_from_tensor": "CUDA IPC handles: use /update_weights_from_distributed",
    "/weights_checker": "weight checksums: score a fixed batch to compare weights",
}

router = APIRouter(tags=["dialects: refused"], responses=ERROR_RESPONSES)


def _refusal(path: str, why: str) -> None:
    async def refuse() -> None:
        raise Unsupported(f"{path} is not supported by rlserve ({why})", param=path.strip("/"))

    router.add_api_route(
        path,
        refuse,
        methods=["POST"],
        summary=f"Refused: {path}",
        operation_id=f"refused_{path.strip('/').replace('/', '_')}",
        openapi_extra=access(Access.ADMIN),
        status_code=200,
        response_model=None,
        include_in_schema=False,
    )


for _path, _why in REFUSED.items():
    _refusal(_path, _why)
