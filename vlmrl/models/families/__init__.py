"""Model families: everything that differs between Qwen2.5-VL and Qwen3.5(-MoE), one module each.

A family module is the whole per-architecture wiring of vlmrl; the bridge, the adapters,
the parity checks and the tiny-checkpoint maker stay generic and ask the family:

    FAMILIES                 family names it serves (`model.family`)
    MODEL_TYPES              HF `config.model_type` -> family name
    PROCESSOR_CLASS          the transformers processor class of its checkpoints
    hf_config(model)         the transformers config of a vlmrl ModelConfig
    model_config_from_hf(hf, name)   a vlmrl ModelConfig from a transformers config
    hf_model_class(model)    the transformers *ForConditionalGeneration class
    vision_tower_class(hf_vision_config)   the HF vision tower class
    megatron_kwargs(model)   extra megatron TransformerConfig fields of the family
    layer_spec(model, layer_type, **backends)   the Megatron ModuleSpec of one layer type
    layer_rule(model, i, rest, experts)   how a Megatron layer parameter maps to HF tensors
    top_rule(model, megatron_name)        the same for embedding, output layer, final norm
    VISION_PREFIX            HF checkpoint prefix of the vision tower's parameters
    to_checkpoint(state) / module_slot(name)   HF in-memory names <-> checkpoint names
    is_fused / fused_parts / take   tensors stored fused in memory (routed experts) and their slices

Adding a family is a new module here, its name in `_MODULES`, and a `conf/model/` option.
This package imports no torch or megatron at module scope (the dry-run path reaches it).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

_MODULES = ("qwen2_5_vl", "qwen3_5")


def _load() -> list[ModuleType]:
    return [importlib.import_module(f"{__name__}.{m}") for m in _MODULES]


def names() -> tuple[str, ...]:
    """Every supported `model.family`."""
    return tuple(f for m in _load() for f in m.FAMILIES)


def get(family: str) -> ModuleType:
    """The module wiring `family` (ValueError naming the supported ones otherwise)."""
    for m in _load():
        if family in m.FAMILIES:
            return m
    raise ValueError(f"unknown model family {family!r}; supported: {list(names())}")


def family_of_hf(hf_config: Any) -> str:
    """The vlmrl family of a transformers config (by its model_type)."""
    model_type = getattr(hf_config, "model_type", None)
    for m in _load():
        if model_type in m.MODEL_TYPES:
            return m.MODEL_TYPES[model_type]
    supported = sorted(t for m in _load() for t in m.MODEL_TYPES)
    raise ValueError(f"model_type {model_type!r} is not supported; supported: {supported}")
