"""Backend on vLLM's async engine. The engine batches continuously, so generation requests pass
straight through; scoring uses prompt log-probs of a one-token call, grouped under a token
budget so full-vocabulary logits are never computed for more prompt tokens than it allows."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import json
import logging
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from app.common.failures import Conflict, InvalidInput, Unsupported, invalid
from app.engine.abandon import unless_abandoned, unless_set
from app.engine.base import Backend, Capabilities, ScoreItem
from app.engine.distribution import assemble, position_scores
from app.engine.types import (
    GenerateItem,
    Generation,
    ModelInfo,
    SamplingConfig,
    Scores,
    ScoreSpec,
    TokenSink,
    VersionSpan,
)
from app.weights.checkpoint import Layout, checkpoint_files, read_layout
from app.weights.lora import LoraAdapter
from app.weights.lora_layout import CONFIG, WEIGHTS, parse_adapter
from app.weights.staging import TransferPlan
from app.weights.transfer_engine import WeightTransfer, rendezvous_listening
from app.weights.transport import Connection

logger = logging.getLogger(__name__)


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


class VLLMBackend(Backend):
    capabilities = Capabilities(weight_transfer=True, continuous_batching=True, prompt_scores=True)

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        info: ModelInfo,
        weights: WeightFiles | None = None,
        *,
        processed_log_probs: bool = False,
        lora_rank: int | None = None,
        adapter_dir: Path | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.info = info
        self.weights = weights
        self.tied_embeddings = False
        self._transfer: VLLMTransfer | None = None
        self._aborting = asyncio.Event()  # set from an abort pause's start to the resume
        self.transferred: set[str] = set()
        """Tensors whose served values came over the collective transfer (they are in no
        file, so a file update cannot complete the model with them)."""
        self.capabilities = Capabilities(
            weight_transfer=True,
            continuous_batching=True,
            prompt_scores=True,
            processed_log_probs=processed_log_probs,
            streamed_log_probs="processed" if processed_log_probs else "raw",
            adapters=lora_rank is not None,
        )
        self.lora_rank = lora_rank
        """The largest adapter rank the engine's LoRA layers take; None: LoRA off."""
        self._adapter_dir = Path()
        """One PEFT folder per adapter version, as vLLM loads LoRA (cleared at start: ids
        count from 1 again)."""
        if lora_rank is not None:
            self._adapter_dir = adapter_dir or Path(tempfile.mkdtemp(prefix="rlserve-adapters-"))
            shutil.rmtree(self._adapter_dir, ignore_errors=True)
            self._adapter_dir.mkdir(parents=True)
        self._loras: weakref.WeakKeyDictionary[LoraAdapter, Any] = weakref.WeakKeyDictionary()
        """Each served adapter version's vLLM LoRARequest, while anything holds the version."""
        self._lora_ids = itertools.count(1)
        self._released: list[int] = []
        """LoRA ids of versions no longer held (appended by their finalizers, from any thread):
        removed from the engine at the next adapter's load."""

    @classmethod
    async def start(
        cls,
        source: str,
        *,
        name: str,
        dtype: str = "auto",
        max_model_len: int | None = None,
        trust_remote_code: bool = False,
        builtin: bool = False,
        engine_options: dict[str, Any] | None = None,
        processed_log_probs: bool = False,
        state_dir: Path | None = None,
    ) -> VLLMBackend:
        """Start the engine (its worker processes included) and wait until it answers. With
        `processed_log_probs`, sampled tokens carry their log-probs under the distribution
        they were drawn from (vLLM's logprobs_mode is per engine, not per request)."""
        from transformers import AutoTokenizer
        from vllm import AsyncEngineArgs, AsyncLLMEngine

        options = {**platform_options(), **(engine_options or {})}
        # Scoring asks for whole-vocabulary prompt log-probs; the service enforces its own caps.
        options.setdefault("max_logprobs", -1)
        if processed_log_probs:  # prompt log-probs stay raw in this mode (vLLM skips processors)
            options["logprobs_mode"] = "processed_logprobs"
        args = AsyncEngineArgs(
            model=source,
            dtype=dtype,
            max_model_len=max_model_len,
            trust_remote_code=trust_remote_code,
            seed=0,
            worker_extension_cls="app.engine.vllm.worker.WeightLoaderExtension",
            weight_transfer_config={"backend": "rlserve"},
            **options,
        )
        engine = AsyncLLMEngine.from_engine_args(args)
        try:
            await engine.check_health()
            model_config = engine.model_config
            tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
            info = ModelInfo(
                name=name,
                source=str(source),
                backend="vllm",
                dtype=str(model_config.dtype).removeprefix("torch."),
                device=str(getattr(engine.vllm_config.device_config, "device", "auto")),
                # Scoring asks for one new token, so the longest scored sequence is one shorter.
                max_model_len=int(model_config.max_model_len) - 1,
                vocab_size=int(model_config.get_vocab_size()),
                builtin=builtin,
            )
            weights = WeightFiles.of_source(source, state_dir) if state_dir else None
            lora_rank = options["max_lora_rank"] if options.get("enable_lora") else None
            backend = cls(
                engine,
                tokenizer,
                info,
                weights,
                processed_log_probs=processed_log_probs,
                lora_rank=lora_rank,
                adapter_dir=state_dir / "adapters" if state_dir else None,
            )
            hf_config = model_config.hf_config
            backend.tied_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
            await engine.update_weight_version("0")
            await backend.check()  # the engine answers: ready
        except BaseException:
            engine.shutdown()
            raise
        return backend

    async def _final(
        self,
        prompt: Sequence[int],
        params: Any,
        sink: TokenSink | None = None,
        adapter: LoraAdapter | None = None,
    ) -> Any:
        """The request's last output (with `adapter`'s LoRA on the model); with a `sink` (and
        cumulative outputs), each new token is told as it arrives."""
        from vllm.inputs import TokensPrompt

        final = None
        sent = 0
        request = TokensPrompt(prompt_token_ids=list(prompt))
        lora = None if adapter is None else self._loras[adapter]
        outputs = self.engine.generate(
            request, params, request_id=uuid.uuid4().hex, lora_request=lora
        )
        async for output in outputs:
            final = output
            if sink is not None:
                completion = output.outputs[0]
                new = list(completion.token_ids[sent:])
                if new:
                    sink.put(new, _own_log_probs(completion.logprobs, sent, sent + len(new)))
                    sent += len(new)
        if final is None:
            raise RuntimeError("vLLM returned no output")
        return final

    # -- pausing (vLLM's own pause modes) -------------------------------------------------

    async def freeze(self) -> None:
        await self.engine.pause_generation(mode="keep", clear_cache=False)

    async def thaw(self) -> None:
        await self.engine.resume_generation()
        self._aborting.clear()

    async def abort_generations(self) -> None:
        self._aborting.set()
        await self.engine.pause_generation(mode="abort", clear_cache=False)

    async def set_version(self, version: int) -> None:
        """Label later tokens; drop every cached key and value of the old weights (frozen
        requests recompute theirs, so their later tokens come from the new weights exactly)."""
        await self.engine.update_weight_version(str(version))
        await self.engine.reset_prefix_cache(reset_running_requests=True)

    # -- LoRA adapters (vLLM's LoRA layers, with RLSERVE_VLLM__MAX_LORAS) --------------------

    async def build_adapter(
        self,
        config: dict[str, Any],
        tensors: dict[str, torch.Tensor],
        *,
        name: str,
        version: int,
        source: str,
        param: str,
    ) -> LoraAdapter:
        """One version of an adapter as vLLM loads LoRA: a PEFT folder of its own (vLLM checks
        it against the model as it loads it, here, before any request names it) and a LoRA id
        of its own, so requests in flight keep the version they started with. The folder and
        the id go when nothing holds the version any more."""
        from vllm.lora.request import LoRARequest

        if self.lora_rank is None:
            raise Unsupported(
                f"{param}: this vLLM engine serves no LoRA adapters; start it with "
                "RLSERVE_VLLM__MAX_LORAS (how many adapters one batch may mix)",
                param=param,
            )
        adapter = parse_adapter(
            config, tensors, None, name=name, version=version, source=source, param=param
        )
        if adapter.rank > self.lora_rank:
            raise Unsupported(
                f"{param}: the adapter's rank {adapter.rank} is above this engine's largest, "
                f"RLSERVE_VLLM__MAX_LORA_RANK={self.lora_rank}",
                param=param,
            )
        for released in self._released[:]:
            self._released.remove(released)
            await self.engine.remove_lora(released)
        lora_id = next(self._lora_ids)
        folder = self._adapter_dir / str(lora_id)
        await asyncio.to_thread(_write_peft_folder, folder, config, tensors)
        request = LoRARequest(
            lora_name=f"{name}@{version}", lora_int_id=lora_id, lora_path=str(folder)
        )
        try:
            await self.engine.add_lora(request)
        except Exception as exc:
            shutil.rmtree(folder, ignore_errors=True)
            raise invalid(param, f"vLLM did not load the adapter: {exc}") from exc
        self._loras[adapter] = request
        weakref.finalize(adapter, _release, self._released, lora_id, folder)
        return adapter

    def transfer(self) -> WeightTransfer:
        if self._transfer is None:
            self._transfer = VLLMTransfer(self.engine, self.transferred)
        return self._transfer

    async def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        return list(await asyncio.gather(*(self._score_one(seq) for seq in sequences)))

    async def _score_one(
        self, sequence: Sequence[int], adapter: LoraAdapter | None = None
    ) -> list[float]:
        from vllm import SamplingParams

        if len(sequence) == 1:
            return [0.0]
        params = SamplingParams(
            max_tokens=1,
            prompt_logprobs=0,
            flat_logprobs=True,
            detokenize=False,
            output_kind=_final_only(),
        )
        final = await self._final(sequence, params, adapter=adapter)
        return [0.0, *_prompt_grid(final.prompt_logprobs, len(sequence), 0).own]

    def full_distribution_limit(self) -> int | None:
        return max(1, FULL_VOCAB_ELEMENTS // self.info.vocab_size)

    async def score_detailed(self, items: Sequence[ScoreItem]) -> list[Scores]:
        return list(await asyncio.gather(*(self._detailed_one(seq, spec) for seq, spec in items)))

    async def _detailed_one(self, sequence: Sequence[int], spec: ScoreSpec) -> Scores:
        """Top-k alone comes from vLLM's prompt log-probs; entropy, processed log-probs and
        candidate ids need the whole distribution, which vLLM returns for every position of
        the sequence at once (the service keeps sequences within `full_distribution_limit`)."""
        from vllm import SamplingParams

        if len(sequence) == 1 or not spec.extras:
            return Scores(log_probs=torch.tensor(await self._score_one(sequence, spec.adapter)))
        # vLLM ranks the sequence's own tokens itself: ranks alone need no full distribution.
        full = not spec.ranked_top_k
        params = SamplingParams(
            max_tokens=1,
            prompt_logprobs=-1 if full else spec.top_logprobs,
            flat_logprobs=True,
            detokenize=False,
            output_kind=_final_only(),
        )
        flat = (await self._final(sequence, params, adapter=spec.adapter)).prompt_logprobs
        if not full:
            return _prompt_scores(flat, len(sequence), spec)
        # log-probs of the whole vocabulary: logits up to a constant per position
        targets = torch.tensor(sequence[1:], dtype=torch.long)
        returned = _returned_log_probs(flat, len(sequence), self.info.vocab_size)
        part = position_scores(returned, targets, spec, extras=True)
        return assemble([part], spec.start, len(sequence))

    async def generate(self, items: Sequence[GenerateItem]) -> list[Generation]:
        return list(await asyncio.gather(*(self._generate_one(item) for item in items)))

    async def _generate_one(self, item: GenerateItem) -> Generation:
        config = item.config
        processed_mode = self.capabilities.processed_log_probs
        asks = item.prompt_asks
        params = sampling_params(
            config,
            item.seed,
            prompt_log_probs=not processed_mode,
            streaming=item.sink is not None,
            prompt_top=None if asks is None else asks.top_logprobs,
        )
        work = self._final(item.prompt_ids, params, item.sink, item.adapter)
        final = await unless_abandoned(work, item.abandoned)
        if final is None:  # the requester is gone; vLLM aborted the request
            return Generation([], [], None, "abort")
        completion = final.outputs[0]
        finish = completion.finish_reason
        tokens = list(completion.token_ids)
        sampled = _own_log_probs(completion.logprobs, 0, len(tokens))
        length = len(item.prompt_ids)
        # One grid serves both: the prompt's own log-probs and what `asks` wants of it
        # (`asks` is top-k and ranks only). A request aborted before its prompt was scored
        # has none.
        flat, grid = final.prompt_logprobs, None
        if flat is not None and len(flat) == length:
            grid = _prompt_grid(flat, length, 0 if asks is None else asks.top_logprobs)
        prompt = None
        if processed_mode:
            # The sampled values are processed; the raw ones come from one scoring pass over
            # the finished sequence (prompt log-probs are raw in every mode).
            # (Not while an abort pause holds: the paused engine would start the scoring only
            # after the resume, and the pause waits for this row. The row ends without its
            # tokens then: their raw values are part of it.)
            raw = None
            if not self._aborting.is_set():
                sequence = [*item.prompt_ids, *tokens]
                scored = self._score_one(sequence, item.adapter)
                score = unless_abandoned(scored, item.abandoned)
                raw = await unless_set(score, self._aborting)
            if raw is None:
                return Generation([], [], None, "abort")
            cut = len(item.prompt_ids)
            log_probs, processed = raw[cut:], sampled
            if config.return_prompt_log_probs:
                prompt = raw[:cut]
        else:
            log_probs, processed = sampled, None
            if config.return_prompt_log_probs:
                prompt = [0.0, *grid.own] if grid is not None else None
        stop = completion.stop_reason if isinstance(completion.stop_reason, str | int) else None
        return Generation(
            token_ids=tokens,
            log_probs=log_probs,
            processed_log_probs=processed,
            finish_reason="length"
            if finish == "length"
            else "abort"
            if finish == "abort"
            else "stop",
            stop_reason=stop,
            prompt_log_probs=prompt,
            versions=[
                VersionSpan(int(span.version), span.start, span.end)
                for span in completion.weight_versions or []
            ],
            prompt_scores=None if asks is None or grid is None else grid.scores(asks),
        )

    async def check(self) -> None:
        """vLLM's own check first (it raises once the engine core process is gone)."""
        await self.engine.check_health()
        await super().check()

    def weight_layout(self) -> Layout | None:
        """The checkpoint's tensors; with tied embeddings also the output head a trainer's
        state dict carries (vLLM's loader skips it: the head is the embedding)."""
        if self.weights is None:
            return None
        layout = dict(self.weights.layout)
        embedding = layout.get("model.embed_tokens.weight")
        if self.tied_embeddings and embedding is not None:
            layout.setdefault("lm_head.weight", embedding)
        return layout

    def check_update(self, names: set[str], param: str) -> None:
        if self.weights is None:
            raise Unsupported(
                f"model: {self.info.source} is not a local checkpoint, so it cannot be updated",
                param="model",
            )
        if self.tied_embeddings:
            # Measured with vLLM 0.32 (CPU): its in-place reload leaves a tied output head with
            # stale values, so scores after an update would be silently wrong. Refuse instead.
            raise Unsupported(
                "model: weight updates of models with tied input/output embeddings are not "
                "supported with the vLLM backend (vLLM's in-place reload mishandles the tied "
                "head); use the collective transfer or the transformers backend for this model",
                param="model",
            )
        if missing := sorted(self.transferred - names):
            # vLLM reloads whole models from files: the values a transfer sent are in none.
            raise Conflict(
                f"{param}: {len(missing)} tensors (e.g. '{missing[0]}') hold values the "
                "collective transfer sent, which no file has: with the vLLM backend a file "
                "update after a transfer must carry them too (send the whole model), or "
                "keep updating over the transfer",
                param=param,
            )

    async def update_weights(self, files: list[Path]) -> None:
        assert self.weights is not None  # check_update refused otherwise
        sources = self.weights.stage(files)
        try:
            await self.engine.collective_rpc("rlserve_reload_weights", args=(sources,))
        except BaseException:
            self.weights.rollback()
            raise
        self.weights.commit()
        self.transferred.clear()  # the whole model came from files

    async def aclose(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()
            del engine
            gc.collect()  # let vLLM's finaliser run now, not at interpreter exit


class VLLMTransfer(WeightTransfer):
    """vLLM's own weight-transfer calls on the engine, served in the workers by the "rlserve"
    engine (app.engine.vllm.worker): the data arrives while the engine keeps generating."""

    POLL_S = 0.02

    def __init__(self, engine: Any, transferred: set[str]) -> None:
        self.engine = engine
        self.ranks = int(engine.vllm_config.parallel_config.world_size)
        self.transferred = transferred
        """The backend's record of the tensors transfers set (committed updates add theirs)."""
        self._announced: set[str] = set()
        self._adapter = False

    async def init(self, connection: Connection) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await rendezvous_listening(connection)
        info = dataclasses.asdict(connection)
        await self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))

    async def start(self, *, adapter: bool = False) -> None:
        await self.engine.collective_rpc("rlserve_transfer_abort")
        self._announced, self._adapter = set(), adapter
        await self.engine.start_weight_update()

    async def update(self, plan: TransferPlan) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        request = WeightTransferUpdateRequest(update_info=plan.announcement())
        await self.engine.update_weights(request)
        self._announced |= {spec.name for spec in plan.tensors}

    async def received(self, timeout_s: float) -> None:
        """Poll the workers (a call that waited would stall the engine's loop)."""
        async with asyncio.timeout(timeout_s):
            while True:
                states = await self.engine.collective_rpc(
                    "rlserve_transfer_status", args=(not self._adapter,)
                )
                problems = [s for s in states if s is not None]
                if not problems:
                    return
                failed = [p for p in problems if p != "pending"]
                if failed:
                    if failed[0].startswith("InvalidInput: "):
                        raise InvalidInput(
                            failed[0].removeprefix("InvalidInput: "), param="weights"
                        )
                    raise RuntimeError(failed[0])
                await asyncio.sleep(self.POLL_S)

    async def checkpoint(self) -> bytes:
        """From the first worker (every worker received every tensor whole)."""
        files = await self.engine.collective_rpc("rlserve_transfer_checkpoint")
        return next(f for f in files if f is not None)

    async def commit(self, version: int) -> None:
        await self.engine.finish_weight_update(weight_version=str(version))
        self.transferred |= self._announced

    async def abort(self) -> None:
        await self.engine.collective_rpc("rlserve_transfer_abort")

    async def close(self) -> None:
        await self.abort()
        await self.engine.shutdown_weight_transfer_engine()


