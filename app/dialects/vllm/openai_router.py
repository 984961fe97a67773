"""vLLM's routes that belong to its OpenAI server (loading and unloading LoRA adapters, the
render and derender routes of disaggregated sampling), answered as it answers the OpenAI
routes: an invalid request is a 400."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from app.common.failures import invalid, worded
from app.deps import (
    CallerDep,
    OwnerDep,
    RegistryDep,
    WeightsDep,
)
from app.dialects.common import LORA_WORDS
from app.dialects.openai.answers import ChatCompletion, Completion
from app.dialects.openai.protocol import ChatCompletionRequest, CompletionRequest
from app.dialects.openai.router import RESPONSES, OpenAIDep, OpenAIRoute
from app.dialects.vllm import render
from app.dialects.vllm.protocol import (
    DerenderChatRequest,
    DerenderCompletionRequest,
    LoadLoRAAdapter,
    RenderedRequest,
    UnloadLoRAAdapter,
)
from app.errors import (
    ErrorResponse,
)
from app.ops.access import Access, access

ADMIN = access(Access.ADMIN)
render_router = APIRouter(tags=["vLLM dialect"], route_class=OpenAIRoute)
LORA_RESPONSES = {
    **{status: RESPONSES[status] for status in RESPONSES if status != 200},
    200: {
        "description": "vLLM's plain-text confirmation",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    },
    404: {"model": ErrorResponse, "description": "No adapter folder there; no such adapter"},
    409: {"model": ErrorResponse, "description": "The name is a served model's"},
}


@render_router.post(
    "/v1/load_lora_adapter",
    response_model=None,
    responses=LORA_RESPONSES,
    summary="Load a LoRA adapter (vLLM)",
    openapi_extra=ADMIN,
)
async def load_lora_adapter(
    request: LoadLoRAAdapter, weights: WeightsDep, registry: RegistryDep, caller: CallerDep
) -> PlainTextResponse:
    """POST /v1/adapters in vLLM's words (its runtime LoRA updating): with `load_inplace`, a
    loaded name's new tensors become its next version. Answered in vLLM's plain text."""
    name = request.lora_name
    if name in registry.adapters and not request.load_inplace:
        raise invalid(
            "lora_name",
            f"The lora adapter '{name}' has already been loaded. If you want to load the "
            "adapter in place, set 'load_inplace' to True.",
        )
    with worded(LORA_WORDS):
        await weights.load_adapter(name, request.lora_path, caller=caller)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@render_router.post(
    "/v1/unload_lora_adapter",
    response_model=None,
    responses=LORA_RESPONSES,
    summary="Unload a LoRA adapter (vLLM)",
    openapi_extra=ADMIN,
)
async def unload_lora_adapter(
    request: UnloadLoRAAdapter, weights: WeightsDep, caller: CallerDep
) -> PlainTextResponse:
    """DELETE /v1/adapters/{name} in vLLM's words (404 for a name not loaded)."""
    with worded(LORA_WORDS):
        await weights.unload_adapter(request.lora_name, caller=caller)
    return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")


RENDER_RESPONSES = {status: RESPONSES[status] for status in RESPONSES if status != 200}


@render_router.post(
    "/v1/chat/completions/render",
    response_model=RenderedRequest,
    responses=RENDER_RESPONSES,
    summary="Render a chat request (vLLM)",
)
async def render_chat(
    body: ChatCompletionRequest, service: OpenAIDep, owner: OwnerDep
) -> RenderedRequest:
    """The `/inference/v1/generate` body that samples this chat request: its prompt's token
    ids, exactly as `/v1/chat/completions` renders it, and its sampling parameters."""
    return await render.render_chat(service, body, owner)


@render_router.post(
    "/v1/completions/render",
    response_model=list[RenderedRequest],
    responses=RENDER_RESPONSES,
    summary="Render a completion request (vLLM)",
)
async def render_completion(
    body: CompletionRequest, service: OpenAIDep, owner: OwnerDep
) -> list[RenderedRequest]:
    """One `/inference/v1/generate` body per prompt of this completion request."""
    return await render.render_completion(service, body, owner)


@render_router.post(
    "/v1/chat/completions/derender",
    response_model=ChatCompletion,
    response_model_exclude_none=True,
    responses=RENDER_RESPONSES,
    summary="Derender a generation as a chat reply (vLLM)",
)
async def derender_chat(
    body: DerenderChatRequest, service: OpenAIDep, owner: OwnerDep
) -> ChatCompletion:
    """`/inference/v1/generate`'s answer to a rendered chat request, as the chat reply
    `/v1/chat/completions` gives for those tokens (reasoning and tool calls parsed)."""
    return await render.derender_chat(service, body, owner)


@render_router.post(
    "/v1/completions/derender",
    response_model=Completion,
    response_model_exclude_none=True,
    responses=RENDER_RESPONSES,
    summary="Derender generations as a completion (vLLM)",
)
async def derender_completion(
    body: DerenderCompletionRequest, service: OpenAIDep, owner: OwnerDep
) -> Completion:
    """`/inference/v1/generate`'s answers, one per rendered prompt, as the completion reply."""
    return await render.derender_completion(service, body, owner)
