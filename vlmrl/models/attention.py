"""Core attention for packed (THD) sequences: M-RoPE, then torch SDPA / flash varlen.

A layer-spec submodule in the `core_attention` slot of Megatron's `SelfAttention`.
Stock megatron-core's local `DotProductAttention` rejects packed sequences and is slow;
this module takes the THD tensors Megatron hands it ([t, heads, head_dim] when
`packed_seq_params.qkv_format == "thd"`) and keeps attention inside each sample:

- M-RoPE: the per-token cos/sin tables ride on `VLPackedSeqParams` (computed once per
  forward from the packed [3, T] positions); Megatron's own rotary path gets no
  embedding, since its THD rope indexes a 1D table per sequence and cannot express
  per-token 3D positions.
- `fused=True` (`hardware.fused_kernels`): the rotary step runs Inductor-compiled.
- backend "sdpa": `varlen_attn` (flash) on CUDA in half precision for more than
  `VARLEN_MIN_SAMPLES` samples, else one causal `scaled_dot_product_attention` call per
  sample (exact in fp32 on CPU; on CUDA padded to a multiple of `CUDNN_LEN_MULTIPLE`
  tokens, so cuDNN meets a bounded set of lengths).
- backend "flash4" (`hardware.lm_attention_backend=flash4`): FlashAttention 4's varlen kernels
  (the `flash-attn-4` package, `flash_attn.cute`; Hopper and Blackwell), one call for all
  samples with the KV groups read natively (no repeated K / V, no per-sample padding), on
  CUDA in half precision without CP or attention dropout; elsewhere the "sdpa" path. The
  kernels are torch custom ops (`vlmrl.models.flash4`): on the fused layer path they run
  inside the attention layer's compiled graph (`graph_attention`), here eagerly.
- backend "eager": explicit masked softmax, for debugging.
- context parallelism: the rank's two zigzag chunks of each sample attend to the keys and
  values of the whole sample, all-gathered over the CP group (backward: reduce), with
  the causal mask taken from global token positions.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from . import compat, flash4
from .kernels import pick
from .mrope import rope_qk
from .reference_check import worst_relative

BACKENDS = ("sdpa", "flash4", "eager")


@dataclass
class VLPackedSeqParams(PackedSeqParams):
    """PackedSeqParams plus the per-token rotary tables of the tokens held on this rank.

    cu_seqlens_q/kv: cumulative real lengths; cu_seqlens_q/kv_padded: sample offsets of the
    whole (un-CP-split) packed sequence. Local offsets are cu_seqlens_*_padded // cp.
    """

    rope_cos: Tensor | None = None  # [T_local, rotary_dim]
    rope_sin: Tensor | None = None
    cp_size: int = 1
    cp_rank: int = 0
    # the sample offsets as host integers (from the CPU-side packing): reading them off the
    # device tensors would stall the host on the GPU once per forward
    host_offsets: list[int] | None = None
    # shared prompts (`vlmrl.models.packing`, `PackedSequence.parents`): each sample's parent,
    # whose real tokens (`host_seq_lens`) it attends to and whose state it starts from; -1:
    # none. None: every sample stands alone
    parents: list[int] | None = None
    host_seq_lens: list[int] | None = None

    def __post_init__(self) -> None:
        self._cache: dict[str, Any] = {}

    @property
    def offsets(self) -> Tensor:
        padded = self.cu_seqlens_q_padded if self.cu_seqlens_q_padded is not None else self.cu_seqlens_q
        return padded

    def layout(self) -> dict[str, Any]:
        """Host-side layout of the samples (computed once per forward, shared by layers)."""
        if "layout" not in self._cache:
            whole = list(self.host_offsets) if self.host_offsets is not None \
                else [int(x) for x in self.offsets.tolist()]
            lens = [b - a for a, b in zip(whole[:-1], whole[1:])]
            self._cache["layout"] = {"whole_offsets": whole, "lens": lens,
                                     "local_offsets": [x // self.cp_size for x in whole]}
        return self._cache["layout"]


class _GatherFromContextParallel(torch.autograd.Function):
    """[t, ...] on each CP rank -> [cp, t, ...] everywhere; backward sums and keeps this rank's."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # type: ignore[override]
        ctx.group = group
        size = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        group = ctx.group
        rank = dist.get_rank(group)
        grad = grad.contiguous()
        if dist.get_backend(group) == "nccl":
            out = torch.empty_like(grad[rank])
            dist.reduce_scatter_tensor(out, grad.flatten(0, 1), group=group)
            return out, None
        dist.all_reduce(grad, group=group)  # gloo has no reduce_scatter
        return grad[rank].clone(), None


