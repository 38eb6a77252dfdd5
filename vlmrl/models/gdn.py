"""The Gated DeltaNet (linear attention) mixer of Qwen3.5, as a Megatron layer-spec module.

`GatedDeltaNet` sits in the `self_attention` slot of Megatron's TransformerLayer for
`linear_attention` layers. It holds HF's parameter names (`in_proj_qkv`, `in_proj_z`,
`in_proj_b`, `in_proj_a`, `conv1d`, `dt_bias`, `A_log`, `norm`, `out_proj`) and runs on
packed THD micro-batches; the maths is in `vlmrl.models.gated_delta`.

Layout and parallelism
- Tensor parallel: key/value heads are sharded like Megatron's attention heads (rank r holds
  key heads [r*Hk/tp, (r+1)*Hk/tp) and the value heads that read them). The input is
  gathered once (sequence parallel: all-gather; otherwise an identity whose backward sums
  over TP), the four projections are column-parallel, `out_proj` is row-parallel (reduce
  or reduce-scatter). The gated norm's weight is shared by all heads, so its gradient is
  summed over TP (`vlmrl_tp_sum`, see `vlmrl.models.grads`).
- `in_proj_qkv` and `conv1d` rows are held grouped by key head, [q_h, k_h, v of the value
  heads of h] for each key head h (HF's checkpoint keeps [all q; all k; all v]; the adapters
  convert). A contiguous cut of the rows is then a set of whole heads, so TP shards and
  Megatron's distributed checkpoints are the same tensor under any TP size.
- Context parallel: each CP rank holds its zigzag chunks of every sample; the recurrence
  needs whole samples. After the projections an all-to-all trades sequence for heads (each
  CP rank receives every token of 1/cp of its heads), the convolution and the recurrence
  run on whole samples, and a second all-to-all brings the outputs back before `out_proj`.
- `A_log` and the norm weight are float32 whatever the training dtype (as published
  checkpoints store them); the decay is computed in float32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mps
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.mappings import (
    all_to_all,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from torch import Tensor

from . import gated_delta as gd
from .attention import VLPackedSeqParams
from .kernels import pick


class _Holder(torch.nn.Module):
    """A parameter under an HF-like name (`<module>.weight`)."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)


def _tp(param: Tensor, dim: int) -> None:
    tensor_parallel.set_tensor_model_parallel_attributes(param, is_parallel=True, dim=dim, stride=1)


