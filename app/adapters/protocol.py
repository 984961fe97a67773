"""Wire models of rlserve's adapter routes (vLLM's and SGLang's are in their dialects)."""

from __future__ import annotations

from pydantic import Field

from app.common.protocol import AdapterName, ServerPath, WireModel
from app.engine.adapter_gate import AdapterGateState
from app.updates.protocol import PauseMode
from app.weights.lora import LoraAdapter


class LoadAdapterRequest(WireModel):
    name: AdapterName
    path: ServerPath = Field(
        description="A folder the server can read, in PEFT's layout (adapter_config.json and "
        "adapter_model.safetensors, as `save_pretrained` writes them). Loading a served name "
        "again serves the folder as that adapter's next version.",
    )


ADAPTER_PAUSE_DOC = (
    "How the adapter's requests already inside meet the pause: 'wait' lets them finish; "
    "'abort' ends their generations at the next token (they return what they produced, "
    "finish_reason 'abort'); 'keep' returns at once and lets them go on with the version they "
    "started with. New requests naming the adapter wait in every mode; scoring always "
    "finishes. The policy and other adapters serve on."
)


class PauseAdapterRequest(WireModel):
    mode: PauseMode = Field(default="wait", description=ADAPTER_PAUSE_DOC)


class AdapterInfo(WireModel):
    name: str
    version: int = Field(
        description="0 when first loaded (as the policy starts at 0), one more at each "
        "load or push under the name."
    )
    base: str = Field(description="The served model the adapter is applied to.")
    source: str = Field(description="The folder it was read from, or 'upload'.")
    rank: int = Field(description="Its largest LoRA rank.")
    num_layers: int = Field(description="How many linear layers it adapts.")
    num_parameters: int
    paused: PauseMode | None = Field(
        default=None, description="The mode it is paused with (null while it serves)."
    )
    in_flight: int = Field(default=0, description="Its requests inside now.")
    waiting: int = Field(default=0, description="Its requests held back by its pause.")

    @classmethod
    def of(cls, adapter: LoraAdapter, state: AdapterGateState | None = None) -> AdapterInfo:
        """`state`: its pause state (None: unloaded, or not asked)."""
        gate = state or AdapterGateState(None, 0, 0)
        return cls(
            name=adapter.name,
            version=adapter.version,
            base="policy",
            source=adapter.source,
            rank=adapter.rank,
            num_layers=len(adapter.modules),
            num_parameters=adapter.num_parameters,
            paused=gate.paused,
            in_flight=gate.in_flight,
            waiting=gate.waiting,
        )


class AdapterList(WireModel):
    adapters: list[AdapterInfo]
