"""Backend on vLLM's async engine. The engine batches continuously, so generation requests pass
straight through; scoring uses prompt log-probs of a one-token call, grouped under a token
budget so full-vocabulary logits are never computed for more prompt tokens than it allows."""

from __future__ import annotations

import asyncio
import gc
import logging
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from app.common.failures import Conflict, Unsupported
from app.common.roles import Role
from app.engine.abandon import unless_abandoned, unless_set
from app.engine.base import Backend, Capabilities, ScoreItem
from app.engine.distribution import assemble, position_scores
from app.engine.types import (
    GenerateItem,
    Generation,
    ModelInfo,
    Scores,
    ScoreSpec,
    TokenSink,
    VersionSpan,
)
from app.engine.vllm.lora import VLLMLoras
from app.engine.vllm.outputs import (
    final_only,
    own_log_probs,
    prompt_grid,
    prompt_scores,
    returned_log_probs,
    sampling_params,
)
from app.engine.vllm.raw_log_probs import raw_log_probs, read_raw_log_probs
from app.engine.vllm.weights import VLLMTransfer, WeightFiles
from app.weights.checkpoint import Layout
from app.weights.delta import Change
from app.weights.lora import AdapterBuild, LoraAdapter
from app.weights.transfer_engine import WeightTransfer

