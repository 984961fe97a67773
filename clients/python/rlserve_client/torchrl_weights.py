"""`RLServeWeightUpdater`: TorchRL's weight-updater interface, pushing to an rlserve server.

    updater = RLServeWeightUpdater(client, model=hf_model)      # the model the trainer trains
    collector = LLMCollector(env, policy=RemotePolicy(client), weight_updater=updater,
                             track_policy_version=True, dialog_turns_per_batch=32)
    for data in collector:
        ...train hf_model...
        collector.update_policy_weights_()                    # or (hf_model.state_dict())

Each update goes over the collective transfer (`Client.weight_transfer`: the trainer is rank 0
of a torch.distributed group the server joins) and falls back to uploading a safetensors file
when that group cannot be formed (a server that cannot reach this host, or transfers turned
off). The server pauses serving in `pause` mode ('keep': generations in flight go on under the
new weights, their tokens tagged with the version). After an update the collector's policy
version is the server's (`RemotePolicy` samples carry the server's versions, so the two
agree).

With `adapter="name"` it pushes a LoRA adapter instead: the trainer's PEFT model's adapter
tensors alone (`Client.push_adapter`, no pause), each push the adapter's next version, and the
collector counts the adapter's versions (sample with `RemotePolicy(client, model="name")`).

TorchRL 0.14 marks `WeightUpdaterBase` as deprecated in favour of weight-sync schemes, but its
`LLMCollector` takes only `weight_updater=`; this class implements that."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torchrl.collectors import WeightUpdaterBase

from rlserve_client._client import Client
from rlserve_client._exceptions import RLServeError
from rlserve_client.lora import adapter_file
from rlserve_client.types import Adapter, WeightsUpdated
from rlserve_client.weight_transfer import WeightSync

log = logging.getLogger(__name__)

with warnings.catch_warnings():  # the subclassing warning: see the module docstring
    warnings.simplefilter("ignore", DeprecationWarning)

    class RLServeWeightUpdater(WeightUpdaterBase):  # type: ignore[misc]
        """Pushes weights to the served `target` model ("policy"). `model`: the trainer's
        module, pushed when `update_policy_weights_()` is called without weights.
        `transfer`: "collective" (fall back to upload when the group cannot be joined),
        or "upload". `transfer_options`: `Client.weight_transfer` options. `adapter`: push
        the LoRA adapter of that name instead (loaded on the server with `load_adapter`):
        `model` is then a PEFT model, and only its adapter's tensors travel."""

        def __init__(
            self,
            client: Client,
            *,
            model: torch.nn.Module | None = None,
            target: str = "policy",
            transfer: str = "collective",
            pause: str = "keep",
            adapter: str | None = None,
            **transfer_options: Any,
        ) -> None:
            if transfer not in ("collective", "upload"):
                raise ValueError(f"transfer must be collective or upload, got {transfer!r}")
            self.client = client
            self.model = model
            self.target = target
            self.transfer = transfer
            self.pause = pause
            self.transfer_options = transfer_options
            self.adapter = adapter
            self.last: WeightsUpdated | Adapter | None = None
            self._sync: WeightSync | None = None

        # -- TorchRL's interface ---------------------------------------------------------

        def _get_server_weights(self) -> Any:
            if self.model is None:
                raise ValueError(
                    "update_policy_weights_() without weights needs RLServeWeightUpdater(model=)"
                )
            return self.model

        def _maybe_map_weights(self, weights: Any) -> dict[str, torch.Tensor]:
            """A state dict of HF parameter names from a module, a mapping or a TensorDict."""
            if weights is None:
                weights = self._get_server_weights()
            if self.adapter is not None and isinstance(weights, torch.nn.Module):
                from peft import get_peft_model_state_dict

                return dict(get_peft_model_state_dict(weights))
            if isinstance(weights, torch.nn.Module) and not hasattr(weights, "in_keys"):
                return dict(weights.state_dict())
            if hasattr(weights, "flatten_keys"):  # a TensorDict of the module's parameters
                flat = weights.flatten_keys(".")
                return {str(k): v for k, v in flat.items()}
            if isinstance(weights, Mapping):
                return dict(weights)
            raise TypeError(f"cannot push weights from {type(weights).__name__}")

        def _sync_weights_with_worker(
            self, *, worker_id: Any = None, server_weights: Any = None
        ) -> None:
            last = self.last = self.push(self._maybe_map_weights(server_weights))
            self._align_versions(last.version if isinstance(last, Adapter) else last.policy_version)

        def all_worker_ids(self) -> None:
            return None  # one server, one call

        # -- pushing ---------------------------------------------------------------------

        def push(self, weights: Mapping[str, torch.Tensor]) -> WeightsUpdated | Adapter:
            """One update of the served weights (or adapter); the server's answer (its new
            version)."""
            if self.adapter is not None:
                # with the PEFT model's config: the first push serves the adapter
                config = getattr(self.model, "peft_config", {}).get("default")
                payload = adapter_file(weights, config)
                return self.client.push_adapter(name=self.adapter, payload=payload)
            if self.transfer == "collective":
                sync = self._collective()
                if sync is not None:
                    return sync.send(weights, pause=self.pause)
            from safetensors.torch import save

            # safetensors refuses tensors sharing memory (tied embeddings): copy each
            payload = save({k: v.detach().contiguous().clone() for k, v in weights.items()})
            return self.client.upload_weights(payload=payload, model=self.target, pause=self.pause)

        def _collective(self) -> WeightSync | None:
            """The joined transfer group, joined on first use; None (and uploads from then
            on) when it cannot be formed."""
            if self._sync is None:
                options = {"model": self.target, **self.transfer_options}
                sync = self.client.weight_transfer(**options)
                try:
                    self._sync = sync.open()
                except (RLServeError, RuntimeError, OSError) as error:
                    log.warning("collective transfer unavailable (%s): uploading instead", error)
                    with contextlib.suppress(Exception):
                        sync.close()
                    self.transfer = "upload"
                    return None
            return self._sync

        def _align_versions(self, version: int) -> None:
            """Collectors count one version per update after this returns: start them one
            below the server's so they land on it."""
            for collector in self.collectors or []:
                tracker = getattr(collector, "policy_version_tracker", None)
                if tracker is not None and hasattr(tracker, "version"):
                    tracker.version = version - 1

        def close(self) -> None:
            if self._sync is not None:
                self._sync.close()
                self._sync = None
