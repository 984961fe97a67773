"""Remote counterparts of TorchRL's LLM pieces: a policy module and chat environments whose
work happens on the server."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Literal

from rlserve_client._client import AsyncClient, Client
from rlserve_client._exceptions import NotFoundError
from rlserve_client.types import EnvState, ResetResult, StepResult

if TYPE_CHECKING:
    from tensordict import TensorDictBase

InputMode = Literal["history", "text", "tokens"]


class RemotePolicy:
    """Called on a TensorDict like TorchRL's `vLLMWrapper`/`TransformersWrapper`.

    generate=True reads the prompt (`("history", "prompt")`, `("text", "prompt")` or
    `("tokens", "prompt")` with `("masks", "all_attention_mask")` marking left padding) and
    writes the text/tokens/masks/log_probs/history containers of the samples.
    generate=False reads the `"full"` entry of the input mode and writes `("log_probs",
    "full")`. `pad_output` picks padded tensors or a lazy stack, as in TorchRL."""

    def __init__(
        self,
        client: Client,
        *,
        input_mode: InputMode = "history",
        generate: bool = True,
        pad_output: bool = True,
        model: str = "policy",
        generate_kwargs: dict[str, Any] | None = None,
    ) -> None:
        kwargs = dict(generate_kwargs or {})
        if kwargs.get("n", kwargs.get("num_return_sequences", 1)) != 1:
            raise ValueError("RemotePolicy returns one sample per prompt; n must be 1")
        self.client = client
        self.input_mode = input_mode
        self.generate = generate
        self.pad_output = pad_output
        self.model = model
        self.generate_kwargs = kwargs

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        from rlserve_client.tensordicts import align_to_input, merge_rows, read_inputs

        part = "prompt" if self.generate else "full"
        inputs: dict[str, Any] = {self._field: read_inputs(td, self.input_mode, part)}
        if self.generate:
            result = self.client.generate(model=self.model, **inputs, **self.generate_kwargs)
            out = result.to_tensordict(padded=self.pad_output)
        else:
            scored = self.client.logprobs(model=self.model, **inputs)
            if self.input_mode == "tokens":  # keep the caller's padding layout
                return align_to_input(
                    td, [(s.log_probs.full if s.log_probs else None) or [] for s in scored.outputs]
                )
            out = scored.to_tensordict(padded=self.pad_output)
        return merge_rows(td, out)

    @property
    def _field(self) -> str:
        return {"history": "messages", "text": "text", "tokens": "tokens"}[self.input_mode]


class RemoteChatEnv:
    """A server-side environment session (TorchRL `ChatEnv` semantics), deleted on `close()`
    or when the `with` block ends. `config`: the `create_env` arguments."""

    def __init__(self, client: Client, **config: Any) -> None:
        self.client = client
        self.env_id = client.create_env(**config).env_id

    def reset(self, **inputs: Any) -> ResetResult:
        """`query=[...]` (with `answer=`), `messages=`, `tokens=`, or nothing for the dataset."""
        return self.client.reset_env(self.env_id, **inputs)

    def step(self, actions: list[Any]) -> StepResult:
        return self.client.step_env(self.env_id, actions=actions)

    def state(self) -> EnvState:
        return self.client.get_env(self.env_id)

    def close(self) -> None:
        with contextlib.suppress(NotFoundError):  # already expired or deleted
            self.client.delete_env(self.env_id)

    def __enter__(self) -> RemoteChatEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncRemoteChatEnv:
    """Asynchronous `RemoteChatEnv`: `async with AsyncRemoteChatEnv(client, ...) as env`."""

    def __init__(self, client: AsyncClient, **config: Any) -> None:
        self.client = client
        self.config = config
        self.env_id = ""

    async def open(self) -> AsyncRemoteChatEnv:
        self.env_id = (await self.client.create_env(**self.config)).env_id
        return self

    async def reset(self, **inputs: Any) -> ResetResult:
        return await self.client.reset_env(self.env_id, **inputs)

    async def step(self, actions: list[Any]) -> StepResult:
        return await self.client.step_env(self.env_id, actions=actions)

    async def state(self) -> EnvState:
        return await self.client.get_env(self.env_id)

    async def close(self) -> None:
        with contextlib.suppress(NotFoundError):
            await self.client.delete_env(self.env_id)

    async def __aenter__(self) -> AsyncRemoteChatEnv:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
