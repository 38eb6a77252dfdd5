"""Multimodal rotary position embedding (M-RoPE) of the Qwen-VL language models.

Pure tensor functions. Every token carries a 3D position (temporal, height, width): text
tokens advance all three axes together, image tokens take their patch's grid position,
and text after an image continues from the image's start plus its larger spatial side.
`vlmrl.models.packing.mrope_position_ids` computes these positions per sample (they are
rebuilt for every packed sample); the functions here turn positions into cos/sin tables
and rotate queries/keys.

The rotary half-dimensions are split into sections [t, h, w] that read frequencies from
the matching axis: contiguous blocks (Qwen2-VL / Qwen2.5-VL) or interleaved t,h,w,t,h,w...
(Qwen3-VL / Qwen3.5, `interleaved=True`). Only the first `rotary_dim` channels of a head
rotate (partial rotary); the rest pass through.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class MRopeSpec:
    head_dim: int
    rotary_dim: int  # head_dim * partial_rotary_factor
    theta: float
    mrope_section: tuple[int, int, int]
    interleaved: bool = False

    def __post_init__(self) -> None:
        if sum(self.mrope_section) * 2 != self.rotary_dim:
            raise ValueError(f"sum(mrope_section)={sum(self.mrope_section)} must equal rotary_dim/2 = "
                             f"{self.rotary_dim}/2")

    @classmethod
    def from_lm_config(cls, lm) -> MRopeSpec:  # lm: vlmrl.config.schema.LanguageModelConfig
        rotary_dim = int(lm.head_dim * lm.partial_rotary_factor)
        return cls(lm.head_dim, rotary_dim, float(lm.rope_theta), tuple(lm.mrope_section),
                   bool(lm.mrope_interleaved))


def inverse_frequencies(spec: MRopeSpec, device: torch.device | None = None) -> Tensor:
    """[rotary_dim/2] float32 inverse frequencies theta^(-2i/rotary_dim)."""
    exponent = torch.arange(0, spec.rotary_dim, 2, dtype=torch.int64, device=device).float() / spec.rotary_dim
    return 1.0 / (spec.theta ** exponent)


def _select_axes(freqs: Tensor, spec: MRopeSpec) -> Tensor:
    """[3, T, D/2] per-axis frequencies -> [T, D/2], each channel from its section's axis."""
    half = freqs.shape[-1]
    if spec.interleaved:
        # channel j reads axis j % 3 while that axis still has channels in its section
        axis = torch.zeros(half, dtype=torch.long, device=freqs.device)
        for a in (1, 2):
            axis[a: spec.mrope_section[a] * 3: 3] = a
    else:
        axis = torch.cat([torch.full((n,), a % 3, dtype=torch.long, device=freqs.device)
                          for a, n in enumerate(spec.mrope_section)])
    return freqs.gather(0, axis.view(1, 1, half).expand(1, freqs.shape[1], half)).squeeze(0)


def mrope_cos_sin(position_ids: Tensor, spec: MRopeSpec, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """cos, sin of shape [T, rotary_dim] for positions [3, T] (a [T] tensor means text-only).

    Computed in float32 like HF (positions times inverse frequencies), cast to `dtype`.
    """
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0).expand(3, -1)
    if position_ids.dim() != 2 or position_ids.shape[0] != 3:
        raise ValueError(f"position_ids must be [3, T], got {tuple(position_ids.shape)}")
    inv = inverse_frequencies(spec, position_ids.device)
    freqs = position_ids.float()[..., None] * inv  # [3, T, D/2]
    freqs = _select_axes(freqs, spec)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [T, heads, head_dim] with cos/sin [T, rotary_dim] (partial rotary allowed)."""
    rot = cos.shape[-1]
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def rope_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Queries and keys rotated by the same per-token tables (one fused call on GPUs)."""
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