def _write_peft_folder(
    folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> None:
    """An adapter in PEFT's layout, as vLLM reads one (blocking: call in a thread)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / CONFIG).write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / WEIGHTS))


def _release(released: list[int], lora_id: int, folder: Path) -> None:
    """A version nothing holds any more (a finalizer, on any thread): its folder goes now, its
    LoRA id at the engine's next adapter load."""
    released.append(lora_id)
    shutil.rmtree(folder, ignore_errors=True)


def platform_options() -> dict[str, Any]:
    """The engine options rlserve sets on this machine's platform (a deployment's own engine
    options override them)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        # vLLM's CPU worker cannot rewind a seeded request's generator after a partial
        # prefill ("CPU Generator does not use offset") and the engine dies, so prompts are
        # never split across engine steps there.
        return {"enable_chunked_prefill": False}
    return {}


def sampling_params(
    config: SamplingConfig,
    seed: int,
    *,
    prompt_log_probs: bool = True,
    streaming: bool = False,
    prompt_top: int | None = None,
) -> Any:
    """The standardized parameters as vLLM `SamplingParams` (the sampled token's log-prob, in
    the engine's logprobs_mode; prompt log-probs when asked and `prompt_log_probs`, and with
    the `prompt_top` most likely tokens at each prompt position when that is given). Only the
    final output comes back unless `streaming` (then every step's, cumulative), and text is
    detokenized only to find stop strings. Log-probs come back flat (a few lists per request,
    not objects per token)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    if prompt_top is None and config.return_prompt_log_probs and prompt_log_probs:
        prompt_top = 0  # the prompt's own log-probs alone
    # top_p 0 keeps the most likely token alone (OpenAI's meaning, and the transformers
    # backend's), which vLLM, taking top_p in (0, 1], says as top_k 1.
    top_p, top_k = config.top_p, config.top_k or 0
    if top_p == 0:
        top_p, top_k = 1.0, 1
    return SamplingParams(
        output_kind=RequestOutputKind.CUMULATIVE if streaming else _final_only(),
        detokenize=bool(config.stop_sequences),
        n=1,
        max_tokens=config.max_new_tokens,
        temperature=config.temperature if config.do_sample else 0.0,
        top_p=top_p,
        top_k=top_k,
        min_p=config.min_p,
        repetition_penalty=config.repetition_penalty,
        seed=seed,
        stop=list(config.stop_sequences) or None,
        include_stop_str_in_output=True,
        ignore_eos=config.ignore_eos,
        min_tokens=config.min_tokens,
        stop_token_ids=list(config.stop_token_ids) or None,
        presence_penalty=config.presence_penalty,
        frequency_penalty=config.frequency_penalty,
        logit_bias=dict(config.logit_bias) or None,
        allowed_token_ids=None
        if config.allowed_token_ids is None
        else list(config.allowed_token_ids),
        bad_words=list(config.bad_words) or None,
        logprobs=0,
        prompt_logprobs=prompt_top,
        flat_logprobs=True,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
    )


FULL_VOCAB_ELEMENTS = 1 << 24
"""The most vocabulary entries (sequence length x vocabulary) one full-distribution scoring
request may make vLLM return."""


def _returned_log_probs(flat: Any, length: int, vocab: int) -> torch.Tensor:
    """[length - 1, vocab]: the log-probs vLLM returned for positions 1… (flat layout), -inf
    where it returned none."""
    dense = torch.full((length - 1, vocab), float("-inf"))
    for row in range(length - 1):
        span = slice(flat.start_indices[row + 1], flat.end_indices[row + 1])
        dense[row, torch.tensor(flat.token_ids[span])] = torch.tensor(flat.logprobs[span])
    return dense


def _own_log_probs(flat: Any, begin: int, end: int) -> list[float]:
    """Positions [begin, end) of vLLM's flat sample log-probs: each position's own (sampled)
    token comes first, before any top-k."""
    return [flat.logprobs[flat.start_indices[p]] for p in range(begin, end)]


@dataclasses.dataclass
class _PromptGrid:
    """vLLM's flat prompt log-probs of a sequence, positions 1… as rows: each row is the
    position's own token, then the k most likely tokens in order (possibly itself again)."""

    rows: int
    k: int
    token_ids: list[int]
    log_probs: list[float]
    ranks: list[int]

    @property
    def own(self) -> list[float]:
        """The log-prob of each position's own token."""
        return self.log_probs[:: self.k + 1]

    def scores(self, spec: ScoreSpec) -> Scores:
        part = {"log_probs": torch.tensor(self.own, dtype=torch.float32)}
        if spec.ranks:
            part["ranks"] = torch.tensor(self.ranks[:: self.k + 1])
        if self.k:
            shape = (self.rows, self.k + 1)
            part["top_ids"] = torch.tensor(self.token_ids).view(shape)[:, 1:]
            part["top_log_probs"] = torch.tensor(self.log_probs).view(shape)[:, 1:]
        return assemble([part], spec.start, self.rows + 1)


def _prompt_grid(flat: Any, length: int, k: int) -> _PromptGrid:
    rows = length - 1
    if len(flat.logprobs) != rows * (k + 1):  # (position 0 has none)
        raise RuntimeError(
            f"vLLM returned {len(flat.logprobs)} prompt log-probs for {rows} positions with "
            f"top {k}; expected {rows * (k + 1)}"
        )
    return _PromptGrid(
        rows=rows,
        k=k,
        token_ids=flat.token_ids,
        log_probs=flat.logprobs,
        ranks=flat.ranks,
    )


def _prompt_scores(flat: Any, length: int, spec: ScoreSpec) -> Scores:
    """Log-probs, top-k and ranks of a whole sequence, read off vLLM's prompt log-probs."""
    return _prompt_grid(flat, length, spec.top_logprobs).scores(spec)


def _final_only() -> Any:
    from vllm.sampling_params import RequestOutputKind

    return RequestOutputKind.FINAL_ONLY


class WeightFiles:
    """Where the current value of every tensor lives: the served checkpoint's files, or kept
    copies of later updates. vLLM reloads whole models (it repacks layers after loading), so a
    partial update is completed with the current values of the other tensors."""

    def __init__(self, location: dict[str, Path], layout: Layout, directory: Path) -> None:
        self.location = location
        self.layout = layout
        self.directory = directory
        self._staged: tuple[dict[str, Path], list[Path]] | None = None

    @classmethod
    def of_source(cls, source: str, directory: Path) -> WeightFiles | None:
        path = Path(source)
        if not path.is_dir():
            logger.warning("%s is not a local directory: weight updates are refused", source)
            return None
        location: dict[str, Path] = {}
        layout: Layout = {}
        for file in checkpoint_files(path):
            file_layout = read_layout([file], "model")
            layout |= file_layout
            location |= dict.fromkeys(file_layout, file)
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True, exist_ok=True)
        return cls(location, layout, directory)

    def stage(self, files: list[Path]) -> list[tuple[str, list[str]]]:
        """Keep copies of `files`; return (file, names) covering every tensor."""
        location = dict(self.location)
        copies = []
        for file in files:
            copy = self.directory / f"{uuid.uuid4().hex}.safetensors"
            shutil.copyfile(file, copy)
            copies.append(copy)
            location |= dict.fromkeys(read_layout([copy], "weights"), copy)
        self._staged = (location, copies)
        by_file: dict[Path, list[str]] = {}
        for name, file in location.items():
            by_file.setdefault(file, []).append(name)
        return [(str(file), names) for file, names in by_file.items()]

    def commit(self) -> None:
        assert self._staged is not None
        self.location, _ = self._staged
        self._staged = None
        used = set(self.location.values())
        for kept in self.directory.glob("*.safetensors"):
            if kept not in used:
                kept.unlink()

    def rollback(self) -> None:
        if self._staged is not None:
            for copy in self._staged[1]:
                copy.unlink(missing_ok=True)
        self._staged = None
