"""A Megatron transformer layer whose body runs as two Inductor-compiled graphs around its
eager kernels.

Without TransformerEngine, a megatron-core layer is dozens of small kernel launches plus
Python per layer (parallel-linear autograd functions, bias-dropout-add, norms, rotary,
gates), and on a GPU the host, not the GPU, sets the pace. `FusedTransformerLayer` (the
layer spec's module with `hardware.fused_kernels=true`) keeps Megatron's modules and
parameters (names, sharding attributes, checkpoints, DDP hooks and optimizer are
unchanged) but runs its forward as one of

    attention layer (Qwen2.5-VL; Qwen3.5's gated attention)
      attention_in    input RMSNorm -> QKV(+gate) GEMM -> split heads -> q/k RMSNorm -> M-RoPE   compiled
      core attention  per-sample cuDNN SDPA / flash varlen / context parallel                 eager
      attention_out   output gate -> out-proj GEMM -> residual -> pre-MLP RMSNorm [-> MLP]    compiled
    (with `hardware.lm_attention_backend=flash4`: `attention_layer`, all three as one graph,
     FlashAttention 4 a custom op inside it; `vlmrl.models.flash4`)

    Gated DeltaNet layer (Qwen3.5)
      gdn_in          input RMSNorm -> the four input projections -> decay and beta           compiled
      recurrence      short convolution + gated delta rule (fla's kernels or torch)            eager
      gdn_out         gated RMSNorm -> out-proj GEMM -> residual -> pre-MLP RMSNorm [-> MLP]  compiled

A dense SwiGLU MLP (and its residual) is part of the second graph, and so is an all-local
MoE block where `LocalMoELayer` would run it compiled (`moe.moe_forward`: router, dispatch,
grouped experts, combine, shared expert): one graph replay fewer per layer each way, and
no MoE module call, on a step the host otherwise paces. Its tokens per expert still reach
the router's observer. Any other MLP is called as its module on the normed output, so its
hooks and routing statistics work as in Megatron's forward. The
compiled functions take the weights as arguments, so all layers of a kind share one graph
each (forward and backward), whatever their index. The eager middle keeps its per-sample
layout as host data that a graph would have to be specialised on.

The fast path covers one tensor-parallel rank (any PP, DP, full-layer recompute; CP for
attention layers); everything else (TP/SP communication, CP in Gated DeltaNet layers,
dropout, biases on the output projections, selective recompute, inference contexts) goes
through Megatron's own forward, with the per-function fused kernels of `vlmrl.models.kernels`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import Tensor

from .attention import GroupedSelfAttention, PackedSelfAttentionCore, VLPackedSeqParams
from .flash4 import flash4_attention
from .gated_delta import decay_and_beta, gated_rms_norm
from .gdn import GatedDeltaNet
from .kernels import fused
from .moe import LocalMoELayer, moe_forward
from .mrope import rope_qk
from .norm import RMSNorm, rms_norm

Norm = tuple[Tensor, float, bool]  # an RMSNorm's (weight, eps, zero_centered)


def _norm(x: Tensor, norm: Norm) -> Tensor:
    return rms_norm(x, *norm)


def _mlp_or_norm(h: Tensor, norm: Norm, fc1_w: Tensor | None, fc2_w: Tensor | None,
                 moe: tuple[Any, ...] | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """After the mixer's residual h [T, 1, H] -> (output, normed, tokens per expert):
    with a dense SwiGLU MLP's weights, (the layer's output, None, None); with the all-local
    MoE block's arguments (`LocalMoELayer.block_args`), (the layer's output, None, the
    block's routing statistics [E + 2]: tokens per expert, then its disagreement with the
    engine's experts); with neither, (h, its pre-MLP norm, None): the MLP module
    runs next."""
    x = _norm(h, norm)
    if moe is not None:
        y, counts = moe_forward(x.reshape(-1, x.shape[-1]), *moe)
        return h + y.view_as(h), None, counts
    if fc1_w is None:
        return h, x, None
    gate, up = F.linear(x, fc1_w).chunk(2, dim=-1)
    return h + F.linear(F.silu(gate) * up, fc2_w), None, None


def attention_in(h: Tensor, norm: Norm, qkv_w: Tensor, qkv_b: Tensor | None, q_norm: Norm | None,
                 k_norm: Norm | None, cos: Tensor, sin: Tensor, heads: int, groups: int, head_dim: int,
                 gated: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """h [T, 1, H] -> rotated q [T, heads, d], k and v [T, groups, d], output gate [T, heads * d] or None.

    Megatron's fused QKV rows hold, per query group, that group's query heads, then (with an
    output gate) its gate heads, then its key and its value (`vlmrl.models.adapters`); the
    q/k norms act per head before the rotary embedding."""
    x = _norm(h, norm)
    qkv = F.linear(x, qkv_w, qkv_b)
    per = heads // groups
    widths = [per * head_dim, per * head_dim, head_dim, head_dim] if gated else [per * head_dim, head_dim, head_dim]
    parts = torch.split(qkv.view(qkv.shape[0], groups, sum(widths)), widths, dim=-1)
    q, k, v = parts[0].reshape(qkv.shape[0], heads, head_dim), parts[-2], parts[-1]
    if q_norm is not None:
        q = _norm(q, q_norm)
    if k_norm is not None:
        k = _norm(k, k_norm)
    q, k = rope_qk(q, k, cos, sin)
    gate = parts[1].reshape(qkv.shape[0], heads * head_dim) if gated else None
    return q, k, v, gate


def attention_out(ctx: Tensor, gate: Tensor | None, residual: Tensor, proj_w: Tensor, norm: Norm,
                  fc1_w: Tensor | None = None, fc2_w: Tensor | None = None,
                  moe: tuple[Any, ...] | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Attention output [T, heads * d] (times sigmoid(gate) in float32, as Megatron's output
    gate) -> out-proj -> + residual [T, 1, H] -> `_mlp_or_norm`."""
    if gate is not None:
        ctx = (ctx * torch.sigmoid(gate.float())).to(ctx.dtype)
    h = residual + F.linear(ctx, proj_w).view_as(residual)
    return _mlp_or_norm(h, norm, fc1_w, fc2_w, moe)


