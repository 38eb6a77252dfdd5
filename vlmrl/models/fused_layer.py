"""A Megatron transformer layer whose dense body runs as two Inductor-compiled graphs.

Without TransformerEngine, a megatron-core layer is dozens of small kernel launches plus
Python per layer (parallel-linear autograd functions, bias-dropout-add, norms, rotary),
and on a GPU the host, not the GPU, sets the pace: on the H200 bench the GPU is busy for
about 60% of a step. `FusedTransformerLayer` (the layer spec's module with
`hardware.fused_kernels=true`) keeps Megatron's modules and parameters (names, sharding
attributes, checkpoints, DDP hooks and optimizer are unchanged) but runs its forward as

    pre_attention   input RMSNorm -> QKV GEMM (+bias) -> split heads -> M-RoPE      compiled
    core attention  per-sample cuDNN SDPA / flash varlen / context parallel        eager
    post_attention  out-proj GEMM -> residual -> RMSNorm -> fc1 -> SwiGLU -> fc2 -> residual   compiled

Both compiled functions take the weights as arguments, so all layers share one compiled
graph each (forward and backward), whatever their index. The core attention stays eager:
its per-sample layout is host data that a graph would have to be specialised on.

The fast path covers the dense Qwen2.5-VL-style layer on one tensor-parallel rank (any PP,
CP, DP, full-layer recompute); everything else (TP/SP communication, qk norms, output
gates, MoE, dropout, selective recompute, inference contexts) goes through Megatron's own
forward, with the per-function fused kernels of `vlmrl.models.kernels`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import Tensor

from .attention import GroupedSelfAttention, PackedSelfAttentionCore, VLPackedSeqParams
from .kernels import fused
from .mrope import rope_qk
from .norm import RMSNorm, rms_norm


def pre_attention(h: Tensor, norm_w: Tensor, eps: float, zero_centered: bool, qkv_w: Tensor,
                  qkv_b: Tensor | None, cos: Tensor, sin: Tensor, heads: int, groups: int,
                  head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """h [T, 1, H] -> rotated q [T, heads, d], k and v [T, groups, d].

    Megatron's fused QKV rows hold, per query group, that group's query heads then its key
    and its value (`vlmrl.models.adapters`)."""
    x = rms_norm(h, norm_w, eps, zero_centered)
    qkv = F.linear(x, qkv_w, qkv_b)
    per = heads // groups
    qkv = qkv.view(qkv.shape[0], groups, (per + 2) * head_dim)
    q, k, v = torch.split(qkv, [per * head_dim, head_dim, head_dim], dim=-1)
    q = q.reshape(q.shape[0], heads, head_dim)
    q, k = rope_qk(q, k, cos, sin)
    return q, k, v


def post_attention(ctx: Tensor, residual: Tensor, proj_w: Tensor, norm_w: Tensor, eps: float,
                   zero_centered: bool, fc1_w: Tensor, fc2_w: Tensor) -> Tensor:
    """Attention output [T, heads*d] + residual [T, 1, H] -> the layer's output [T, 1, H]."""
    h = residual + F.linear(ctx, proj_w).view_as(residual)
    x = rms_norm(h, norm_w, eps, zero_centered)
    gate, up = F.linear(x, fc1_w).chunk(2, dim=-1)
    return h + F.linear(F.silu(gate) * up, fc2_w)


class FusedTransformerLayer(TransformerLayer):
    """megatron-core's TransformerLayer with the compiled dense fast path (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fast_path = self._supports_fast_path()

    def _supports_fast_path(self) -> bool:
        from megatron.core.transformer.attention import SelfAttention
        from megatron.core.transformer.mlp import MLP

        c = self.config
        attn, mlp = self.self_attention, self.mlp
        return (
            c.tensor_model_parallel_size == 1 and not c.sequence_parallel
            and c.hidden_dropout == 0.0 and c.attention_dropout == 0.0
            and not c.fp32_residual_connection and not c.apply_residual_connection_post_layernorm
            and c.gated_linear_unit and c.activation_func is F.silu and not c.add_bias_linear
            and not getattr(c, "attention_output_gate", False) and not c.qk_layernorm
            and c.recompute_granularity != "selective"  # Megatron's per-module recompute wraps its own forward
            and not getattr(self, "recompute_input_layernorm", False)
            and not getattr(self, "recompute_pre_mlp_layernorm", False)
            and not getattr(self, "offload_attn_norm", False) and not getattr(self, "offload_mlp_norm", False)
            and type(attn) in (SelfAttention, GroupedSelfAttention)
            and isinstance(attn.core_attention, PackedSelfAttentionCore)
            and type(mlp) is MLP
            and isinstance(self.input_layernorm, RMSNorm) and isinstance(self.pre_mlp_layernorm, RMSNorm)
        )

    def forward(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        p = kwargs.get("packed_seq_params")
        if (not self.fast_path or args or kwargs.get("inference_context") is not None
                or kwargs.get("inference_params") is not None or not isinstance(p, VLPackedSeqParams)
                or p.qkv_format != "thd" or p.rope_cos is None):
            return super().forward(*args, **kwargs)
        h = kwargs["hidden_states"]
        attn, c = self.self_attention, self.config
        n1, n2 = self.input_layernorm, self.pre_mlp_layernorm
        q, k, v = fused(pre_attention)(
            h, n1.weight, n1.eps, n1.zero_centered, attn.linear_qkv.weight, attn.linear_qkv.bias,
            p.rope_cos, p.rope_sin, c.num_attention_heads, c.num_query_groups, c.kv_channels)
        ctx = attn.core_attention.attend(q, k, v, p)
        out = fused(post_attention)(ctx, h, attn.linear_proj.weight, n2.weight, n2.eps, n2.zero_centered,
                                    self.mlp.linear_fc1.weight, self.mlp.linear_fc2.weight)
        return out, kwargs.get("context")
