"""The layer kinds SGLang builds for a Qwen3.5 checkpoint: every layer is Gated DeltaNet
(`linear_attention`) except each `full_attention_interval`-th, whatever the config's
`layer_types` say. Pure functions, used by the config's validation and by the checkpoint check."""

from __future__ import annotations

from collections.abc import Sequence

FULL, LINEAR = "full_attention", "linear_attention"


def sglang_layer_types(interval: int, num_layers: int) -> list[str]:
    """The layer kinds SGLang builds for a Qwen3.5 text config with this `full_attention_interval`."""
    return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]


def full_attention_interval(layer_types: Sequence[str]) -> int | None:
    """The `full_attention_interval` from which SGLang derives exactly these layer kinds, or
    None when there is none (layers of only linear attention: one more than their number)."""
    types = list(layer_types)
    interval = types.index(FULL) + 1 if FULL in types else len(types) + 1
    return interval if sglang_layer_types(interval, len(types)) == types else None


def closest_interval(layer_types: Sequence[str]) -> int:
    """The interval whose layer kinds are nearest these: the same number of full-attention
    layers where one has it, then the fewest layers of another kind, then one that divides
    the number of layers (the last layer full attention, as in published Qwen3.5 models)."""
    types = list(layer_types)
    n, full = len(types), types.count(FULL)

    def distance(k: int) -> tuple[int, int, bool]:
        derived = sglang_layer_types(k, n)
        return abs(derived.count(FULL) - full), sum(a != b for a, b in zip(derived, types)), n % k != 0

    return min(range(1, n + 2), key=distance)


def layer_types_override(types: Sequence[str]) -> str:
    """The Hydra override that sets `model.lm.layer_types` to `types`."""
    return f"model.lm.layer_types=[{','.join(types)}]"
