"""SGLang's `/v1/embeddings` on the reward model (sglang 0.5.23, `serving_embedding.py`): for a
sequence-classification model SGLang pools the last token without normalizing, so each
`embedding` is the head's raw output, which verl's reward loop reads as
`data[-1].embedding[-1]`. Inputs are a string, strings or token ids, tokenized by the reward
model's tokenizer with its special tokens, as SGLang tokenizes them."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import ConfigDict, Field

from app.common.dialect_models import DialectModel, TokenInput, warn_ignored
from app.common.inputs import InputPreparer, Prepared
from app.deps import RewardsDep
from app.errors import REWARD_ERROR_RESPONSES

router = APIRouter(tags=["dialects: SGLang"], responses=REWARD_ERROR_RESPONSES)


class EmbeddingRequest(DialectModel):
    model_config = ConfigDict(extra="allow")

    input: TokenInput
    model: str | None = Field(default=None, description="'reward' or the reward model's source.")

    def rows(self) -> list[str | list[int]]:
        given: Any = self.input
        return [given] if isinstance(given, str) or isinstance(given[0], int) else list(given)

    def prepared(self, preparer: InputPreparer) -> list[Prepared]:
        return [
            Prepared(ids=preparer.encode(row) if isinstance(row, str) else row)
            for row in self.rows()
        ]


class EmbeddingObject(DialectModel):
    embedding: list[float]
    index: int
    object: str = "embedding"


class EmbeddingUsage(DialectModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class EmbeddingResponse(DialectModel):
    data: list[EmbeddingObject]
    model: str
    object: str = "list"
    usage: EmbeddingUsage


@router.post(
    "/v1/embeddings", response_model=EmbeddingResponse, summary="Embeddings (SGLang, reward model)"
)
async def embeddings(request: EmbeddingRequest, rewards: RewardsDep) -> EmbeddingResponse:
    """Each input's reward-model head output, as SGLang answers for a classification model."""
    warn_ignored("/v1/embeddings", sorted(request.model_extra or {}))
    name = request.model or "reward"
    scored = await rewards.score(name, len(request.rows()), request.prepared, field="input")
    tokens = sum(len(item.ids) for item in scored.items)
    return EmbeddingResponse(
        data=[
            EmbeddingObject(embedding=values.reward, index=index)
            for index, values in enumerate(scored.values)
        ],
        model=scored.model.info.source,
        usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )
