"""A trained policy as an HF checkpoint (`save_hf=true`): the trainer's HF-named tensors, the
start checkpoint's config files, and the processor, loadable by transformers and SGLang."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from . import families
from .processor import save_processor


def save_hf_checkpoint(out: str | Path, state: dict[str, torch.Tensor], source: str | Path, processor: Any,
                       family: str) -> Path:
    """Write `state` (HF names) to `out`/model.safetensors beside `source`'s config.json and
    generation_config.json and `processor`'s files as `family`'s processor class."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        src = Path(source) / name
        if src.exists():
            shutil.copy(src, out / name)
    save_processor(processor, out, families.get(family).PROCESSOR_CLASS)
    return out
