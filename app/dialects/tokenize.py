"""vLLM's and SGLang's `/tokenize` and `/detokenize` (and SGLang's `/v1/` names for them), on
the policy's tokenizer: a chat's tokens are the very prompt /v1/generate and
/v1/chat/completions build from the same messages."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import ConfigDict, Field, model_validator

from app.common.dialect_models import (
    DialectModel,
    dialect_schema,
    warn_ignored,
)
from app.common.failures import invalid
from app.common.inputs import each_named, naming, text_volume
from app.common.protocol import (
    NOT_CONTINUE_AND_OPEN,
    TokenId,
    field_error,
    one_of,
)
from app.deps import GenerationDep
from app.dialects.common import policy_side
from app.dialects.openai.protocol import ChatMessage, Tool
from app.errors import ERROR_RESPONSES
from app.generation.service import GenerationService

router = APIRouter(tags=["vLLM and SGLang dialects"], responses=ERROR_RESPONSES)


def _tokenize_schema(schema: dict[str, Any]) -> None:
    one_of(("prompt",), ("messages",))(schema)
    schema.update(NOT_CONTINUE_AND_OPEN)


class TokenizeRequest(DialectModel):
    """vLLM's TokenizeCompletionRequest or TokenizeChatRequest, and SGLang's TokenizeRequest
    (several prompts at once). Unknown fields are ignored (logged), as both servers do."""

    model_config = ConfigDict(extra="allow", json_schema_extra=dialect_schema(_tokenize_schema))

    model: str | None = None
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1024)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = Field(
        default=None,
        description="Add the tokenizer's special tokens (BOS); default: true for a prompt, "
        "false for messages (the chat template places them).",
    )
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise field_error("prompt", "give exactly one of prompt and messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise field_error(
                "continue_final_message", "needs add_generation_prompt: false (not both)"
            )
        return self


class TokenizeResponse(DialectModel):
    count: int | list[int]
    max_model_len: int
    tokens: list[int] | list[list[int]]
    token_strs: list[str] | list[list[str]] | None = None


class DetokenizeRequest(DialectModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[TokenId] | Annotated[list[list[TokenId]], Field(max_length=1024)]
    skip_special_tokens: bool | None = Field(
        default=None,
        description="Default: false on /detokenize (vLLM keeps them), true on /v1/detokenize "
        "(SGLang's default).",
    )


class DetokenizeResponse(DialectModel):
    prompt: str | list[str] = Field(description="vLLM's name for the text.")
    text: str | list[str] = Field(description="SGLang's name for the same text.")


def _tokenize(generation: GenerationService, request: TokenizeRequest) -> TokenizeResponse:
    policy_side(generation.registry, request.model)  # an adapter shares its tokenizer
    warn_ignored("/tokenize", list(request.model_extra or {}))
    served = generation.served("policy")
    preparer = served.preparer
    if request.messages is not None:
        if not preparer.has_chat_template:
            raise invalid("messages", "this model's tokenizer has no chat template")
        tools = [t.model_dump(exclude_none=True) for t in request.tools or []] or None
        options = dict(request.chat_template_kwargs or {})
        if request.continue_final_message:
            options["continue_final_message"] = True
        with naming("messages"):
            prepared = preparer.template(
                [m.for_template() for m in request.messages],
                generation_prompt=request.add_generation_prompt,
                tools=tools,
                options=options or None,
            )
        ids = prepared.ids
        if request.add_special_tokens and prepared.text is not None:
            ids = preparer.encode(prepared.text, special=True)
        rows = [ids]
    else:
        special = request.add_special_tokens is not False
        if isinstance(request.prompt, str):
            with naming("prompt"):
                rows = [preparer.encode(request.prompt, special=special)]
        else:
            texts = request.prompt or []
            rows = each_named("prompt", texts, lambda t: preparer.encode(t, special=special))
    strs = None
    if request.return_token_strs:
        strs = [list(preparer.tokenizer.convert_ids_to_tokens(ids)) for ids in rows]
    many = isinstance(request.prompt, list)
    limit = served.backend.info.max_model_len
    if many:
        return TokenizeResponse(
            count=[len(ids) for ids in rows], max_model_len=limit, tokens=rows, token_strs=strs
        )
    return TokenizeResponse(
        count=len(rows[0]),
        max_model_len=limit,
        tokens=rows[0],
        token_strs=None if strs is None else strs[0],
    )


def _detokenize(
    generation: GenerationService, request: DetokenizeRequest, skip_default: bool
) -> DetokenizeResponse:
    policy_side(generation.registry, request.model)  # an adapter shares its tokenizer
    preparer = generation.served("policy").preparer
    skip = skip_default if request.skip_special_tokens is None else request.skip_special_tokens
    rows = [row for row in request.tokens if isinstance(row, list)]
    if rows:  # SGLang's several sequences
        texts = []
        for i, row in enumerate(rows):
            preparer.check_vocabulary(row, f"tokens[{i}]")
            texts.append(preparer.decode(row, skip_special=skip))
        return DetokenizeResponse(prompt=texts, text=texts)
    ids = [t for t in request.tokens if isinstance(t, int)]
    preparer.check_vocabulary(ids, "tokens")
    text = preparer.decode(ids, skip_special=skip)
    return DetokenizeResponse(prompt=text, text=text)


@router.post(
    "/tokenize",
    response_model=TokenizeResponse,
    response_model_exclude_none=True,
    summary="Tokenize (vLLM and SGLang)",
)
@router.post(
    "/v1/tokenize",
    response_model=TokenizeResponse,
    response_model_exclude_none=True,
    summary="Tokenize (SGLang's /v1 name)",
)
async def tokenize(request: TokenizeRequest, generation: GenerationDep) -> TokenizeResponse:
    """A prompt's tokens (or several prompts', SGLang's form), or a chat's as the chat
    template renders it: token for token the prompt /v1/generate and /v1/chat/completions
    build from the same messages."""
    preparer = generation.served("policy").preparer
    return await preparer.off_loop(_tokenize, generation, request, cost=text_volume(request))


@router.post("/detokenize", response_model=DetokenizeResponse, summary="Detokenize (vLLM)")
async def detokenize(request: DetokenizeRequest, generation: GenerationDep) -> DetokenizeResponse:
    """The text of token ids (special tokens kept unless skip_special_tokens)."""
    preparer = generation.served("policy").preparer
    return await preparer.off_loop(_detokenize, generation, request, False)


@router.post(
    "/v1/detokenize", response_model=DetokenizeResponse, summary="Detokenize (SGLang's /v1 name)"
)
async def detokenize_v1(
    request: DetokenizeRequest, generation: GenerationDep
) -> DetokenizeResponse:
    """The text of token ids (special tokens skipped unless skip_special_tokens is false)."""
    preparer = generation.served("policy").preparer
    return await preparer.off_loop(_detokenize, generation, request, True)
