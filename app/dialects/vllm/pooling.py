"""vLLM's pooling routes on the reward model (vLLM 0.32: `vllm/entrypoints/pooling/classify` and
`pooling`): `/classify` answers each sequence's head output as `probs` (raw with
`use_activation: false`, as verl's reward loop asks: it reads `data[-1].probs[-1]`; else
vLLM's default, a sigmoid for one label and a softmax for several), `/pooling` the same, or the
head at every token (`task: "token_classify"`). The model answers to 'reward' and to the source
it was started with, as verl names it; inputs are a string, strings, token ids, or one
conversation (`messages`, templated with the reward model's own chat template)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import torch
from fastapi import APIRouter
from pydantic import ConfigDict, Field, model_validator

from app.common.dialect_models import (
    DialectModel,
    TokenInput,
    TokenUsage,
    dialect_schema,
    token_items,
    token_rows,
    warn_ignored,
)
from app.common.inputs import InputPreparer, Prepared, text_volume
from app.common.messages import plain_messages, template_kwargs
from app.common.protocol import InputConversation, field_error, one_of
from app.deps import RewardsDep
from app.engine.transformers.reward import RewardModel
from app.errors import REWARD_ERROR_RESPONSES
from app.rewards.service import RewardService, Scored

router = APIRouter(tags=["dialects: vLLM"], responses=REWARD_ERROR_RESPONSES)


class PoolingInput(DialectModel):
    """The completion form (`input`) or the chat form (`messages`) of vLLM's pooling
    requests; fields that change nothing here are accepted and logged, as vLLM does."""

    model_config = ConfigDict(
        extra="allow",
        json_schema_extra=dialect_schema(one_of(("input",), ("messages",))),
    )

    model: str | None = Field(default=None, description="'reward' or the reward model's source.")
    input: TokenInput | None = None
    messages: InputConversation | None = Field(
        default=None, description="One conversation, templated with the reward model's template."
    )
    use_activation: bool | None = Field(
        default=None,
        description="false: the head's raw output (verl's reward loop); true or unset: a "
        "sigmoid for one label, a softmax for several (vLLM's default).",
    )
    add_special_tokens: bool | None = Field(
        default=None,
        description="Add the tokenizer's special tokens (default: true with input, false with "
        "messages, whose template writes its own).",
    )
    add_generation_prompt: bool = Field(default=False, description="With messages.")
    chat_template_kwargs: dict[str, Any] | None = None
    truncate_prompt_tokens: int | None = Field(
        default=None,
        description="Only unset or -1: a sequence longer than the reward model's context is "
        "refused, never cut.",
        json_schema_extra={"enum": [None, -1]},
    )

    @model_validator(mode="after")
    def _one_input(self) -> PoolingInput:
        if (self.input is None) == (self.messages is None):
            raise field_error("input", "give exactly one of input or messages")
        if self.truncate_prompt_tokens not in (None, -1):
            raise field_error(
                "truncate_prompt_tokens",
                "rlserve scores sequences whole: a sequence over the reward model's context is "
                "refused, never cut",
            )
        return self

    def ignored(self) -> list[str]:
        return sorted(self.model_extra or {})

    def prepared(self, preparer: InputPreparer) -> list[Prepared]:
        """The sequences as the reward model's tokenizer gives them."""
        if self.messages is not None:
            conversation = plain_messages(self.messages)
            options = template_kwargs(self.chat_template_kwargs)
            generation = self.add_generation_prompt
            item = preparer.template(conversation, generation_prompt=generation, options=options)
            if self.add_special_tokens:  # (the templated text tokenized again, as vLLM does)
                item = Prepared(ids=preparer.encode(item.text or "", special=True))
            return [item]
        return token_items(preparer, self.input, special=self.add_special_tokens is not False)


class ClassifyRequest(PoolingInput):
    pass


class PoolingRequest(PoolingInput):
    task: Literal["classify", "token_classify"] | None = Field(
        default=None,
        description="classify (the default): the head at the pooled token; token_classify: "
        "at every token.",
    )


class ClassificationData(DialectModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(DialectModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: TokenUsage


class PoolingData(DialectModel):
    index: int
    object: str = "pooling"
    data: list[float] | list[list[float]]


class PoolingResponse(DialectModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[PoolingData]
    usage: TokenUsage


@router.post("/classify", response_model=ClassificationResponse, summary="Classify (vLLM)")
async def classify(request: ClassifyRequest, rewards: RewardsDep) -> ClassificationResponse:
    """The reward model's head on each sequence, as vLLM's `/classify` answers it."""
    scored = await _scored("/classify", request, rewards)
    labels = scored.model.model.config.id2label or {}
    data = []
    for index, values in enumerate(scored.values):
        probs = _activated(scored.model, torch.tensor(values.reward), request.use_activation)
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append(
            ClassificationData(
                index=index, label=labels.get(best), probs=probs, num_classes=len(probs)
            )
        )
    return ClassificationResponse(
        id=f"classify-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=request.model or "reward",
        data=data,
        usage=TokenUsage.of(scored.items),
    )


@router.post("/pooling", response_model=PoolingResponse, summary="Pooling (vLLM)")
async def pooling(request: PoolingRequest, rewards: RewardsDep) -> PoolingResponse:
    """The reward model's head, as vLLM's `/pooling` answers it for a classification model:
    at the pooled token, or at every token (`token_classify`)."""
    scored = await _scored("/pooling", request, rewards)
    every_token = request.task == "token_classify"
    data = [
        PoolingData(
            index=index,
            data=_activated(
                scored.model,
                values.values if every_token else torch.tensor(values.reward),
                request.use_activation,
            ),
        )
        for index, values in enumerate(scored.values)
    ]
    return PoolingResponse(
        id=f"pool-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=request.model or "reward",
        data=data,
        usage=TokenUsage.of(scored.items),
    )


async def _scored(route: str, request: PoolingInput, rewards: RewardService) -> Scored:
    """The request's sequences read by the reward model it names (default: 'reward')."""
    warn_ignored(route, request.ignored())
    given = request.input
    num_items = 1 if given is None else len(token_rows(given))
    field = "messages" if request.messages is not None else "input"
    return await rewards.score(
        request.model or "reward",
        num_items,
        request.prepared,
        field=field,
        cost=text_volume(request),
    )


def _activated(model: RewardModel, values: torch.Tensor, use_activation: bool | None) -> Any:
    """vLLM's classification activation (`PoolerClassify`) over the last dimension: a sigmoid
    for one label, a softmax for several, unless `use_activation` is false; as lists."""
    if use_activation is not False:
        if values.shape[-1] < 2 or model.model.config.problem_type == "multi_label_classification":
            values = values.sigmoid()
        else:
            values = values.softmax(-1)
    return values.tolist()