def gather_from_context_parallel(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    return _GatherFromContextParallel.apply(x, group)


def _cp_key_index(layout: dict[str, Any], cp: int, t_local: int, device: torch.device) -> Tensor:
    """Index into the flattened gathered [cp * t_local] tokens giving whole-sequence order."""
    idx = []
    for local_off, length in zip(layout["local_offsets"], layout["lens"]):
        chunk = length // (2 * cp)
        for c in range(2 * cp):
            rank, half = (c, 0) if c < cp else (2 * cp - 1 - c, 1)
            start = rank * t_local + local_off + half * chunk
            idx.append(torch.arange(start, start + chunk))
    return torch.cat(idx).to(device)


class PackedSelfAttentionCore(MegatronModule):
    """`core_attention` for THD-packed samples (see the module docstring)."""

    # shared prompts: a prompt and its replies in one masked call (True) or a call per reply
    # (False); None: one call off CUDA, a call per reply on CUDA (`_forward_shared`)
    shared_grouped: bool | None = None

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str = "self", cp_comm_type: str | None = None,
                 softmax_scale: float | None = None, pg_collection: Any = None, backend: str = "sdpa",
                 fused: bool = False, **_: Any) -> None:
        super().__init__(config=config)
        if backend not in BACKENDS:
            raise ValueError(f"attention backend {backend!r} is not one of {BACKENDS}")
        self.backend = backend
        if backend == "flash4":
            flash4.interface()  # fails at build, naming the package, rather than at the first step
        self._rope_qk = pick(rope_qk, fused)
        self.layer_number = layer_number
        self.causal = attn_mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim ** -0.5
        self.dropout_p = config.attention_dropout
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None

    # ------------------------------------------------------------------ kernels
    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        """q [Lq, h, d], k/v [Lk, g, d] -> [Lq, h, d]."""
        dropout = self.dropout_p if self.training else 0.0
        qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        if self.backend == "eager":
            rep = qh.shape[1] // kh.shape[1]
            kh, vh = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)
            scores = (qh @ kh.transpose(-1, -2)).float() * self.softmax_scale
            if causal:
                mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).tril()
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(vh.dtype)
            if dropout:
                probs = F.dropout(probs, dropout)
            out = probs @ vh
        else:
            gqa = kh.shape[1] != qh.shape[1]
            if gqa and qh.is_cuda:
                # give each query head its KV head: SDPA then dispatches to cuDNN's Hopper
                # flash kernels, which GQA inputs do not reach
                rep = qh.shape[1] // kh.shape[1]
                kh, vh, gqa = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1), False
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, dropout_p=dropout,
                                                 is_causal=causal and mask is None, scale=self.softmax_scale,
                                                 enable_gqa=gqa)
        return out.squeeze(0).transpose(0, 1)

    def _sample(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attention within one packed sample [n, heads, d]. On CUDA a causal sample is padded
        at its end to a multiple of `CUDNN_LEN_MULTIPLE` tokens: cuDNN builds an execution plan
        for every new sequence length (about 28 ms of host time per layer call, measured in
        the trainer on an H200), and RL micro-batches bring new lengths every step. Padded
        keys come after every real query, so the causal mask hides them; padded query rows
        are dropped, and their zero output gradient gives the padding no gradient."""
        n = q.shape[0]
        padded = cudnn_padded_len(n) if q.is_cuda and self.causal and self.backend != "eager" else n
        if padded == n:
            return self._sdpa(q, k, v, None, self.causal)
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, padded - n)) for x in (q, k, v))
        return self._sdpa(q, k, v, None, True)[:n]

    def _varlen(self, q: Tensor, k: Tensor, v: Tensor, params: VLPackedSeqParams) -> Tensor | None:
        """Flash varlen attention (CUDA, half precision, no CP); None when unavailable."""
        if self.backend == "eager" or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
            return None
        if self.dropout_p and self.training:
            return None
        if self.backend == "flash4":
            return self._flash4_varlen(q, k, v, params)
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            return None
        lens = params.layout()["lens"]
        if len(lens) <= VARLEN_MIN_SAMPLES:  # few long samples: per-sample SDPA (cuDNN) is faster
            return None
        cu = params.offsets.to(device=q.device, dtype=torch.int32)
        max_len = max(lens)
        kwargs: dict[str, Any] = {}
        if k.shape[1] != q.shape[1]:
            if _varlen_takes_gqa(varlen_attn):
                kwargs["enable_gqa"] = True
            else:  # older torch (2.11): give every query head its own copy of its KV head
                rep = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=self.softmax_scale,
                           window_size=(-1, 0) if self.causal else (-1, -1), **kwargs)

    def _flash4_varlen(self, q: Tensor, k: Tensor, v: Tensor, params: VLPackedSeqParams) -> Tensor:
        """FlashAttention 4 over every sample of q [T, h, d], k/v [T, g, d] in one call, the KV
        groups as they are (eagerly; inside the layer graph see `graph_attention`)."""
        cu, max_len = self._flash4_layout(params, q.shape[0], q.device)
        return flash4.flash4_attention(q, k, v, cu, max_len, self.softmax_scale, self.causal)

    def graph_attention(self, p: PackedSeqParams, h: Tensor) -> tuple[Tensor, int] | None:
        """(sample offsets, max_len) for attention inside a compiled layer graph
        (`vlmrl.models.fused_layer.attention_layer`), or None where this layer attends outside
        one: a backend other than flash4, CPU or float32, CP, attention dropout in training,
        or a softmax scale other than 1/sqrt(head_dim) (the graph derives it from the head
        size), or shared prompts (`_forward_shared`)."""
        if (self.backend != "flash4" or not h.is_cuda or h.dtype not in (torch.float16, torch.bfloat16)
                or not isinstance(p, VLPackedSeqParams) or p.cp_size != 1 or p.parents is not None
                or (self.dropout_p and self.training)
                or not math.isclose(self.softmax_scale, self.config.kv_channels ** -0.5)):
            return None
        return self._flash4_layout(p, h.shape[0] * h.shape[1], h.device)

    @staticmethod
    def _flash4_layout(p: VLPackedSeqParams, tokens: int, device: torch.device) -> tuple[Tensor, int]:
        """The packed layout as FlashAttention 4 takes it, in `flash4.graph_layout`'s bounded set
        (a recorded graph is keyed on it): int32 offsets on the device (through pinned memory,
        from the host layout) and max_len; made once per forward and shared by the layers."""
        if "flash4" not in p._cache:
            whole = p.layout()["whole_offsets"]
            if whole[-1] != tokens:
                raise ValueError(f"the packed layout covers {whole[-1]} tokens, the attention's input {tokens}")
            offsets, max_len = flash4.graph_layout(whole)
            p._cache["flash4"] = (compat.to_device(torch.tensor(offsets, dtype=torch.int32), device), max_len)
        return p._cache["flash4"]

    # ------------------------------------------------------------------ forward
    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None = None,
                attn_mask_type: AttnMaskType | None = None, attention_bias: Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> Tensor:
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported")
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return self._forward_batched(query, key, value)
        p = packed_seq_params
        if isinstance(p, VLPackedSeqParams) and p.rope_cos is not None:
            query, key = self._rope_qk(query, key, p.rope_cos, p.rope_sin)
        return self.attend(query, key, value, p)

    def attend(self, query: Tensor, key: Tensor, value: Tensor, p: PackedSeqParams) -> Tensor:
        """Attention within each packed sample of rotated q [T, h, d], k/v [T, g, d] -> [T, h*d]."""
        cp = p.cp_size if isinstance(p, VLPackedSeqParams) else 1
        if cp > 1:
            out = self._forward_cp(query, key, value, p)
        elif isinstance(p, VLPackedSeqParams) and p.parents is not None:
            out = self._forward_shared(query, key, value, p)
        else:
            out = self._varlen(query, key, value, p) if isinstance(p, VLPackedSeqParams) else None
            if out is None:
                lay = p.layout() if isinstance(p, VLPackedSeqParams) else _plain_layout(p)
                offs, lens = lay["local_offsets"], lay["lens"]
                outs = [self._sample(q, k, v) for q, k, v in zip(
                    *(split_samples(x, offs, lens) for x in (query, key, value)))]
                out = torch.cat(outs) if len(outs) > 1 else outs[0]
        return out.reshape(out.shape[0], -1)

    def _forward_shared(self, q: Tensor, k: Tensor, v: Tensor, p: VLPackedSeqParams) -> Tensor:
        """Shared prompts: a sample with a parent attends to the parent's real tokens and,
        causally, to its own; one without attends within itself (`_sample`). On CPU a prompt
        and its replies are one SDPA call under a block mask (the call, not the arithmetic,
        costs there); elsewhere each reply is a call over the prompt's keys and its own."""
        if p.cp_size != 1:
            raise ValueError("shared prompts do not run under context parallelism")
        lay = p.layout()
        offs, lens = lay["local_offsets"], lay["lens"]
        real = p.host_seq_lens if p.host_seq_lens is not None else lens
        qs, ks, vs = (split_samples(x, offs, lens) for x in (q, k, v))
        kids: dict[int, list[int]] = {}
        for j, parent in enumerate(p.parents):
            if parent >= 0:
                kids.setdefault(parent, []).append(j)
        outs: list[Tensor | None] = [None] * len(lens)
        grouped = not q.is_cuda if self.shared_grouped is None else self.shared_grouped
        for j, parent in enumerate(p.parents):
            if parent >= 0:
                continue
            if j not in kids:
                outs[j] = self._sample(qs[j], ks[j], vs[j])
                continue
            members = [j, *kids[j]]
            if grouped:
                key = ("shared_mask", j, self.causal)
                if key not in p._cache:
                    p._cache[key] = shared_prompt_mask(real[j], [lens[c] for c in kids[j]], self.causal, q.device)
                out = self._sdpa(*(torch.cat([x[m] for m in members]) for x in (qs, ks, vs)), p._cache[key], False)
                for m, part in zip(members, out.split([lens[m] for m in members])):
                    outs[m] = part
                continue
            outs[j] = self._sample(qs[j], ks[j], vs[j])
            pk, pv = ks[j][:real[j]], vs[j][:real[j]]
            for c in kids[j]:
                n = lens[c]
                mask = (torch.ones(n, real[j] + n, dtype=torch.bool, device=q.device).tril(real[j])
                        if self.causal else None)
                outs[c] = self._sdpa(qs[c], torch.cat([pk, ks[c]]), torch.cat([pv, vs[c]]), mask, False)
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _forward_cp(self, q: Tensor, k: Tensor, v: Tensor, p: VLPackedSeqParams) -> Tensor:
        group = p.cp_group if p.cp_group is not None else self.cp_group
        if group is None:
            from megatron.core import parallel_state

            group = parallel_state.get_context_parallel_group()
        cp, rank = p.cp_size, p.cp_rank
        lay = p.layout()
        t_local = q.shape[0]
        kv = gather_from_context_parallel(torch.stack([k, v]), group)  # [cp, 2, t, g, d]
        kv = kv.transpose(0, 1).flatten(1, 2)  # [2, cp*t, g, d]
        if "cp_key_index" not in p._cache:
            p._cache["cp_key_index"] = _cp_key_index(lay, cp, t_local, q.device)
        kv = kv.index_select(1, p._cache["cp_key_index"])  # whole-sequence order
        k_all, v_all = kv[0], kv[1]
        outs = []
        for whole_off, local_off, length in zip(lay["whole_offsets"], lay["local_offsets"], lay["lens"]):
            chunk = length // (2 * cp)
            qpos = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (rank, 2 * cp - 1 - rank)])
            qpos = qpos.to(q.device)
            mask = None
            if self.causal:
                mask = torch.arange(length, device=q.device).view(1, -1) <= qpos.view(-1, 1)
            n_local = 2 * chunk
            outs.append(self._sdpa(q[local_off:local_off + n_local], k_all[whole_off:whole_off + length],
                                   v_all[whole_off:whole_off + length], mask, False))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _forward_batched(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """[s, b, h, d] tensors, one sequence per batch row (no rope: positions unknown here)."""
        outs = [self._sdpa(q[:, b], k[:, b], v[:, b], None, self.causal) for b in range(q.shape[1])]
        out = torch.stack(outs, dim=1)
        return out.reshape(out.shape[0], out.shape[1], -1)


# Up to this many samples in a packed sequence, one SDPA call per sample (cuDNN's Hopper
# kernels) beats torch's varlen flash kernel (measured on an H200: one 4096-token sample
# fwd+bwd 13 ms with cuDNN vs 25 ms varlen, bench/results/train_gpu.md).
VARLEN_MIN_SAMPLES = 4
# per-sample SDPA on CUDA pads a sample to a multiple of this many tokens: at most
# max_tokens / 128 cuDNN plans per head shape (built once each) instead of one per length
CUDNN_LEN_MULTIPLE = 128


def cudnn_padded_len(n: int, multiple: int = CUDNN_LEN_MULTIPLE) -> int:
    """`n` tokens rounded up to a multiple of `multiple`."""
    return -(-n // multiple) * multiple


@functools.cache
def _varlen_takes_gqa(fn: Any) -> bool:
    return "enable_gqa" in inspect.signature(fn).parameters


def split_samples(x: Tensor, offsets: list[int], lens: list[int]) -> list[Tensor]:
    """The samples x[a:a + n] (ascending, not overlapping) as views from one `torch.split`.

    Its backward is one concatenation. A slice per sample would give each sample's gradient
    a zero-filled tensor the size of x, then add them all up: for six layers' attention over
    64 samples on one CPU thread, 0.9 s against 0.32 s through the split."""
    sizes: list[int] = []
    keep: list[int] = []
    pos = 0
    for a, n in zip(offsets, lens):
        if a < pos:
            raise ValueError(f"samples overlap or are out of order at offset {a} (previous end {pos})")
        if a > pos:
            sizes.append(a - pos)
        keep.append(len(sizes))
        sizes.append(n)
        pos = a + n
    if pos > x.shape[0]:
        raise ValueError(f"samples end at {pos}, past the {x.shape[0]} tokens given")
    if pos < x.shape[0]:
        sizes.append(x.shape[0] - pos)
    parts = x.split(sizes)
    return [parts[i] for i in keep]


def shared_prompt_mask(prompt: int, replies: list[int], causal: bool, device: torch.device) -> Tensor:
    """[L, L] bool, L = prompt + sum(replies): which keys each query of a prompt followed by its
    replies may read. The prompt reads itself (causally), each reply the prompt and itself
    (causally), never another reply."""
    total = prompt + sum(replies)
    mask = torch.zeros(total, total, dtype=torch.bool)
    mask[:, :prompt] = True
    blocks = [prompt, *replies]
    at = 0
    for n in blocks:
        mask[at:at + n, at:at + n] = True
        at += n
    if causal:
        mask[:prompt, :prompt].tril_()
        at = prompt
        for n in replies:
            mask[at:at + n, at:at + n].tril_()
            at += n
    return mask.to(device)


def _plain_layout(p: PackedSeqParams) -> dict[str, Any]:
    cu = p.cu_seqlens_q_padded if p.cu_seqlens_q_padded is not None else p.cu_seqlens_q
    whole = [int(x) for x in cu.tolist()]
    lens = [b - a for a, b in zip(whole[:-1], whole[1:])]
    return {"whole_offsets": whole, "lens": lens, "local_offsets": whole}



class GroupedSelfAttention(SelfAttention):
    """megatron-core's SelfAttention, with the output gate cut like the queries when tensor
    parallelism is wider than the KV groups.

    With tp > num_query_groups, megatron-core 0.16 gives each rank 1/tp of the fused
    [queries, gates, k, v] rows, all-gathers the projections, and keeps its group's K/V and
    its share of the group's query heads, but leaves the gate heads of the whole group: the
    output gate would not match the rank's attention output. The gate heads are cut the same
    way as the query heads; with tp <= num_query_groups nothing changes."""

    def get_query_key_value_tensors(self, hidden_states: Tensor, key_value_states: Tensor | None = None,
                                    output_gate: bool = False, split_qkv: bool = True) -> Any:
        out = super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate=output_gate,
                                                  split_qkv=split_qkv)
        groups = self.config.num_query_groups
        if not (output_gate and split_qkv and groups < self.world_size):
            return out
        query, key, value, gate = out
        if gate.shape[2] != query.shape[2]:
            ranks_per_group = self.world_size // groups
            idx = dist.get_rank(self.pg_collection.tp) % ranks_per_group
            size = gate.shape[2] // ranks_per_group
            gate = gate[:, :, idx * size:(idx + 1) * size]
        return query, key, value, gate


class AttentionBackendError(RuntimeError):
    """A fast attention backend disagrees with the explicit-softmax reference."""


# tolerance of the startup check, relative to the largest reference magnitude: one flash
# kernel rounds P and the output to `dtype` once (bf16: 8 significant bits)
ATTENTION_CHECK_TOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 2e-3}
ATTENTION_CHECK_LENS = (37, 300, 700)
_ATTENTION_CHECKED: dict[tuple, float] = {}


