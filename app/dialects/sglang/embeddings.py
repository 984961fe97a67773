"""SGLang's `/v1/embeddings` on the reward model (sglang 0.5.23, `serving_embedding.py`): for a
sequence-classification model SGLang pools the last token without normalizing, so each
`embedding` is the head's raw output, which verl's reward loop reads as
`data[-1].embedding[-1]`. Inputs are a string, strings or token ids, tokenized by the reward
model's tokenizer with its special tokens, as SGLang tokenizes them."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import ConfigDict, Field

from app.common.dialect_models import (
    DialectModel,
    TokenInput,
    TokenUsage,
    token_items,
    token_rows,
    warn_ignored,
)
from app.common.inputs import InputPreparer, Prepared, text_volume
from app.deps import RewardsDep
from app.errors import REWARD_ERROR_RESPONSES

router = APIRouter(tags=["dialects: SGLang"], responses=REWARD_ERROR_RESPONSES)


class EmbeddingRequest(DialectModel):
    model_config = ConfigDict(extra="allow")

    input: TokenInput
    model: str | None = Field(default=None, description="'reward' or the reward model's source.")

    def prepared(self, preparer: InputPreparer) -> list[Prepared]:
        return token_items(preparer, self.input)


class EmbeddingObject(DialectModel):
    embedding: list[float]
    index: int
    object: str = "embedding"


class EmbeddingResponse(DialectModel):
    data: list[EmbeddingObject]
    model: str
    object: str = "list"
    usage: TokenUsage


@router.post(
    "/v1/embeddings", response_model=EmbeddingResponse, summary="Embeddings (SGLang, reward model)"
)
async def embeddings(request: EmbeddingRequest, rewards: RewardsDep) -> EmbeddingResponse:
    """Each input's reward-model head output, as SGLang answers for a classification model."""
    warn_ignored("/v1/embeddings", sorted(request.model_extra or {}))
    name = request.model or "reward"
    scored = await rewards.score(
        name,
        len(token_rows(request.input)),
        request.prepared,
        field="input",
        cost=text_volume(request),
    )
    return EmbeddingResponse(
        data=[
            EmbeddingObject(embedding=values.reward, index=index)
            for index, values in enumerate(scored.values)
        ],
        model=scored.model.info.source,
        usage=TokenUsage.of(scored.items),
    )
