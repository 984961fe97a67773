"""OpenRLHF's remote reward call (0.11: `openrlhf/utils/agent.py`, `_fetch_rewards_via_http`,
the URL given as `--reward.remote_url`, POSTed as it is): `{query, prompts, labels}`, each query
the whole sample (prompt and response, decoded with its special tokens). Answered as OpenRLHF's
own reward server answers (`openrlhf/cli/serve_rm.py`): `rewards`, `scores` (which OpenRLHF
reads first) and `extra_logs`. The queries are scored by the reward model as the text they are,
no special token added (they carry the template's own)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import ConfigDict, Field, model_validator

from app.common.dialect_models import DialectModel, warn_ignored
from app.common.inputs import InputPreparer, Prepared, text_volume
from app.common.protocol import field_error
from app.deps import RewardsDep
from app.errors import REWARD_ERROR_RESPONSES

router = APIRouter(tags=["dialects: OpenRLHF"], responses=REWARD_ERROR_RESPONSES)


class RewardQuery(DialectModel):
    model_config = ConfigDict(extra="allow")

    query: Annotated[list[str], Field(min_length=1)] = Field(
        description="Each sample's whole text: prompt and response."
    )
    prompts: list[str] | None = Field(default=None, description="Accepted; not read.")
    labels: list[Any] | None = Field(default=None, description="Accepted; not read.")

    @model_validator(mode="after")
    def _same_lengths(self) -> RewardQuery:
        for name in ("prompts", "labels"):
            given = getattr(self, name)
            if given is not None and len(given) != len(self.query):
                raise field_error(name, f"has {len(given)} entries but query has {len(self.query)}")
        return self

    def prepared(self, preparer: InputPreparer) -> list[Prepared]:
        return [Prepared(ids=preparer.encode(text, special=False)) for text in self.query]


class RewardAnswer(DialectModel):
    rewards: list[float]
    scores: list[float]
    extra_logs: dict[str, list[float]]


@router.post("/get_reward", response_model=RewardAnswer, summary="Rewards (OpenRLHF)")
async def get_reward(request: RewardQuery, rewards: RewardsDep) -> RewardAnswer:
    """The reward model's reward for each query, in OpenRLHF's reward server's shape."""
    warn_ignored("/get_reward", sorted(request.model_extra or {}))
    scored = await rewards.score(
        "reward", len(request.query), request.prepared, field="query", cost=text_volume(request)
    )
    values = [v.reward[0] for v in scored.values]
    return RewardAnswer(rewards=values, scores=values, extra_logs={})
