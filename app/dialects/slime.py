"""slime's remote reward model (`--rm-type remote_rm --rm-url URL`; THUDM/slime at commit
624b824a898ab0ec1fcb4d373004c7f3852bf515, `slime/rollout/rm_hub/__init__.py`, `remote_rm`):
one POST per sample, `{prompt, response, label}`, the whole JSON answer becoming the sample's
reward. Answered at `/slime/reward` as a bare number, or, with `?reward_key=NAME` on the URL
(slime posts to the URL as it is), as `{NAME: number}` for a trainer run with
`--reward-key NAME`. A prompt given as messages is templated with the reward model's template
and the response appended as the assistant's turn; a prompt given as text (slime's templated
prompt) is scored with the response appended, no special token added."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import ConfigDict, Field

from app.common.dialect_models import DialectModel, warn_ignored
from app.common.inputs import InputPreparer, Prepared, text_volume
from app.common.messages import plain_messages
from app.common.protocol import InputConversation
from app.deps import RewardsDep
from app.errors import REWARD_ERROR_RESPONSES

router = APIRouter(tags=["dialects: slime"], responses=REWARD_ERROR_RESPONSES)


class SampleBody(DialectModel):
    model_config = ConfigDict(extra="allow")

    prompt: str | InputConversation
    response: str
    label: Any = Field(default=None, description="Accepted; not read.")

    def prepared(self, preparer: InputPreparer) -> list[Prepared]:
        if isinstance(self.prompt, str):
            return [Prepared(ids=preparer.encode(self.prompt + self.response, special=False))]
        conversation = [
            *plain_messages(self.prompt),
            {"role": "assistant", "content": self.response},
        ]
        return [preparer.template(conversation, generation_prompt=False)]


@router.post(
    "/slime/reward",
    response_model=float | dict[str, float],
    summary="A sample's reward (slime's remote reward model)",
)
async def slime_reward(
    body: SampleBody,
    rewards: RewardsDep,
    reward_key: Annotated[
        str | None, Query(min_length=1, max_length=256, description="slime's --reward-key")
    ] = None,
) -> float | dict[str, float]:
    """The reward model's reward for the sample: a number, or `{reward_key: number}`."""
    warn_ignored("/slime/reward", sorted(body.model_extra or {}))
    field = "prompt" if isinstance(body.prompt, list) else "response"
    scored = await rewards.score("reward", 1, body.prepared, field=field, cost=text_volume(body))
    reward = scored.values[0].reward[0]
    return reward if reward_key is None else {reward_key: reward}
