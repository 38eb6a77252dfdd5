"""HF parameter names: checkpoint names vs transformers' in-memory module names.

vlmrl's canonical "HF names" are the names in the checkpoint's safetensors files
(`model.layers.0.self_attn.q_proj.weight`, `visual.blocks.0.attn.qkv.weight`,
`lm_head.weight`): what `save_pretrained` writes, what SGLang loads, and what weight sync
sends. transformers 5 nests the modules differently in memory
(`model.language_model.layers...`, `model.visual...`); these two pure functions convert.
"""

from __future__ import annotations

# (checkpoint prefix, in-memory prefix), most specific first.
_PREFIXES = (
    ("visual.", "model.visual."),
    ("model.", "model.language_model."),
)


def to_module_name(checkpoint_name: str) -> str:
    """`model.layers.0...` -> `model.language_model.layers.0...`; `visual.x` -> `model.visual.x`."""
    for ckpt, mem in _PREFIXES:
        if checkpoint_name.startswith(ckpt):
            return mem + checkpoint_name[len(ckpt):]
    return checkpoint_name


def to_checkpoint_name(module_name: str) -> str:
    """Inverse of `to_module_name`."""
    for ckpt, mem in _PREFIXES:
        if module_name.startswith(mem):
            return ckpt + module_name[len(mem):]
    return module_name


def is_vision(checkpoint_name: str) -> bool:
    return checkpoint_name.startswith("visual.")
