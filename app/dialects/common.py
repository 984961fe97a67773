"""What both dialects share: token prompts sampled through the generation service, weight
versions given as strings, aborting every generation, the `/server_info` both name, and the
words of their LoRA routes."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from app.common.failures import Conflict, Unsupported, invalid, worded
from app.common.inputs import Prepared, text_volume
from app.common.roles import Role
from app.common.service import Resolved
from app.engine.registry import ModelRegistry
from app.engine.types import MAX_VERSION
from app.generation.service import GenerationService, Sampled
from app.updates.control import WeightsControl
from app.updates.types import Publish

LORA_WORDS = {
    Role.ADAPTER: "lora_name",
    Role.ADAPTER_SOURCE: "lora_path",
    Role.ADAPTER_CONFIG: "lora_path",
}
"""The fields both dialects' LoRA routes name in an adapter's refusals
(`app.updates.adapters`' roles)."""


@dataclass(frozen=True)
class Prompts:
    """A dialect request's prompts: token lists or raw texts (no chat template)."""

    token_ids: list[list[int]] | None = None
    texts: list[str] | None = None
    field: str = "token_ids"


async def sample(
    generation: GenerationService,
    prompts: Prompts,
    resolved: Resolved,
    *,
    n: int = 1,
    seed: int | None = None,
    model: str = "policy",
) -> Sampled:
    """The policy's (or one of its adapters') `n` samples of each prompt, as /v1/generate
    draws them (row k's random stream is the same for the same seed), after the same checks."""
    served = generation.served(model)
    preparer = served.preparer
    generation.check_num_items(len(prompts.token_ids or prompts.texts or []) * n, "n")

    def prepare() -> list[Prepared]:
        prepared = preparer.prompts(None, prompts.texts, prompts.token_ids, prompts.field)
        preparer.check(prepared, prompts.field, max_new_tokens=resolved.config.max_new_tokens)
        return prepared

    cost = text_volume(prompts.texts)
    checked = await preparer.off_loop(prepare, cost=cost)
    return await generation.sample(model, checked, resolved, n=n, seed=seed)


def policy_side(registry: ModelRegistry, model: str | None, field: str = "model") -> str:
    """A dialect request's model name, unset, 'policy' or one of its aliases
    (--served-model-name), as 'policy'; or a served LoRA adapter's name (or `NAME@VERSION`
    of one, or of the policy: `ModelRegistry.get`), as itself."""
    if model is None or registry.canonical(model) == "policy":
        return "policy"
    if registry.canonical(model) is None:  # an adapter, NAME@VERSION, or a 404 (503 loading)
        with worded({Role.MODEL: field}):
            served = registry.get(model)
        return "policy" if served.name == "policy" else model
    names = ["policy", *(a for a, t in registry.aliases.items() if t == "policy")]
    adapters = f", adapters {sorted(registry.adapters)}" if registry.adapters else ""
    raise invalid(field, f"'{model}' does not name the policy (served as {names}{adapters})")


def version_number(text: str | None, field: str) -> int | None:
    """A dialect's weight version (a string there): a whole number, or None to take the next
    one."""
    if text is None:
        return None
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_VERSION:
        raise invalid(
            field,
            f"'{text}' is not a version rlserve can publish: versions are whole numbers from "
            f"1 to {MAX_VERSION} (GET /v1/weights/version); leave it out for the next one",
        )
    return int(text)


def label(registry: ModelRegistry, version: int) -> str:
    """A policy version as the dialects' trainers number it (`ServingGate.label`): the version
    itself, or in a lineage a restarted trainer opened, that trainer's own count."""
    return str(registry.gate.label("policy", version))


def served_label(registry: ModelRegistry) -> str:
    """The served policy version, as the dialects' trainers number it."""
    return label(registry, registry.versions["policy"])


def publish(text: str | None, field: str) -> Publish:
    """How a dialect's update is served: as the version its trainer names (`text`, the
    request's `field`). A trainer restarted from a checkpoint counts from 1 again, as SGLang
    and vLLM let it: a version not above the served one opens a new lineage, served as the
    next version (`app.engine.gate.Lineage`), instead of being refused."""
    return Publish(version=version_number(text, field), restartable=True)


def server_info(registry: ModelRegistry, settings: Any, ranks: int) -> dict[str, Any]:
    """GET /server_info as both dialects read it: vLLM's `vllm_config` (TRL reads its
    `weight_transfer_config` and `model_config`) and SGLang's flat server fields."""
    served = registry.get("policy")
    info = served.backend.info
    transport = "nccl" if info.device.startswith("cuda") else "gloo"
    version = served_label(registry)
    return {
        "vllm_config": {
            "model_config": {
                "model": info.source,
                "served_model_name": served.name,
                "max_model_len": info.max_model_len,
                "dtype": info.dtype,
                "logprobs_mode": "raw_logprobs",
            },
            "parallel_config": {"world_size": ranks},
            "weight_transfer_config": {"backend": transport},
        },
        "model_path": info.source,
        "served_model_name": served.name,
        "context_length": info.max_model_len,
        "dtype": info.dtype,
        "device": info.device,
        "tp_size": ranks,
        "pp_size": 1,
        "dp_size": 1,
        # What slime checks of an external engine against its own arguments: no memory saver
        # (rlserve keeps its weights resident), routed experts where the policy routes.
        "enable_memory_saver": False,
        "enable_return_routed_experts": served.backend.routing is not None,
        "weight_version": version,
        "max_new_tokens": settings.limits.max_new_tokens,
        "backend": info.backend,
        "version": "rlserve",
        "startup_time": registry.loaded_at,
        "time": time.time(),
    }


async def served_ranks(weights: WeightsControl) -> int:
    """The ranks the policy's workers add to a weight-transfer group, over every replica
    (vLLM's world size, SGLang's tp size); 1 for a backend that cannot join one."""
    try:
        return (await weights.transfer_state("policy")).server_ranks
    except Unsupported:
        return 1


def confirm_version(registry: ModelRegistry, text: str) -> str:
    """A dialect's "set the version" call: rlserve's versions move with the weights, so it
    confirms the current one and refuses another."""
    current = served_label(registry)
    if text != current:
        raise Conflict(
            f"new_version: rlserve serves version {current}; versions change only with the "
            "weights (give weight_version to the update that brings them)",
            param="new_version",
        )
    return text
