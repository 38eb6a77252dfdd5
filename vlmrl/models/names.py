"""HF parameter names: checkpoint names vs transformers' in-memory module names, per family.

vlmrl's canonical "HF names" are the names in a checkpoint's safetensors files: what
`save_pretrained` writes, what SGLang loads, and what weight sync sends. transformers 5
holds some of them differently in memory: Qwen2.5-VL nests `model.layers...` as
`model.language_model.layers...` and `visual...` as `model.visual...`; Qwen3.5-MoE keeps the
routed experts of a layer fused in two tensors where the checkpoint has one per expert. The
families (`vlmrl.models.families`) own these rules; these functions dispatch on `family`.
"""

from __future__ import annotations

from typing import Any

from . import families


def to_checkpoint(state: dict[str, Any], family: str) -> dict[str, Any]:
    """An HF state dict (in-memory or checkpoint names) keyed by checkpoint names."""
    return families.get(family).to_checkpoint(dict(state))


def to_checkpoint_name(module_name: str, family: str = "qwen2_5_vl") -> str:
    """The checkpoint name of an in-memory parameter name (fused experts excepted: use `to_checkpoint`)."""
    return families.get(family).to_checkpoint_name(module_name)


def to_module_name(checkpoint_name: str, family: str = "qwen2_5_vl") -> str:
    """The in-memory parameter a checkpoint tensor is (part of)."""
    return families.get(family).module_slot(checkpoint_name)[0]


def module_slot(checkpoint_name: str, family: str) -> tuple[str, tuple | None]:
    """(in-memory parameter name, index or None): where a checkpoint tensor lives in memory."""
    return families.get(family).module_slot(checkpoint_name)


def is_vision(checkpoint_name: str, family: str = "qwen2_5_vl") -> bool:
    return checkpoint_name.startswith(families.get(family).VISION_PREFIX)
