"""RMSNorm for the Megatron layer specs, computed like the HF Qwen models.

torch's RMSNorm wrapper in megatron-core refuses sequence parallelism and Apex/TE norms
are absent on CPU machines. This one normalises in float32 (as HF does), supports the
zero-centred weight of Qwen3.5 (`config.layernorm_zero_centered_gamma`: scale = 1 + w),
and marks its weight `sequence_parallel` so that gradient reduction sums it over the
tensor-parallel group when each rank only saw its slice of the sequence. `fused=True`
(`hardware.fused_kernels`) runs the Inductor-compiled twin of `rms_norm`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .kernels import pick


def rms_norm(x: Tensor, weight: Tensor, eps: float, zero_centered: bool) -> Tensor:
    """RMSNorm over the last dim, normalised in float32 like HF's Qwen models.

    zero_centered (Qwen3.5): scale = 1 + weight, applied in float32; otherwise the
    normalised input is cast back first and scaled by the weight in its own dtype.
    """
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


class RMSNorm(torch.nn.Module):
    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6, fused: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self._norm = pick(rms_norm, fused)
        self.zero_centered = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]

    def forward(self, x: Tensor) -> Tensor:
        return self._norm(x, self.weight, self.eps, self.zero_centered)