class GatedDeltaNet(MegatronModule):
    def __init__(self, config: TransformerConfig, layer_number: int, *, num_key_heads: int, num_value_heads: int,
                 key_head_dim: int, value_head_dim: int, conv_kernel: int, backend: str = "torch",
                 fused: bool = False, pg_collection: Any = None, **_: Any) -> None:
        super().__init__(config=config)
        if backend not in gd.BACKENDS:
            raise ValueError(f"Gated DeltaNet backend {backend!r} is not one of {gd.BACKENDS}")
        self.layer_number = layer_number
        self.backend = backend
        # hardware.fused_kernels: the decay / beta and the gated norm as Inductor-compiled twins
        # (one kernel each way instead of a dozen elementwise ones over [T, heads, d])
        self._decay_and_beta = pick(gd.decay_and_beta, fused)
        self._gated_rms_norm = pick(gd.gated_rms_norm, fused)
        tp = config.tensor_model_parallel_size
        if num_key_heads % tp or num_value_heads % tp or num_value_heads % num_key_heads:
            raise ValueError(f"Gated DeltaNet heads (key {num_key_heads}, value {num_value_heads}) must divide "
                             f"over tp={tp}, value heads a multiple of key heads")
        self.tp = tp
        self.hk, self.hv = num_key_heads // tp, num_value_heads // tp  # this rank's heads
        self.dk, self.dv, self.ratio = key_head_dim, value_head_dim, num_value_heads // num_key_heads
        self.group = 2 * key_head_dim + self.ratio * value_head_dim  # rows of one key head in in_proj_qkv
        self.eps = config.layernorm_epsilon
        h, dtype = config.hidden_size, config.params_dtype
        std = config.init_method_std

        def normal(*shape: int) -> Tensor:
            return torch.randn(*shape, dtype=dtype) * std

        self.in_proj_qkv = _Holder(normal(self.hk * self.group, h))
        self.in_proj_z = _Holder(normal(self.hv * value_head_dim, h))
        self.in_proj_b = _Holder(normal(self.hv, h))
        self.in_proj_a = _Holder(normal(self.hv, h))
        self.conv1d = _Holder(torch.randn(self.hk * self.group, 1, conv_kernel, dtype=dtype) / conv_kernel ** 0.5)
        self.dt_bias = torch.nn.Parameter(torch.ones(self.hv, dtype=dtype))
        self.A_log = torch.nn.Parameter(torch.empty(self.hv, dtype=torch.float32).uniform_(1e-2, 16).log())
        self.norm = _Holder(torch.ones(value_head_dim, dtype=torch.float32))
        self.out_proj = _Holder(normal(h, self.hv * value_head_dim))
        for p in (self.in_proj_qkv.weight, self.in_proj_z.weight, self.in_proj_b.weight, self.in_proj_a.weight,
                  self.conv1d.weight, self.dt_bias, self.A_log):
            _tp(p, 0)
        _tp(self.out_proj.weight, 1)
        if tp > 1:
            self.norm.weight.vlmrl_tp_sum = True  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ checkpoints
    _TP_AXES = {"in_proj_qkv.weight": 0, "in_proj_z.weight": 0, "in_proj_b.weight": 0, "in_proj_a.weight": 0,
                "conv1d.weight": 0, "dt_bias": 0, "A_log": 0, "out_proj.weight": 1}

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, self._TP_AXES, sharded_offsets)

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None, inference_context: Any = None,
                **_: Any) -> tuple[Tensor, None]:
        if inference_context is not None:
            raise NotImplementedError("Gated DeltaNet layers train only (no Megatron inference context)")
        if not isinstance(packed_seq_params, VLPackedSeqParams) or packed_seq_params.qkv_format != "thd":
            raise ValueError("Gated DeltaNet layers take packed THD micro-batches (VLPackedSeqParams)")
        p = packed_seq_params
        c = self.config
        x = hidden_states
        if c.sequence_parallel and self.tp > 1:
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True)
        elif self.tp > 1:
            x = copy_to_tensor_model_parallel_region(x)
        x = x.squeeze(1)  # [T here, H]
        mixed = F.linear(x, self.in_proj_qkv.weight)
        z = F.linear(x, self.in_proj_z.weight)
        b = F.linear(x, self.in_proj_b.weight)
        a = F.linear(x, self.in_proj_a.weight)

        cp = p.cp_size
        heads_k, heads_v = self.hk, self.hv
        conv_w, a_log, dt_bias = self.conv1d.weight.squeeze(1), self.A_log, self.dt_bias
        if cp > 1:
            if heads_k % cp:
                raise ValueError(f"context parallel needs the key heads of a TP rank ({heads_k}) "
                                 f"to divide over cp={cp}")
            group = p.cp_group if p.cp_group is not None else mps.get_context_parallel_group()
            order = _cp_order(p, x.shape[0], x.device)
            mixed, z, b, a = (_seq_to_heads(t, cp, group, order) for t in (mixed, z, b, a))
            heads_k, heads_v = heads_k // cp, heads_v // cp
            r = p.cp_rank
            conv_w = conv_w[r * heads_k * self.group:(r + 1) * heads_k * self.group]
            a_log, dt_bias = a_log[r * heads_v:(r + 1) * heads_v], dt_bias[r * heads_v:(r + 1) * heads_v]
        g, beta = self._decay_and_beta(a, b, a_log, dt_bias)
        o = self.recurrence(mixed, g, beta, p, conv_w, heads_k, heads_v)
        total = o.shape[0]
        o = self._gated_rms_norm(o, z.view(total, heads_v, self.dv), self.norm.weight, self.eps)
        o = o.reshape(total, heads_v * self.dv)
        if cp > 1:
            o = _heads_to_seq(o, cp, group, order)
        out = F.linear(o, self.out_proj.weight).unsqueeze(1)
        if c.sequence_parallel and self.tp > 1:
            out = reduce_scatter_to_sequence_parallel_region(out)
        elif self.tp > 1:
            out = reduce_from_tensor_model_parallel_region(out)
        return out, None

    def recurrence(self, mixed: Tensor, g: Tensor, beta: Tensor, p: VLPackedSeqParams, conv_w: Tensor,
                   heads_k: int, heads_v: int) -> Tensor:
        """The short convolution and the gated delta rule over whole samples: projected
        mixed [T, heads_k * group] (rows grouped by key head), decay g and write strength
        beta [T, heads_v] -> o [T, heads_v, dv]. The part of the layer that stays eager on
        the compiled path (`vlmrl.models.fused_layer`): fla's kernels or the torch reference."""
        total = mixed.shape[0]
        if p.parents is not None:
            return self._shared_recurrence(mixed, g, beta, p, conv_w, heads_k, heads_v)
        bounds = gd.segment_bounds(p.layout()["whole_offsets"][:-1], total)
        if self.backend == "fla":
            offsets = p._cache.get("gdn_offsets")
            if offsets is None:
                offsets = p._cache["gdn_offsets"] = gd.PackedOffsets(bounds, mixed.device)
            mixed = gd.packed_causal_conv1d(mixed, conv_w, offsets)
        else:
            mixed = gd.causal_conv1d(mixed, conv_w, bounds)
        mixed = mixed.view(total, heads_k, self.group)
        q, k, v = mixed.split([self.dk, self.dk, self.ratio * self.dv], dim=-1)
        v = v.reshape(total, heads_v, self.dv)
        if self.backend == "fla":
            return gd.fla_gated_delta_rule(q, k, v, g, beta, offsets)
        return gd.chunk_gated_delta_rule(q, k, v, g, beta, bounds)

    def _shared_recurrence(self, mixed: Tensor, g: Tensor, beta: Tensor, p: VLPackedSeqParams, conv_w: Tensor,
                           heads_k: int, heads_v: int) -> Tensor:
        """`recurrence` over shared prompts (`PackedSequence.parents`): each reply continues
        its prompt's convolution window and recurrent state (`gated_delta.SharedLayout`), on
        the torch path (fla's kernels are not given per-sample states here)."""
        if self.backend != "torch":
            raise ValueError("shared prompts (trainer.share_prompts) run Gated DeltaNet on the torch path only: "
                             "set hardware.gdn_backend=torch")
        total = mixed.shape[0]
        layout = p._cache.get("gdn_shared")
        if layout is None:
            lay = p.layout()
            layout = p._cache["gdn_shared"] = gd.SharedLayout(
                lay["whole_offsets"], p.host_seq_lens or lay["lens"], p.parents, conv_w.shape[-1], mixed.device)
        mixed = gd.shared_causal_conv1d(mixed, conv_w, layout).view(total, heads_k, self.group)
        q, k, v = mixed.split([self.dk, self.dk, self.ratio * self.dv], dim=-1)
        return gd.shared_gated_delta_rule(q, k, v.reshape(total, heads_v, self.dv), g, beta, layout)