def check_attention_backend(backend: str, *, heads: int, groups: int, head_dim: int, device: torch.device,
                            dtype: torch.dtype, lens: tuple[int, ...] = ATTENTION_CHECK_LENS,
                            seed: int = 0) -> float:
    """Run `backend`'s packed causal attention at these head sizes in `dtype`, forward and
    backward, on a few packed samples, against the explicit masked softmax ("eager") in
    float32 on the same values; raise AttentionBackendError naming what disagrees, else return
    the worst relative difference (to the largest reference magnitude). Once per process and
    shape (cached): the trainer runs it before the first step, so a kernel build that is wrong
    for this GPU or head size stops the run instead of training on it."""
    key = (backend, heads, groups, head_dim, str(device), dtype, tuple(lens))
    if key in _ATTENTION_CHECKED:
        return _ATTENTION_CHECKED[key]
    cfg = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                            num_query_groups=groups, kv_channels=head_dim, attention_dropout=0.0)
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    total = offsets[-1]
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(total, h, head_dim, generator=gen).to(dtype) for h in (heads, groups, groups)]
    grad_out = torch.randn(total, heads * head_dim, generator=gen).to(dtype)

    def run(name: str, run_dtype: torch.dtype) -> list[Tensor]:
        core = PackedSelfAttentionCore(cfg, 1, AttnMaskType.causal, backend=name)
        cu = torch.tensor(offsets, dtype=torch.int32, device=device)
        params = VLPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, host_offsets=offsets)
        q, k, v = (x.to(device, run_dtype).requires_grad_(True) for x in values)
        out = core.attend(q, k, v, params)
        grads = torch.autograd.grad(out, (q, k, v), grad_out.to(device, run_dtype))
        return [t.detach().float() for t in (out, *grads)]

    want, got = run("eager", torch.float32), run(backend, dtype)
    tol = ATTENTION_CHECK_TOL.get(dtype, 2e-2)
    worst, bad = worst_relative(zip(("output", "grad of q", "grad of k", "grad of v"), got, want), tol)
    if bad is not None:
        raise AttentionBackendError(
            f"attention backend {backend!r} disagrees with the explicit softmax: {bad[0]} differs by "
            f"{bad[1]:.3g} relative (tolerance {tol:g}; {heads} heads, {groups} KV groups of {head_dim}, "
            f"{dtype}, {device}); refusing to train on it. Set hardware.lm_attention_backend=sdpa")
    _ATTENTION_CHECKED[key] = worst
    return worst