def attention_layer(h: Tensor, norm: Norm, qkv_w: Tensor, qkv_b: Tensor | None, q_norm: Norm | None,
                    k_norm: Norm | None, cos: Tensor, sin: Tensor, heads: int, groups: int, head_dim: int,
                    gated: bool, cu_seqlens: Tensor, max_len: int, causal: bool, proj_w: Tensor, norm2: Norm,
                    fc1_w: Tensor | None = None, fc2_w: Tensor | None = None,
                    moe: tuple[Any, ...] | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The whole attention layer as one graph: `attention_in` -> FlashAttention 4 (a custom op
    inside the graph, `vlmrl.models.flash4`; softmax scale 1/sqrt(head_dim)) -> `attention_out`."""
    q, k, v, gate = attention_in(h, norm, qkv_w, qkv_b, q_norm, k_norm, cos, sin, heads, groups, head_dim, gated)
    ctx = flash4_attention(q, k, v, cu_seqlens, max_len, head_dim ** -0.5, causal)
    return attention_out(ctx.reshape(ctx.shape[0], heads * head_dim), gate, h, proj_w, norm2, fc1_w, fc2_w, moe)


def gdn_in(h: Tensor, norm: Norm, qkv_w: Tensor, z_w: Tensor, b_w: Tensor, a_w: Tensor, a_log: Tensor,
           dt_bias: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """h [T, 1, H] -> the Gated DeltaNet's projections: mixed [T, C] (before the convolution),
    z [T, Hv * dv], and its decay g and write strength beta [T, Hv]."""
    x = _norm(h, norm).squeeze(1)
    g, beta = decay_and_beta(F.linear(x, a_w), F.linear(x, b_w), a_log, dt_bias)
    return F.linear(x, qkv_w), F.linear(x, z_w), g, beta


def gdn_out(o: Tensor, z: Tensor, gate_norm_w: Tensor, gate_eps: float, residual: Tensor, out_w: Tensor,
            norm: Norm, fc1_w: Tensor | None = None, fc2_w: Tensor | None = None,
            moe: tuple[Any, ...] | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Recurrence output o [T, Hv, dv] -> gated RMSNorm (gate z) -> out-proj -> + residual ->
    `_mlp_or_norm`."""
    o = gated_rms_norm(o, z.view_as(o), gate_norm_w, gate_eps)
    h = residual + F.linear(o.reshape(o.shape[0], -1), out_w).view_as(residual)
    return _mlp_or_norm(h, norm, fc1_w, fc2_w, moe)


class FusedTransformerLayer(TransformerLayer):
    """megatron-core's TransformerLayer with the compiled fast path (module docstring).

    `fast_path`: the layer's modules allow it (checked once at build); each forward also checks
    its inputs. An observer may set `vlmrl_span_sink(layer, kind, edge)`: on the fast path the
    layer reports the start and end of its mixer ("attention" or "gdn") through it, since the
    mixer module itself is not called (a dense MLP fused into the graph counts with the
    mixer). A MoE block fused into the output graph is reported as a "moe" span that covers
    that whole graph: the mixer's gate or gated norm, out-projection and pre-MLP norm count
    as MoE time there."""

    cuda_graphs = False  # its graphs replayed as CUDA graphs (`kernels.use_cuda_graphs`)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mixer_kind = self._fast_path_kind()
        self.fast_path = self.mixer_kind is not None
        self.fused_mlp = self.fast_path and self._dense_mlp()

    @property
    def graphs_eligible(self) -> bool:
        return self.fast_path

    def _fast_path_kind(self) -> str | None:
        from megatron.core.transformer.attention import SelfAttention
        from megatron.core.transformer.identity_op import IdentityOp

        c = self.config
        attn = self.self_attention
        common = (
            c.tensor_model_parallel_size == 1 and not c.sequence_parallel
            and c.hidden_dropout == 0.0 and not c.add_bias_linear
            and not c.fp32_residual_connection and not c.apply_residual_connection_post_layernorm
            and c.recompute_granularity != "selective"  # Megatron's per-module recompute wraps its own forward
            and not getattr(self, "recompute_input_layernorm", False)
            and not getattr(self, "recompute_pre_mlp_layernorm", False)
            and not getattr(self, "offload_attn_norm", False) and not getattr(self, "offload_mlp_norm", False)
            and isinstance(self.input_layernorm, RMSNorm) and isinstance(self.pre_mlp_layernorm, RMSNorm)
        )
        if not common:
            return None
        if type(attn) in (SelfAttention, GroupedSelfAttention):
            norms_ok = all(isinstance(n, (RMSNorm, IdentityOp)) or n is None
                           for n in (attn.q_layernorm, attn.k_layernorm))
            if (c.attention_dropout == 0.0 and norms_ok
                    and isinstance(attn.core_attention, PackedSelfAttentionCore)):
                return "attention"
            return None
        if isinstance(attn, GatedDeltaNet) and attn.tp == 1:
            return "gdn"
        return None

    def _dense_mlp(self) -> bool:
        from megatron.core.transformer.mlp import MLP

        c = self.config
        return type(self.mlp) is MLP and c.gated_linear_unit and c.activation_func is F.silu

    def forward(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        p = kwargs.get("packed_seq_params")
        if (not self.fast_path or args or kwargs.get("inference_context") is not None
                or kwargs.get("inference_params") is not None or not isinstance(p, VLPackedSeqParams)
                or p.qkv_format != "thd"
                or (self.mixer_kind == "attention" and p.rope_cos is None)
                or (self.mixer_kind == "gdn" and p.cp_size != 1)):
            return super().forward(*args, **kwargs)
        # [T, 1, H] with the strides of a contiguous tensor: the first layer gets the embedding
        # as a transposed view (stride T*H on the size-1 dim), which would cost every graph of
        # its kind a second compile for a stride that addresses nothing
        h = kwargs["hidden_states"]
        if h.stride(1) != h.shape[2]:
            h = h.squeeze(1).unsqueeze(1)
        n1, n2 = self.input_layernorm, self.pre_mlp_layernorm
        norm1, norm2 = (n1.weight, n1.eps, n1.zero_centered), (n2.weight, n2.eps, n2.zero_centered)
        fc = (self.mlp.linear_fc1.weight, self.mlp.linear_fc2.weight) if self.fused_mlp else (None, None)
        moe = (self.mlp.block_args(h.shape[0] * h.shape[1])
               if isinstance(self.mlp, LocalMoELayer) and self.mlp.compiles(h) else None)
        self._span(self.mixer_kind, "start")
        if self.mixer_kind == "attention":
            out, x, counts = self._attention(h, p, norm1, norm2, fc, moe)
        else:
            out, x, counts = self._gdn(h, p, norm1, norm2, fc, moe)
        self._span("moe" if moe is not None else self.mixer_kind, "stop")
        if counts is not None:
            self.mlp.report_routing(counts, h.shape[0] * h.shape[1])
        if x is not None:  # the MLP module on the normed output, then its residual
            mlp_out, mlp_bias = self.mlp(x)
            out = out + (mlp_out if mlp_bias is None else mlp_out + mlp_bias)
        return out, kwargs.get("context")

    def _span(self, kind: str, edge: str) -> None:
        sink = getattr(self, "vlmrl_span_sink", None)
        if sink is not None:
            sink(self, kind, edge)

    def _output_graph(self, fn: Any, *args: Any, moe: tuple[Any, ...] | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The mixer's output graph (`attention_out` / `gdn_out`); with the compiled MoE block's
        arguments, the block runs inside it, and its span is reported from here on."""
        if moe is not None:
            self._span(self.mixer_kind, "stop")
            self._span("moe", "start")
        return fused(fn, self.cuda_graphs)(*args, moe=moe)

    def _attention(self, h: Tensor, p: VLPackedSeqParams, norm1: Norm, norm2: Norm,
                   fc: tuple[Tensor | None, Tensor | None],
                   moe: tuple[Any, ...] | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        attn, c = self.self_attention, self.config
        gated = bool(getattr(c, "attention_output_gate", False))

        def qk(n: Any) -> Norm | None:
            return (n.weight, n.eps, n.zero_centered) if isinstance(n, RMSNorm) else None

        core = attn.core_attention
        inside = core.graph_attention(p, h)
        if inside is not None:  # FlashAttention 4 inside the graph: the layer is one graph
            return self._output_graph(
                attention_layer, h, norm1, attn.linear_qkv.weight, attn.linear_qkv.bias, qk(attn.q_layernorm),
                qk(attn.k_layernorm), p.rope_cos, p.rope_sin, c.num_attention_heads, c.num_query_groups,
                c.kv_channels, gated, *inside, core.causal, attn.linear_proj.weight, norm2, *fc, moe=moe)
        q, k, v, gate = fused(attention_in, self.cuda_graphs)(
            h, norm1, attn.linear_qkv.weight, attn.linear_qkv.bias, qk(attn.q_layernorm), qk(attn.k_layernorm),
            p.rope_cos, p.rope_sin, c.num_attention_heads, c.num_query_groups, c.kv_channels, gated)
        ctx = core.attend(q, k, v, p)
        return self._output_graph(attention_out, ctx, gate, h, attn.linear_proj.weight, norm2, *fc, moe=moe)

    def _gdn(self, h: Tensor, p: VLPackedSeqParams, norm1: Norm, norm2: Norm,
             fc: tuple[Tensor | None, Tensor | None],
             moe: tuple[Any, ...] | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        m = self.self_attention
        mixed, z, g, beta = fused(gdn_in, self.cuda_graphs)(
            h, norm1, m.in_proj_qkv.weight, m.in_proj_z.weight, m.in_proj_b.weight, m.in_proj_a.weight, m.A_log,
            m.dt_bias)
        o = m.recurrence(mixed, g, beta, p, m.conv1d.weight.squeeze(1), m.hk, m.hv)
        return self._output_graph(gdn_out, o, z, m.norm.weight, m.eps, h, m.out_proj.weight, norm2, *fc, moe=moe)
