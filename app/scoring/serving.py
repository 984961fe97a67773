"""Scoring: the log-probability of every token of given sequences."""

from __future__ import annotations

from app.common.inputs import check_num_items
from app.common.samples import scored_sample
from app.config import Settings
from app.engine.registry import ModelRegistry
from app.scoring.protocol import LogProbsRequest, LogProbsResponse


class ScoringService:
    def __init__(self, registry: ModelRegistry, settings: Settings) -> None:
        self.registry = registry
        self.settings = settings

    async def score(self, request: LogProbsRequest) -> LogProbsResponse:
        served = self.registry.get(request.model)
        field = request.given_inputs()[0]
        check_num_items(request.num_items(), self.settings.max_items_per_request, field)
        preparer = served.preparer
        prepared = await preparer.off_loop(preparer.checked_sequences, request, field)
        async with self.registry.reading() as version:
            values = await served.score([item.ids for item in prepared])
        with_text = field != "tokens" and field != "prompt_tokens"
        outputs = await preparer.off_loop(
            lambda: [
                scored_sample(item, lps, preparer, with_text=with_text)
                for item, lps in zip(prepared, values, strict=True)
            ]
        )
        return LogProbsResponse(
            policy_version=version,
            model=request.model,
            pad_token_id=served.preparer.pad_token_id,
            outputs=outputs,
        )