# --------------------------------------------------------------------------- context parallel
def _cp_order(p: VLPackedSeqParams, t_local: int, device: torch.device) -> Tensor:
    """Index into the rank-major gathered tokens [cp * t_local] giving whole-sequence order."""
    key = "gdn_cp_order"
    if key not in p._cache:
        from .attention import _cp_key_index

        p._cache[key] = _cp_key_index(p.layout(), p.cp_size, t_local, device)
    return p._cache[key]


def _seq_to_heads(t: Tensor, cp: int, group: Any, order: Tensor) -> Tensor:
    """[t_local, cp * m] (this rank's tokens, all head blocks) -> [T_whole, m] (every token,
    this rank's head block), in whole-sequence order."""
    t_local, width = t.shape
    blocks = t.view(t_local, cp, width // cp).transpose(0, 1).reshape(cp * t_local, width // cp)
    received = all_to_all(group, blocks.contiguous())  # row block s: rank s's tokens, my heads
    return received.index_select(0, order)


def _heads_to_seq(t: Tensor, cp: int, group: Any, order: Tensor) -> Tensor:
    """Inverse of `_seq_to_heads`: [T_whole, m] -> [t_local, cp * m]."""
    total, m = t.shape
    rank_major = torch.empty_like(t).index_copy(0, order, t)
    received = all_to_all(group, rank_major.contiguous())  # row block s: my tokens, rank s's heads
    t_local = total // cp
    return received.view(cp, t_local, m).transpose(0, 1).reshape(t_local, cp * m)
