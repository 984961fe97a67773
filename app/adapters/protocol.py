"""Wire models of rlserve's adapter routes (vLLM's and SGLang's are in their dialects)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from app.common.protocol import WireModel
from app.engine.lora import LoraAdapter

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$"
AdapterName = Annotated[
    str,
    Field(
        min_length=1,
        max_length=128,
        pattern=NAME_PATTERN,
        description="The adapter's name: what requests put in `model` to use it.",
    ),
]


class LoadAdapterRequest(WireModel):
    name: AdapterName
    path: str = Field(
        min_length=1,
        description="A folder the server can read, in PEFT's layout (adapter_config.json and "
        "adapter_model.safetensors, as `save_pretrained` writes them). Loading a served name "
        "again serves the folder as that adapter's next version.",
    )


class AdapterInfo(WireModel):
    name: str
    version: int = Field(
        description="0 when first loaded (as the policy starts at 0), one more at each "
        "load or push under the name."
    )
    base: str = Field(description="The served model the adapter is applied to.")
    source: str = Field(description="The folder it was read from.")
    rank: int = Field(description="Its largest LoRA rank.")
    num_layers: int = Field(description="How many linear layers it adapts.")
    num_parameters: int

    @classmethod
    def of(cls, adapter: LoraAdapter) -> AdapterInfo:
        return cls(
            name=adapter.name,
            version=adapter.version,
            base="policy",
            source=adapter.source,
            rank=adapter.rank,
            num_layers=len(adapter.modules),
            num_parameters=adapter.num_parameters,
        )


class AdapterList(WireModel):
    adapters: list[AdapterInfo]
