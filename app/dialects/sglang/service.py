"""SGLang's generation on rlserve's services, and its weight-update calls in rlserve's terms
(the flow they drive, `/begin_weight_update` … `/end_weight_update` of SGLang 0.5.23, buckets
sent while paused by `/pause_generation` and committed at `/continue_generation`, is
`app.updates.driven`'s)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterable
from typing import Any

from app.common.dialect_models import (
    warn_ignored,
)
from app.common.failures import invalid
from app.common.routed_experts import check_prompt_start, int32_base64
from app.common.sampling import GenerationAsk, Names
from app.common.text import final_text
from app.dialects.common import Prompts, label, sample, version_number
from app.dialects.sglang.protocol import (
    GenerateOutput,
    GenerateRequest,
    MetaInfo,
    SamplingParams,
    UpdateWeightsFromDistributed,
)
from app.engine.types import Generation, Scores
from app.generation.service import GenerationService, Sampled
from app.updates.session import Bucket


def bucket_of(request: UpdateWeightsFromDistributed) -> Bucket:
    """The tensors an update call names, in rlserve's terms (`app.updates.driven` receives
    them)."""
    if len(request.dtypes) != len(request.names):
        raise invalid("dtypes", f"{len(request.dtypes)} entries for {len(request.names)} names")
    return Bucket(
        names=tuple(request.names),
        dtypes=tuple(request.dtypes),
        shapes=tuple(tuple(shape) for shape in request.shapes),
        flattened=request.load_format == "flattened_bucket",
        version=version_number(request.weight_version, "weight_version"),
        abort_all=request.abort_all_requests,
    )


async def generate(
    generation: GenerationService, request: GenerateRequest
) -> GenerateOutput | list[GenerateOutput]:
    """One sampling call for shared sampling_params (row k's random stream is /v1/generate's
    row k for the same seed); one call per input for a list of them."""
    texts, token_ids = request.prompts()
    count = len(texts if texts is not None else token_ids or [])
    rids = iter(_rids(request.rid, count))
    params = request.sampling_params
    started = time.perf_counter()
    adapters = _adapters(generation, request.lora_path, count)
    if isinstance(params, list) or len(set(adapters)) > 1:
        per_prompt = params if isinstance(params, list) else [params] * count
        groups = [(_prompts(texts, token_ids, [i]), p) for i, p in enumerate(per_prompt)]
    else:
        groups = [(_prompts(texts, token_ids, range(count)), params)]
        adapters = adapters[:1]
    runs = [
        _sample(
            generation,
            request,
            prompts,
            p,
            f"sampling_params[{i}]" if isinstance(params, list) else "sampling_params",
            model,
        )
        for i, ((prompts, p), model) in enumerate(zip(groups, adapters, strict=True))
    ]
    outputs = []
    for (_, p), sampled in zip(groups, await asyncio.gather(*runs), strict=True):
        for k, g in enumerate(sampled.generations):
            if k % p.n == 0:
                rid = next(rids)
            scores = sampled.scores_of(k)
            prompt_ids = sampled.prompts[k // p.n].ids
            name = rid if p.n == 1 else uuid.uuid4().hex
            outputs.append(
                _output(
                    generation, request, sampled.version, prompt_ids, g, scores, p, name, started
                )
            )
    return outputs[0] if request.single and len(outputs) == 1 else outputs


async def _sample(
    generation: GenerationService,
    request: GenerateRequest,
    prompt: Prompts,
    p: SamplingParams,
    field: str,
    model: str,
) -> Sampled:
    warn_ignored("/generate", [f"{field}.{name}" for name in p.ignored()])
    sampling = p.sampling_ask(
        return_prompt_log_probs=request.return_logprob and request.logprob_start_len >= 0,
        routed=request.return_routed_experts,
    )
    # SGLang's top-k log-probs come with its log-probs only (return_logprob).
    k = request.top_logprobs_num if request.return_logprob else 0
    ask = GenerationAsk(sampling, top_logprobs=k)
    names = Names(
        f"{field}.",
        {
            "min_tokens": f"{field}.min_new_tokens",
            "return_routed_experts": "return_routed_experts",
            "top_logprobs": "top_logprobs_num",
        },
    )
    resolved = generation.resolve(ask, model, names)
    return await sample(generation, prompt, resolved, n=p.n, seed=p.sampling_seed, model=model)


def _adapters(
    generation: GenerationService, lora_path: str | list[str | None] | None, count: int
) -> list[str]:
    """The model each prompt samples from: the policy, or the adapter `lora_path` names (one
    for all prompts, or one per prompt, as SGLang takes it)."""
    names = lora_path if isinstance(lora_path, list) else [lora_path] * count
    if len(names) != count:
        raise invalid("lora_path", f"has {len(names)} entries for {count} prompts (one each)")
    field = "lora_path" if not isinstance(lora_path, list) else "lora_path[{}]"
    return [
        "policy" if name is None else _adapter(generation, name, field.format(i))
        for i, name in enumerate(names)
    ]


def _adapter(generation: GenerationService, name: str, field: str) -> str:
    if name not in generation.registry.adapters:
        loaded = sorted(generation.registry.adapters)
        raise invalid(field, f"the LoRA adapter '{name}' is not served (have {loaded})")
    return name


def _prompts(
    texts: list[str] | None, token_ids: list[list[int]] | None, picked: Iterable[int]
) -> Prompts:
    """The inputs at `picked`, as text or token prompts."""
    if texts is not None:
        return Prompts(texts=[texts[i] for i in picked], field="text")
    return Prompts(token_ids=[(token_ids or [])[i] for i in picked], field="input_ids")


def _rids(rid: str | list[str] | None, count: int) -> list[str]:
    if isinstance(rid, list):
        if len(rid) != count:
            raise invalid("rid", f"{len(rid)} ids for {count} inputs")
        return rid
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    return [rid] if count == 1 else [f"{rid}_{i}" for i in range(count)]


def _output(
    generation: GenerationService,
    request: GenerateRequest,
    started_version: int,
    prompt_ids: list[int],
    g: Generation,
    scores: Scores | None,
    p: SamplingParams,
    rid: str,
    started: float,
) -> GenerateOutput:
    preparer = generation.served("policy").preparer
    text = preparer.decode(g.token_ids, skip_special=p.skip_special_tokens)
    if not p.no_stop_trim:
        text = final_text(text, p.stops)
    spans = g.versions or []
    version = spans[-1].version if spans else started_version

    def named(token: int) -> str | None:
        return preparer.decode([token]) if request.return_text_in_logprobs else None

    meta: dict[str, Any] = {}
    if request.return_logprob:
        values = g.log_probs if len(g.log_probs) == len(g.token_ids) else []
        meta["output_token_logprobs"] = [
            [v, t, named(t)] for t, v in zip(g.token_ids, values, strict=False)
        ]
        meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
        meta["input_token_logprobs"] = []
        if request.logprob_start_len >= 0:
            if request.logprob_start_len > len(prompt_ids):
                raise invalid("logprob_start_len", f"is past the prompt's {len(prompt_ids)} tokens")
            own = g.prompt_log_probs or []
            meta["input_token_logprobs"] = [
                [own[i] if i > 0 and i < len(own) else None, prompt_ids[i], named(prompt_ids[i])]
                for i in range(request.logprob_start_len, len(prompt_ids))
            ]
        if request.top_logprobs_num and scores is not None and scores.top_ids is not None:
            ids, values_k = scores.top_ids.tolist(), scores.top_log_probs.tolist()  # type: ignore[union-attr]
            meta["output_top_logprobs"] = [
                [[v, t, named(t)] for t, v in zip(row_ids, row_values, strict=True)]
                for row_ids, row_values in zip(ids, values_k, strict=True)
            ]
    if g.routed_experts is not None:
        start = request.routed_experts_start_len
        check_prompt_start(start, [len(prompt_ids)], "routed_experts_start_len")
        meta["routed_experts"] = int32_base64(g.routed_experts[start:])
    return GenerateOutput(
        text=text,
        output_ids=g.token_ids,
        meta_info=MetaInfo(
            id=rid,
            finish_reason=_finish(g, p),
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(g.token_ids),
            weight_version=label(generation.registry, version),
            weight_versions=[
                {"version": label(generation.registry, s.version), "start": s.start, "end": s.end}
                for s in spans
            ]
            or None,
            e2e_latency=time.perf_counter() - started,
            **meta,
        ),
        prompt_token_ids=prompt_ids if request.return_prompt_token_ids else None,
    )


def _finish(g: Generation, p: SamplingParams) -> dict[str, Any]:
    if g.finish_reason == "length":
        return {"type": "length", "length": p.max_new_tokens}
    if g.finish_reason == "abort":
        return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    matched: Any = g.stop_reason
    if matched is None and g.token_ids:
        matched = g.token_ids[-1]
    return {"type": "stop", "matched": matched}
