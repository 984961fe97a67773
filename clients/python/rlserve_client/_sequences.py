"""The client's twin of the server's `SequenceSplit.generated`: a generated sample's tokens and
masks (the assistant mask is 1 exactly on the tokens the sample generated)."""

from __future__ import annotations

from rlserve_client.types import Masks, Tokens


def generated(prompt: list[int], response: list[int]) -> tuple[Tokens, Masks]:
    tokens = Tokens(prompt=prompt, response=response, full=prompt + response)
    masks = Masks(
        all_attention_mask=[1] * (len(prompt) + len(response)),
        all_assistant_mask=[0] * len(prompt) + [1] * len(response),
    )
    return tokens, masks
