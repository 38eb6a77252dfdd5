"""RMSNorm for the Megatron layer specs, computed like the HF Qwen models.

torch's RMSNorm wrapper in megatron-core refuses sequence parallelism and Apex/TE norms
are absent on CPU machines. This one normalises in float32 (as HF does), supports the
zero-centred weight of Qwen3.5 (`config.layernorm_zero_centered_gamma`: scale = 1 + w),
and marks its weight `sequence_parallel` so that gradient reduction sums it over the
tensor-parallel group when each rank only saw its slice of the sequence.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class RMSNorm(torch.nn.Module):
    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)
