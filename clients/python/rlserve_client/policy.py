"""`RemotePolicy`: TorchRL's LLM wrapper interface, with the model on an rlserve server.

Where torchrl is importable, `RemotePolicy` is an `LLMWrapperBase` and writes TorchRL's own
containers (`Text`, `Tokens`, `Masks`, `LogProbs`, `ChatHistory` of `History`), so it drops
into `ChatEnv`, `LLMCollector`, `RetrieveKL` and `KLRewardTransform` where
`TransformersWrapper` or `vLLMWrapper` would go. Without torchrl the same keys hold plain
TensorDicts (needs the `[torch]` extra either way).

Layout, as TorchRL's wrappers lay it out: batch `[B]`, or `[B, num_samples]` when
`num_samples` is set. `pad_output=False` gives a lazy stack with each row's own lengths;
`pad_output=True` pads tokens with the model's pad token (log-probs 0.0, masks False):
generated prompts on the left and responses on the right, scored sequences on the left."""

from __future__ import annotations

from typing import Any, Literal

try:
    import torch
    from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase, lazy_stack
    from tensordict import set_list_to_stack as _set_list_to_stack
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "RemotePolicy needs torch and tensordict: pip install 'rlserve-client[torch]'"
    ) from error

from rlserve_client._client import Client
from rlserve_client.distributions import TopKCategorical
from rlserve_client.sampling import check_generation_parameters
from rlserve_client.seeds import turn_seed
from rlserve_client.torchrl_layout import (
    RowLayout,
    WrapperBase,
    chat_history,
    container,
    generated_full_log_probs,
    given,
    pad_token,
    read_rows,
    row_widths,
    token_versions,
    unpadded_tokens,
)
from rlserve_client.types import Sample, ScoredSample

InputMode = Literal["history", "text", "tokens"]

_IGNORED_KWARGS = frozenset({"logprobs", "return_dict_in_generate", "output_scores"})
"""TorchRL's generation flags for what a wrapper returns: `return_log_probs` says that here."""


