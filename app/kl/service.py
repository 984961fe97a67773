"""KL between the policy and the reference model, per token, with optional reward shaping."""

from __future__ import annotations

import math

from app.common.containers import TokenFields
from app.common.failures import invalid
from app.common.inputs import Prepared
from app.common.service import ModelServing
from app.kl.estimators import per_token_kl, shape_rewards
from app.kl.protocol import KLRequest, KLResponse, KLSample


class KLService(ModelServing):
    async def kl(self, request: KLRequest) -> KLResponse:
        pair = self.registry.get_pair(request.model)
        field = request.given_inputs()[0]
        if request.assistant_only and field not in ("messages", "prompt_text", "prompt_tokens"):
            raise invalid(
                "assistant_only",
                f"needs messages or a prompt/response split to know which tokens count, got "
                f"{field}; send assistant_only=false to count every token",
            )
        prepared = (await self.sequences(request, request.model)).items
        given = request.policy_log_probs
        if given is not None:
            for i, (item, values) in enumerate(zip(prepared, given, strict=True)):
                if len(values) != len(item.ids):
                    raise invalid(
                        f"policy_log_probs[{i}]",
                        f"has {len(values)} values but sequence {i} has {len(item.ids)} tokens "
                        "(tokens.full)",
                    )
        sequences = [item.ids for item in prepared]
        async with self.registry.reading(pair.policy) as version:
            if given is None:
                policy, reference = map(list, zip(*await pair.score(sequences), strict=True))
            else:
                policy, reference = given, await pair.reference.score(sequences)
        outputs = [
            _sample(i, item, p, q, request)
            for i, (item, p, q) in enumerate(zip(prepared, policy, reference, strict=True))
        ]
        return KLResponse(
            policy_version=self.registry.answered(pair.policy, version),
            estimator=request.estimator,
            outputs=outputs,
        )


def _sample(
    index: int,
    item: Prepared,
    policy: list[float],
    reference: list[float],
    request: KLRequest,
) -> KLSample:
    """One sequence's answer; every number in it finite, or a 422 naming the input that
    overflowed (given log-probs, or the reward with the coefficient)."""
    mask = item.split().counted(assistant_only=request.assistant_only)
    try:
        kl = per_token_kl(policy, reference, mask, request.estimator)
    except OverflowError:
        kl = [math.inf]
    num_counted = sum(mask)
    total = sum(kl)
    if not math.isfinite(total) or not all(map(math.isfinite, kl)):
        raise invalid(
            f"policy_log_probs[{index}]",
            "the KL estimate overflows a float for these log-probs (log p - log q too large)",
        )
    shaped = None
    if request.rewards is not None:
        reward = request.rewards[index]
        shaped = shape_rewards(kl, mask, reward, request.coeff, request.reward_placement)
        if not all(map(math.isfinite, shaped)):
            raise invalid(f"rewards[{index}]", "reward - coeff * KL overflows a float")
    return KLSample(
        tokens=TokenFields(full=item.ids),
        mask=mask,
        kl=kl,
        policy_log_probs=[v if m else 0.0 for v, m in zip(policy, mask, strict=True)],
        ref_log_probs=[v if m else 0.0 for v, m in zip(reference, mask, strict=True)],
        kl_sum=total,
        kl_mean=total / num_counted if num_counted else 0.0,
        num_counted=num_counted,
        shaped_rewards=shaped,
    )