logger = logging.getLogger(__name__)
FULL_VOCAB_ELEMENTS = 1 << 24
"""The most vocabulary entries (sequence length x vocabulary) one full-distribution scoring
request may make vLLM return."""


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
        self.loras = VLLMLoras(engine, lora_rank, adapter_dir)

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
            read_raw_log_probs()  # each step's raw values beside them (raw_log_probs.py)
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
            backend.tie_embeddings(bool(getattr(hf_config, "tie_word_embeddings", False)))
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
        lora = None if adapter is None else self.loras.request_of(adapter)
        outputs = self.engine.generate(
            request, params, request_id=uuid.uuid4().hex, lora_request=lora
        )
        async for output in outputs:
            final = output
            if sink is not None:
                completion = output.outputs[0]
                new = list(completion.token_ids[sent:])
                if new:
                    sink.put(new, own_log_probs(completion.logprobs, sent, sent + len(new)))
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

    async def set_version(self, version: int, *, keep_cache: bool = False) -> None:
        """Label later tokens; drop every cached key and value of the old weights (frozen
        requests recompute theirs, so their later tokens come from the new weights exactly),
        unless `keep_cache`: then cached prefixes, and frozen requests' keys and values, are
        reused under the new weights (a snapshot's cache policy 'keep')."""
        await self.engine.update_weight_version(str(version))
        if not keep_cache:
            await self.engine.reset_prefix_cache(reset_running_requests=True)

    # -- LoRA adapters (vLLM's LoRA layers, with RLSERVE_VLLM__MAX_LORAS) --------------------

    async def build_adapter(self, build: AdapterBuild) -> LoraAdapter:
        return await self.loras.build(build)

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
            output_kind=final_only(),
        )
        final = await self._final(sequence, params, adapter=adapter)
        return [0.0, *prompt_grid(final.prompt_logprobs, len(sequence), 0).own]

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
            output_kind=final_only(),
        )
        flat = (await self._final(sequence, params, adapter=spec.adapter)).prompt_logprobs
        if not full:
            return prompt_scores(flat, len(sequence), spec)
        # log-probs of the whole vocabulary: logits up to a constant per position
        targets = torch.tensor(sequence[1:], dtype=torch.long)
        returned = returned_log_probs(flat, len(sequence), self.info.vocab_size)
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
        sampled = own_log_probs(completion.logprobs, 0, len(tokens))
        length = len(item.prompt_ids)
        # One grid serves both: the prompt's own log-probs and what `asks` wants of it
        # (`asks` is top-k and ranks only); prompt log-probs are raw in every mode. A request
        # aborted before its prompt was scored has none.
        flat, grid = final.prompt_logprobs, None
        if flat is not None and len(flat) == length:
            grid = prompt_grid(flat, length, 0 if asks is None else asks.top_logprobs)
        prompt = None
        if config.return_prompt_log_probs and grid is not None:
            prompt = [0.0, *grid.own]
        log_probs, processed = sampled, None
        if processed_mode:
            # The sampled values are processed; the raw ones came with them from each
            # sampling step (raw_log_probs.py), else from one more pass.
            processed, stepped = sampled, raw_log_probs(completion)
            if stepped is not None:
                log_probs = stepped
            else:
                raw = await self._scored_again(item, tokens)
                if raw is None:
                    return Generation([], [], None, "abort")
                log_probs = raw[length:]
                if config.return_prompt_log_probs:
                    prompt = raw[:length]
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

    async def _scored_again(self, item: GenerateItem, tokens: list[int]) -> list[float] | None:
        """The raw log-probs of a finished processed-mode row whose steps did not carry them:
        one scoring pass over prompt and tokens, under the weights at its end. None where the
        requester is gone, or an abort pause holds (the paused engine would start the pass
        only after the resume, and the pause waits for this row: it ends without its tokens,
        since their raw values are part of it)."""
        if self._aborting.is_set():
            return None
        scored = self._score_one([*item.prompt_ids, *tokens], item.adapter)
        return await unless_set(unless_abandoned(scored, item.abandoned), self._aborting)

    async def check(self) -> None:
        """vLLM's own check first (it raises once the engine core process is gone)."""
        await self.engine.check_health()
        await super().check()

    def tie_embeddings(self, tied: bool) -> None:
        """Whether the model's output head is its input embedding. File updates (and so
        deltas, which reload from files) are refused then: vLLM's reload leaves a tied head
        stale (`check_update`)."""
        self.tied_embeddings = tied
        deltas = self.weights is not None and not tied
        self.capabilities = replace(self.capabilities, weight_deltas=deltas)

    def _stored_names(self, names: Iterable[str] | None = None) -> dict[str, str] | None:
        """Each tensor of the layout (all, or `names` and those tied to them) to the name its
        file stores it under; None when the files do not hold the served values (no local
        checkpoint, or a collective transfer set tensors that no file has)."""
        if self.weights is None or self.transferred:
            return None
        layout = self.weight_layout() or {}
        return self.weights.stored_names(layout, tied=self.tied_embeddings, names=names)

    def served_tensor(self, name: str) -> torch.Tensor | None:
        """The served value of `name`, read from the file that holds it (vLLM's tensors live
        in its own processes); None after a collective transfer (its values are in none)."""
        if self.weights is None or self.transferred:
            return None
        return self.weights.tensor(self.weights.stored_name(name, tied=self.tied_embeddings))

    def delta_base_refusal(self) -> str | None:
        if self.transferred:
            return (
                "no file holds the values the collective transfer set (vLLM reloads from "
                "files): send the whole model"
            )
        return None

    def weight_checksums(
        self, names: Iterable[str] | None = None, known: Mapping[str, str] | None = None
    ) -> dict[str, str] | None:
        """From the files that hold the served values (None after a collective transfer: the
        model is then served without a digest until a file update)."""
        stored = self._stored_names(names)
        if stored is None or self.weights is None:
            return None
        return self.weights.checksums(stored, known)

    async def write_tensors(self, changes: dict[str, Change]) -> None:
        """A delta's changes as a file update: each changed tensor rebuilt on the host from
        its file, written as one checkpoint, and the model reloaded from files (as vLLM
        updates weights)."""
        weights = self.weights
        assert weights is not None and not self.transferred  # (`weight_deltas`, staging)
        path = await asyncio.to_thread(weights.changed_file, changes)
        await self._reload([path], move=True)

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

    def check_update(self, names: set[str], role: Role) -> None:
        if self.weights is None:
            raise Unsupported(
                f"{self.info.source} is not a local checkpoint, so it cannot be updated",
                role=Role.MODEL,
            )
        if self.tied_embeddings:
            # Measured with vLLM 0.32 (CPU): its in-place reload leaves a tied output head with
            # stale values, so scores after an update would be silently wrong. Refuse instead.
            raise Unsupported(
                "weight updates of models with tied input/output embeddings are not "
                "supported with the vLLM backend (vLLM's in-place reload mishandles the tied "
                "head); use the collective transfer or the transformers backend for this model",
                role=Role.MODEL,
            )
        if missing := sorted(self.transferred - names):
            # vLLM reloads whole models from files: the values a transfer sent are in none.
            raise Conflict(
                f"{len(missing)} tensors (e.g. '{missing[0]}') hold values the "
                "collective transfer sent, which no file has: with the vLLM backend a file "
                "update after a transfer must carry them too (send the whole model), or "
                "keep updating over the transfer",
                role=role,
            )

    async def update_weights(self, files: list[Path]) -> None:
        await self._reload(files, move=False)

    async def _reload(self, files: list[Path], *, move: bool) -> None:
        """Reload the model from the current files with `files` over them (kept: copied, or
        moved when they are the server's own)."""
        assert self.weights is not None  # check_update refused otherwise
        sources = self.weights.stage(files, move=move)
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