class RemotePolicy(WrapperBase):  # type: ignore[misc]
    """Called on a TensorDict like TorchRL's `TransformersWrapper`/`vLLMWrapper`, with the same
    keyword arguments where they make sense for a served model (`model` names the served
    model, "policy" or "reference"). `generate=True` reads `(input_mode, "prompt")` and writes
    text/tokens/masks/log_probs (and history in history mode); `generate=False` reads
    `(input_mode, "full")` and writes `(log_probs_key, "full")` with the assistant mask.

    `versions_key` (e.g. "token_versions"): where a generation writes the policy version that
    sampled each response token (aligned with `tokens.response`; padded with -1), for
    staleness bounds (`rlserve_client.torchrl_async`). Off by default: TorchRL's wrappers
    have no such key.

    `log_probs_key` defaults to "ref_log_probs" for the served reference model (and
    "log_probs" otherwise), so `RetrieveKL(policy.get_new_version(generate=False),
    RemotePolicy(client, model="reference", generate=False))` works as written.

    Deliberate differences: the chat template is the served model's (no `chat_template`);
    `log_probs.response[0]` of a generation is the real log-prob of the first generated token
    (TorchRL's transformers path writes 0.0); the assistant mask also covers the end-of-turn
    token the assistant wrote. A `seed` in `generate_kwargs` makes a run reproducible: call k
    of the policy samples with the seed's k-th derived stream (a fixed seed per call would
    give every call the same samples). A generation's `log_probs.full` is NaN over the prompt
    (as TorchRL's vLLM wrapper writes it; 0.0 would be a real log-prob) unless the prompt's
    log-probs were asked for (`return_prompt_log_probs`).

    Where TorchRL's `TransformersWrapper` differs on a model whose pad token is its
    end-of-sequence token (SmolLM2: `<|im_end|>`, id 2, is both), RemotePolicy is the one
    that agrees with `model.generate`: TorchRL treats every such token as padding, so it drops
    the reply's end-of-turn token and the prompt's `<|im_end|>` tokens from `tokens`, leaves
    `text.response` cut at the wrong place and `history.response` empty, and without an
    explicit attention mask leaves them out of the forward pass. TorchRL also replaces a chat
    template without generation tags by its own (picked by model name, else plain ChatML),
    which for SmolLM2 leaves out the default system message. Given a distinct pad token and
    the model's own template, TorchRL's tokens and log-probs equal these."""

    def __init__(
        self,
        client: Client,
        *,
        model: str = "policy",
        tokenizer: Any = None,
        input_mode: InputMode = "history",
        input_key: Any = None,
        attention_mask_key: str = "attention_mask",
        generate: bool = True,
        generate_kwargs: dict[str, Any] | None = None,
        pad_output: bool = False,
        inplace: Literal[True, False, "empty"] | None = None,
        device: Any = None,
        layout: Any = None,
        num_samples: int | None = None,
        return_log_probs: bool | None = None,
        history_key: Any = "history",
        text_key: Any = "text",
        tokens_key: Any = "tokens",
        masks_key: Any = "masks",
        log_probs_key: Any = None,
        versions_key: Any = None,
        **unsupported: Any,
    ) -> None:
        super().__init__()
        given = {k: v for k, v in unsupported.items() if v is not None}
        if given:
            raise ValueError(
                f"RemotePolicy does not take {sorted(given)}: the server applies its own "
                "model's chat template and batching"
            )
        if input_mode not in ("history", "text", "tokens"):
            raise ValueError(f"input_mode must be history, text or tokens, got {input_mode!r}")
        if not generate and return_log_probs is False:
            raise ValueError("return_log_probs must be True when generate=False")
        kwargs = dict(generate_kwargs or {})
        if "return_log_probs" in kwargs:
            raise ValueError("generate_kwargs: give return_log_probs to RemotePolicy itself")
        check_generation_parameters(set(kwargs) - _IGNORED_KWARGS, "generate_kwargs")
        n = kwargs.pop("n", kwargs.pop("num_return_sequences", None))
        if n is not None and num_samples is not None and n != num_samples:
            raise ValueError("num_samples differs from generate_kwargs['n']")
        num_samples = num_samples if num_samples is not None else n
        if num_samples is not None:
            if inplace in (True, "empty"):
                raise ValueError("inplace must be False (or None) with num_samples")
            inplace = False
        elif inplace is None:
            inplace = True
        self.client = client
        self.model = model
        self.tokenizer = tokenizer
        self.input_mode = input_mode
        self.attention_mask_key = attention_mask_key
        self.generate = generate
        self.generate_kwargs = {k: v for k, v in kwargs.items() if k not in _IGNORED_KWARGS}
        self.pad_output = pad_output
        self.inplace = inplace
        self._device = device
        self.layout = layout if layout is not None or pad_output else torch.strided
        self.num_samples = num_samples
        self.return_log_probs = True if return_log_probs is None else return_log_probs
        self.history_key = history_key
        self.text_key = text_key
        self.tokens_key = tokens_key
        self.masks_key = masks_key
        if log_probs_key is None:  # the reference's own key, so RetrieveKL tells the two apart
            log_probs_key = "ref_log_probs" if model == "reference" else "log_probs"
        self.log_probs_key = log_probs_key
        self.versions_key = versions_key
        self._min_batch_size = None
        self._max_batch_size = None
        self._batching_lock = None
        self._batching_timeout = None
        self._calls = 0  # with a seed, call k samples from the seed's k-th derived stream
        part = "prompt" if generate else "full"
        self.in_keys = [(input_mode, part) if input_key is None else input_key]
        self.input_key = self.in_keys[0]
        self.out_keys = [
            *([text_key] if input_mode in ("text", "history") else []),
            masks_key,
            tokens_key,
            *([log_probs_key] if self.return_log_probs else []),
            *([history_key] if input_mode == "history" else []),
            *([versions_key] if versions_key is not None and generate else []),
        ]

    def get_new_version(self, **kwargs: Any) -> RemotePolicy:
        """A copy with some constructor arguments changed (TorchRL's protocol: e.g.
        `generate=False, log_probs_key=...` for the scoring twin of a generating policy)."""
        current = {
            "model": self.model,
            "tokenizer": self.tokenizer,
            "input_mode": self.input_mode,
            "input_key": self.input_key,
            "attention_mask_key": self.attention_mask_key,
            "generate": self.generate,
            "generate_kwargs": dict(self.generate_kwargs),
            "pad_output": self.pad_output,
            "inplace": self.inplace,
            "device": self._device,
            "layout": self.layout,
            "num_samples": self.num_samples,
            "return_log_probs": self.return_log_probs,
            "history_key": self.history_key,
            "text_key": self.text_key,
            "tokens_key": self.tokens_key,
            "masks_key": self.masks_key,
            "log_probs_key": self.log_probs_key,
            "versions_key": self.versions_key,
        }
        if "input_mode" in kwargs and "input_key" not in kwargs:
            current["input_key"] = None
        if "generate" in kwargs and "input_key" not in kwargs:
            current["input_key"] = None
        if kwargs.get("generate") is False or "num_samples" in kwargs:
            current["inplace"] = None
            if kwargs.get("generate") is False:
                current["num_samples"] = None
        current.update(kwargs)
        client = current.pop("client", self.client)
        return type(self)(client, **current)

    def forward(
        self,
        tensordict: TensorDictBase,
        *,
        tensordict_out: TensorDictBase | None = None,
        **kwargs: Any,
    ) -> TensorDictBase:
        if tensordict.ndim == 0:
            return self.forward(lazy_stack([tensordict]))[0]
        if tensordict.ndim > 1:
            flat = self.forward(tensordict.reshape(-1))
            viewed: TensorDictBase = flat.view(*tensordict.shape, *flat.shape[1:])
            return viewed
        with _set_list_to_stack(True):
            out = self._outputs(tensordict, kwargs)
            return self._merge(tensordict, out, tensordict_out)

    # -- requests ------------------------------------------------------------------------

    def _outputs(self, td: TensorDictBase, kwargs: dict[str, Any]) -> TensorDictBase:
        if self.generate:
            params = {**self.generate_kwargs, **kwargs}
            if params.get("seed") is not None:
                params["seed"] = turn_seed(params["seed"], 0, self._calls)
                self._calls += 1
            if self.num_samples is not None:
                params["n"] = self.num_samples
            inputs = self._inputs(td)
            result = self.client.generate(model=self.model, tensors=True, **inputs, **params)
            pad = pad_token(result.pad_token_id)
            groups = result.outputs
        else:
            scored, pad = self._score(td)
            groups = [[sample] for sample in scored]
        samples = [s for group in groups for s in group]
        widths = row_widths(samples, generated=self.generate) if self.pad_output else None
        built = [self._row(s, pad, widths) for s in samples]
        if self.num_samples is None:
            return lazy_stack(built)
        n = self.num_samples
        return lazy_stack([lazy_stack(built[i * n : (i + 1) * n]) for i in range(len(groups))])

    def _score(self, td: TensorDictBase, **extras: Any) -> tuple[list[ScoredSample], int]:
        """The rows of `td` (read at `(input_mode, "full")`) scored by the server, and the
        model's pad token."""
        inputs = self._inputs(td)
        scored = self.client.logprobs(model=self.model, tensors=True, **inputs, **extras)
        return scored.outputs, pad_token(scored.pad_token_id)

    def _inputs(self, td: TensorDictBase) -> dict[str, Any]:
        """The request's input field: `td`'s rows at the input key."""
        rows = read_rows(td, self.input_key, self.input_mode, self.attention_mask_key)
        field = {"history": "messages", "text": "text", "tokens": "tokens"}[self.input_mode]
        return {field: rows}

    # -- distributions -------------------------------------------------------------------

    def _scorer(self) -> RemotePolicy:
        """This policy if it scores, else its scoring twin for what a generation wrote: the
        exact tokens at `(tokens_key, "full")` (re-templating the history could tokenize the
        reply differently)."""
        if not self.generate:
            return self
        full = (self.tokens_key, "full")
        return self.get_new_version(generate=False, input_mode="tokens", input_key=full)

    def get_dist(
        self,
        tensordict: TensorDictBase,
        tensordict_out: TensorDictBase | None = None,
        *,
        top_logprobs: int = 20,
        mask_key: Any = None,
        padding_side: Literal["left", "right"] = "left",
        as_padded_tensor: bool | None = None,
        as_nested_tensor: bool | None = None,
        **kwargs: Any,
    ) -> TopKCategorical:
        """The served model's next-token distribution at every position of the sequences in
        `tensordict` (read as the scoring policy reads them), **truncated to the
        `top_logprobs` most likely tokens and renormalized over them** (see
        `rlserve_client.distributions.TopKCategorical`; `truncated_mass` says what was cut).
        One `/v1/logprobs` request. Batch shape `[*batch, T]`, padded on `padding_side`
        (left by TorchRL's convention); the mask leaves out padding, each sequence's first
        token (no prediction) and, with `mask_key`, the positions where that mask is False: a
        key of the scored output's masks (`("masks", "all_assistant_mask")`) or of the input,
        one value per token. A generating policy scores the tokens it generated."""
        if as_nested_tensor or as_padded_tensor is False:
            raise ValueError("get_dist gives padded tensors only")
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be left or right, got {padding_side!r}")
        unused = {k: v for k, v in kwargs.items() if v is not None and k != "logits_key"}
        if unused:
            raise ValueError(f"get_dist does not take {sorted(unused)}")
        scorer = self._scorer()
        flat = tensordict.reshape(-1)
        with _set_list_to_stack(True):
            samples, _ = scorer._score(flat, top_logprobs=top_logprobs, span="full")
            rows = flat.unbind(0)
            width = max(len(given(s.tokens.full)) for s in samples)
            ids = torch.full((len(samples), width, top_logprobs), -1, dtype=torch.long)
            log_probs = torch.full((len(samples), width, top_logprobs), torch.nan)
            mask = torch.zeros(len(samples), width, dtype=torch.bool)
            for i, sample in enumerate(samples):
                table = sample.top_logprobs
                if table is None:
                    raise ValueError("the server did not return top_logprobs (upgrade it)")
                top_ids = torch.as_tensor(table.ids).reshape(-1, top_logprobs)
                n = len(top_ids)
                at = slice(width - n, width) if padding_side == "left" else slice(0, n)
                ids[i, at] = top_ids
                log_probs[i, at] = torch.as_tensor(table.log_probs).reshape(-1, top_logprobs)
                counted = top_ids[:, 0] >= 0
                if mask_key is not None:
                    counted &= scorer._mask_row(sample, rows[i], mask_key, n)
                mask[i, at] = counted
        shape = tensordict.shape
        return TopKCategorical(
            ids.view(*shape, width, top_logprobs),
            log_probs.view(*shape, width, top_logprobs),
            mask.view(*shape, width),
        )

    def _mask_row(self, sample: Sample, row: TensorDictBase, key: Any, n: int) -> torch.Tensor:
        """One sequence's values of the mask `key`: from the scored sample's masks, else from
        the input row (without its padding, as its attention mask says)."""
        key = (key,) if isinstance(key, str) else tuple(key)
        values = None
        if len(key) == 2 and key[0] == self.masks_key:
            values = getattr(sample.masks, key[1], None)
        if values is None and key in row.keys(include_nested=True):
            values = unpadded_tokens(row, key, self.attention_mask_key)
        if values is None or len(values) != n:
            raise KeyError(f"mask_key {key!r}: no mask with one value per token of the sequence")
        return torch.as_tensor(values).bool()

    def log_prob(self, data: TensorDictBase, **get_kwargs: Any) -> torch.Tensor:
        """Log-probs of the sequences in `data` under the served model (exact, not truncated),
        from one scoring request: `(log_probs_key, "full")` as `TensorDictBase.get` returns it
        with `get_kwargs` (e.g. `as_padded_tensor=True`). A generating policy scores the
        tokens it generated (`(tokens_key, "full")`)."""
        scorer = self._scorer()
        scored = scorer.get_new_version(inplace=False)(data)
        return scored.get((scorer.log_probs_key, "full"), **get_kwargs)  # type: ignore[no-any-return]

    def _merge(
        self, td: TensorDictBase, out: TensorDictBase, tensordict_out: TensorDictBase | None
    ) -> TensorDictBase:
        """TorchRL's `inplace` rules: write into the input, return the outputs alone, or an
        empty copy of the input holding the outputs."""
        if tensordict_out is None:
            if self.inplace is True:
                tensordict_out = td
            elif self.inplace == "empty":
                tensordict_out = td.empty()
            else:
                return out.select(*self.out_keys)
        if isinstance(out, LazyStackedTensorDict) and not isinstance(
            tensordict_out, LazyStackedTensorDict
        ):
            tensordict_out = tensordict_out.to_lazystack(0)
        result = tensordict_out.exclude(*self.out_keys, inplace=True)
        result.update(out, keys_to_update=self.out_keys)
        return result

    # -- one row -------------------------------------------------------------------------

    def _row(self, sample: Sample, pad: int, widths: tuple[int, int] | None) -> TensorDict:
        """One sample as TorchRL containers (padded to `widths` = (prompt, rest) if given).
        Its arrays may be lists (JSON) or tensors (binary replies)."""
        generated = self.generate
        tokens = sample.tokens
        full = given(tokens.full)
        prompt_len = len(tokens.prompt) if tokens.prompt is not None else None
        lay = RowLayout(widths, prompt_len, len(full), generated)
        row = TensorDict({}, batch_size=[])
        token_fields: dict[str, Any] = {"full": lay.full(full, pad, torch.long)}
        if generated:
            token_fields["prompt"] = lay.prompt(given(tokens.prompt), pad, torch.long)
            token_fields["response"] = lay.response(given(tokens.response), pad, torch.long)
        row.set(self.tokens_key, container("Tokens", token_fields, self.pad_output))
        ones = torch.ones(len(full), dtype=torch.bool)
        mask_fields = {"all_attention_mask": lay.full(ones, False, torch.bool)}
        if sample.masks.all_assistant_mask is not None:
            mask = sample.masks.all_assistant_mask
            mask_fields["all_assistant_mask"] = lay.full(mask, False, torch.bool)
        row.set(self.masks_key, container("Masks", mask_fields, self.pad_output))
        if self.return_log_probs and sample.log_probs is not None:
            lp = sample.log_probs
            lp_fields: dict[str, Any] = {}
            full_lp: Any = lp.full
            if full_lp is None and generated and lp.response is not None:
                full_lp = generated_full_log_probs(lp.prompt, lp.response, prompt_len or 0)
            if full_lp is not None:
                lp_fields["full"] = lay.full(full_lp, 0.0, torch.float32)
            if generated and lp.response is not None:
                lp_fields["response"] = lay.response(lp.response, 0.0, torch.float32)
            if generated and lp.prompt is not None:
                lp_fields["prompt"] = lay.prompt(lp.prompt, 0.0, torch.float32)
            row.set(self.log_probs_key, container("LogProbs", lp_fields, self.pad_output))
        if self.input_mode in ("text", "history") and sample.text is not None:
            text = {k: v for k, v in sample.text.model_dump().items() if v is not None}
            row.set(self.text_key, container("Text", text, None))
        if self.input_mode == "history" and sample.history is not None:
            row.set(self.history_key, chat_history(sample))
        if self.versions_key is not None and generated:
            versions = token_versions(sample, len(given(tokens.response)))
            row.set(self.versions_key, lay.response(versions, -1, torch.long))
        return row
