"""SGLang's generation and weight-update flow on rlserve's services.

Weight updates are staged and committed whole, as everywhere in rlserve. When they become
visible follows the flow the trainer drives:
- inside `/begin_weight_update` … `/end_weight_update` (SGLang 0.5.23): at the end;
- while paused by `/pause_generation` (what slime and AReaL do around their buckets): at
  `/continue_generation`, before generation resumes;
- otherwise each `/update_weights_from_distributed` call is an update of its own."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from app.common.dialect_models import (
    warn_ignored,
)
from app.common.failures import Conflict, invalid
from app.common.routed_experts import check_prompt_start, int32_base64
from app.common.sampling import Names
from app.common.text import final_text
from app.dialects.common import Prompts, abort_all, label, sample, version_number
from app.dialects.sglang.protocol import (
    GenerateOutput,
    GenerateRequest,
    MetaInfo,
    SamplingParams,
    UpdateWeightsFromDistributed,
)
from app.engine.registry import ModelRegistry
from app.engine.types import Generation, Scores, ScoreSpec
from app.generation.service import GenerationService, Sampled
from app.updates.control import WeightsControl
from app.updates.session import Bucket, UpdateSession
from app.updates.types import Announcement, Applied, Publish

OPEN = "a weight-update session is already open; end it first"
SWAP_ATTEMPTS = 8


class SGLangWeights:
    """SGLang's weight-update flow over `WeightsControl`. Its session lives in the control
    (`app.updates.session`), not here: on a deployment of several replicas, a begin, its
    buckets and its end may each reach another replica, at once. Every change to the session
    is one compare-and-set (`_write`), made before the transfer step it stands for: of two
    begins one opens the session, of two ends one commits it, and a bucket never reopens a
    session another call committed."""

    def __init__(self, registry: ModelRegistry, weights: WeightsControl) -> None:
        self.registry = registry
        self.weights = weights
        self._lock = asyncio.Lock()

    async def _write(
        self, change: Callable[[UpdateSession], UpdateSession]
    ) -> tuple[UpdateSession, UpdateSession]:
        """The session read and the one written: `change` of the record as the control holds
        it, written unless another call wrote first (then `change` again, of what that call
        wrote). `change` raises to refuse, and returns what it read to leave it be."""
        for _ in range(SWAP_ATTEMPTS):
            read = await self.weights.session()
            new = change(read)
            if new is read:
                return read, read
            if (written := await self.weights.swap_session(read.serial, new)) is not None:
                return read, written
        raise Conflict("the weight-update session kept changing under other calls; retry")

    async def _start(self, opened: UpdateSession) -> None:
        """Start the transfer of a session this call opened; if it cannot, close it again."""
        try:
            await self.weights.transfer_start("policy")
        except BaseException:
            await self.weights.swap_session(opened.serial, _closed(opened))
            raise

    async def begin(self) -> None:
        def opened(session: UpdateSession) -> UpdateSession:
            if session.kind == "explicit":
                raise Conflict(OPEN)
            return UpdateSession("explicit", announced=session.announced)

        async with self._lock:
            read, written = await self._write(opened)
            if read.kind is None:
                await self._start(written)

    async def end(self) -> Applied:
        def ended(session: UpdateSession) -> UpdateSession:
            if session.kind != "explicit":
                raise Conflict("no weight-update session is open; begin one first")
            return _closed(session)

        async with self._lock:
            read, _ = await self._write(ended)
            return await self._publish(read)

    async def continue_generation(self) -> None:
        """Commit the buckets received while paused, then resume: serving resumes whether the
        commit succeeds or is refused (the refusal is then answered), never left paused."""
        async with self._lock:
            try:
                read, written = await self._write(lambda s: _closed(s) if s.kind == "paused" else s)
                if written is not read:
                    await self._publish(read)
            finally:
                await self.weights.resume()

    async def update(self, request: UpdateWeightsFromDistributed) -> Applied | None:
        """Stage one bucket; commit it too when no session holds it (then the new state)."""
        return await self.receive(_bucket(request))

    async def receive(self, bucket: Bucket) -> Applied | None:
        buckets = [len(bucket.names)] if bucket.flattened else None
        announce = Announcement(
            model="policy",
            names=list(bucket.names),
            dtype_names=list(bucket.dtypes),
            shapes=[list(shape) for shape in bucket.shapes],
            buckets=buckets,
        )

        def held(session: UpdateSession) -> UpdateSession:
            """While serving is paused, a bucket with no session opens one."""
            if session.kind is None and self.registry.gate.state().paused:
                return UpdateSession("paused", announced=session.announced)
            return session

        async with self._lock:
            if bucket.abort_all and not self.registry.gate.state().paused:
                await abort_all(self.registry, self.weights)
            read, session = await self._write(held)
            if session.kind is None:  # an update of its own
                await self.weights.transfer_start("policy")
                await self.weights.transfer_update(announce)
                return await self.weights.transfer_finish(
                    "policy", Publish(version=bucket.version, restartable=True)
                )
            if read.kind is None:
                await self._start(session)
            await self.weights.transfer_update(announce)
            if bucket.version is not None:

                def named(now: UpdateSession) -> UpdateSession:
                    if now.kind is None or now.opened != session.opened:
                        raise Conflict(
                            "the weight-update session this bucket was sent in was committed "
                            "by another call before the bucket's version was recorded"
                        )
                    return replace(now, version=bucket.version)

                await self._write(named)
            return None

    async def announce(self, request: UpdateWeightsFromDistributed) -> None:
        """Remember the tensors of the next `update_announced` (AReaL's vLLM server takes
        them in a call of their own, before the one that receives them)."""
        bucket = _bucket(request)
        async with self._lock:
            await self._write(lambda session: replace(session, announced=bucket))

    async def update_announced(self) -> Applied | None:
        """`update` with the tensors `announce` named (409 when none were)."""

        def taken(session: UpdateSession) -> UpdateSession:
            if session.announced is None:
                raise Conflict("no tensors were announced; set the update's meta first")
            return replace(session, announced=None)

        async with self._lock:
            read, _ = await self._write(taken)
        assert read.announced is not None
        return await self.receive(read.announced)

    async def _publish(self, session: UpdateSession) -> Applied:
        """Commit what `session` received (this call closed it)."""
        return await self.weights.transfer_finish(
            "policy", Publish(version=session.version, restartable=True)
        )


def _closed(session: UpdateSession) -> UpdateSession:
    """`session` committed: none open, what was announced kept."""
    return replace(session, kind=None, version=None)


def _bucket(request: UpdateWeightsFromDistributed) -> Bucket:
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
    ask = p.sampling_ask(
        return_prompt_log_probs=request.return_logprob and request.logprob_start_len >= 0,
        routed=request.return_routed_experts,
    )
    names = Names(
        f"{field}.",
        {"min_tokens": f"{field}.min_new_tokens", "return_routed_experts": "return_routed_experts"},
    )
    config = generation.sampling(ask, model, names)
    k = generation.top_logprobs(request.top_logprobs_num, "top_logprobs_num")
    asks = ScoreSpec(top_logprobs=k) if k and request.return_logprob else None
    return await sample(
        generation, prompt, config, n=p.n, seed=p.sampling_seed, asks=asks, model=model
    )


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
