"""Start-up environment checks (warnings only; never fatal).

torch 2.9.x wheels on CUDA ship a cuDNN whose Conv3d kernels are severely slower than
9.16.0.29's, and the Qwen vision tower's patch embedding is a Conv3d: a run on such a
machine silently loses a large share of its vision-tower time.
"""

from __future__ import annotations

import importlib.metadata
import sys

GOOD_CUDNN = "9.16.0.29"
CUDNN_FIX = f"pip install nvidia-cudnn-cu12=={GOOD_CUDNN}"


def conv3d_cudnn_warning(torch_version: str, cuda_available: bool, cudnn_version: str | None) -> str | None:
    """The warning to print for this torch / CUDA / cuDNN combination, or None.

    `cudnn_version` is the installed nvidia-cudnn package version (e.g. "9.10.2.21"), or
    None when it cannot be determined.
    """
    if not cuda_available or not torch_version.startswith("2.9."):
        return None
    if cudnn_version == GOOD_CUDNN:
        return None
    found = cudnn_version or "an unknown version"
    return (f"warning: torch {torch_version} with cuDNN {found}: Conv3d (the Qwen vision patch "
            f"embedding) runs severely slower than with cuDNN {GOOD_CUDNN}. Fix: {CUDNN_FIX}")


def installed_cudnn_version() -> str | None:
    for dist in ("nvidia-cudnn-cu12", "nvidia-cudnn-cu13"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_environment() -> list[str]:
    """Print and return the warnings for this machine (silent on CPU)."""
    import torch

    cuda = torch.cuda.is_available()
    warnings = [w for w in [conv3d_cudnn_warning(torch.__version__, cuda, installed_cudnn_version() if cuda else None)]
                if w]
    for w in warnings:
        print(w, file=sys.stderr)
    return warnings
