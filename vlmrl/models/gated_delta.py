"""Gated DeltaNet maths on packed (THD) sequences: pure tensor functions and the GPU kernels.

A Gated DeltaNet head keeps a recurrent state S (key_dim x value_dim). For token t, with
l2-normalised query/key, query scaled by key_dim^-0.5, decay g_t <= 0 (log space) and
write strength beta_t in (0, 1):

    S'  = exp(g_t) * S
    S   = S' + beta_t * k_t (v_t - S'^T k_t)^T       (the delta rule)
    o_t = S^T q_t

Packed sequences hold several samples back to back. Both the short causal convolution that
precedes the recurrence and the recurrence itself restart at every sample boundary
(`offsets`, the sample starts in the packed tensor; a stretch after the last offset is a
segment of its own), so nothing leaks from one sample into the next.

Backends (`hardware.gdn_backend`):
- "torch": chunked form of the recurrence in float32 (`chunk_gated_delta_rule`), the
  reference, runs everywhere (CPU ranks, CPU tests, the GPU fast-path check);
- "fla": flash-linear-attention's `chunk_gated_delta_rule` (on Hopper, fla >= 0.6
  dispatches to FlashQLA's TileLang kernels when installed) and the varlen short
  convolution as vlmrl's Triton kernels (`vlmrl.models.short_conv`; fla's `causal_conv1d`
  where those do not take the tensors). Before the first use in a process,
  `check_fast_path` compares the forward and backward of both with the torch path on a
  small packed input and refuses to train on a mismatch.

The chunked form (chunk of C tokens, state S at the chunk start, gamma_i the cumulative
log decay inside the chunk): the per-token corrections u_j = beta_j (v_j - S_j'^T k_j)
solve a unit lower-triangular system (I + A) U = beta*V - beta*exp(gamma)*K S with
A_jl = beta_j exp(gamma_j - gamma_l) k_j.k_l (l < j), so U = T(beta V) - T(beta exp(gamma) K) S;
the outputs are O = exp(gamma) Q S + (M * Q K^T) U with M_ij = exp(gamma_i - gamma_j), j <= i,
and the next state is exp(gamma_C) S + (exp(gamma_C - gamma) K)^T U.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config.memory import GDN_MAX_CHUNK
from ..config.memory import gdn_chunk_size as chunk_size
from .compat import to_device
from .kernels import pick
from .reference_check import worst_relative

BACKENDS = ("torch", "fla")
CHUNK = GDN_MAX_CHUNK


# --------------------------------------------------------------------------- segments
def segment_bounds(offsets: Sequence[int], total: int) -> list[tuple[int, int]]:
    """[(start, end)] of every non-empty segment: between consecutive offsets, and a tail
    after the last offset (e.g. trailing padding) as a segment of its own."""
    cuts = [int(x) for x in offsets]
    if not cuts or cuts[0] != 0:
        cuts = [0, *cuts]
    if cuts[-1] < total:
        cuts.append(total)
    return [(a, min(b, total)) for a, b in zip(cuts[:-1], cuts[1:]) if min(b, total) > a]


def segment_ids(bounds: Sequence[tuple[int, int]], total: int, device: torch.device | None = None) -> Tensor:
    """[T] long: the segment index of each token."""
    ids = torch.empty(total, dtype=torch.long)
    for i, (a, b) in enumerate(bounds):
        ids[a:b] = i
    return ids.to(device) if device is not None else ids


# --------------------------------------------------------------------------- short convolution
def causal_conv1d(x: Tensor, weight: Tensor, bounds: Sequence[tuple[int, int]], activation: bool = True) -> Tensor:
    """Depthwise causal convolution of packed x [T, C] with weight [C, K], restarting at
    each segment (every segment sees zeros before its first token), then SiLU.

    out[t, c] = sum_j weight[c, j] * x[t - (K - 1) + j, c], terms before the segment start dropped.
    """
    t_len, _ = x.shape
    k = weight.shape[-1]
    w = weight.to(x.dtype)
    start = torch.empty(t_len, dtype=torch.long)
    for a, b in bounds:
        start[a:b] = a
    pos = torch.arange(t_len)
    start, pos = start.to(x.device), pos.to(x.device)
    padded = F.pad(x, (0, 0, k - 1, 0))
    out = None
    for j in range(k):
        shift = k - 1 - j  # x[t - shift]
        term = padded[j:j + t_len] * w[:, j]
        if shift:
            term = term * (pos - shift >= start).unsqueeze(-1).to(x.dtype)
        out = term if out is None else out + term
    return F.silu(out) if activation else out


# --------------------------------------------------------------------------- recurrence
def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _segment_index(bounds: Sequence[tuple[int, int]], length: int, total: int,
                   device: torch.device) -> tuple[Tensor, Tensor]:
    """Index maps between packed tokens [T] and zero-padded segments [n, length]:
    `gather` [n * length] gives, per padded slot, its token (or `total`, a zero row) and
    `scatter` [T] gives, per token, its padded slot."""
    gather = torch.full((len(bounds), length), total, dtype=torch.long)
    scatter = torch.empty(total, dtype=torch.long)
    for i, (a, b) in enumerate(bounds):
        gather[i, : b - a] = torch.arange(a, b)
        scatter[a:b] = torch.arange(i * length, i * length + b - a)
    return gather.view(-1).to(device), scatter.to(device)


def _to_segments(x: Tensor, gather: Tensor, n: int, length: int) -> Tensor:
    """[T, ...] -> [n, length, ...], zero padded at the end of each segment (one gather)."""
    padded = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])
    return padded.index_select(0, gather).view(n, length, *x.shape[1:])


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                           bounds: Sequence[tuple[int, int]], *, chunk: int | None = None,
                           initial_state: Tensor | None = None,
                           output_final_state: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """The gated delta rule over packed segments, chunked, in float32.

    q, k [T, Hk, dk]; v [T, Hv, dv] (Hv a multiple of Hk: value head j reads key head
    j // (Hv / Hk)); g, beta [T, Hv]. q and k are l2-normalised here and q is scaled by
    dk^-0.5. Returns o [T, Hv, dv] in v's dtype. `chunk`: tokens per chunk; None picks
    16..64 from the longest segment (any size gives the same result up to rounding).
    `initial_state` [n_segments, Hv, dk, dv] (float32): each segment's state before its
    first token (zeros where None); with `output_final_state` also returns each segment's
    state after its last token, [n_segments, Hv, dk, dv] float32 (the zero padding that
    evens out the segments leaves a state as it is: no decay, no write).
    """
    out_dtype = v.dtype
    t_len, hk, dk = k.shape
    hv, dv = v.shape[1], v.shape[2]
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk})")
    r = hv // hk
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    q = l2norm(q) * dk ** -0.5
    k = l2norm(k)
    longest = max(b - a for a, b in bounds)
    if chunk is None:
        chunk = chunk_size(longest)
    length = -(-longest // chunk) * chunk
    n_seg, n_chunks = len(bounds), length // chunk
    gather, scatter = _segment_index(bounds, length, t_len, q.device)

    # [T, heads, d] -> [B, Hk, heads per key head, n, C, d]: value heads grouped under their key head
    def seg(x: Tensor, heads_per_key: int) -> Tensor:
        y = _to_segments(x.reshape(t_len, hk, heads_per_key, -1), gather, n_seg, length)
        return y.permute(0, 2, 3, 1, 4).reshape(n_seg, hk, heads_per_key, n_chunks, chunk, y.shape[-1])

    qs, ks = seg(q, 1), seg(k, 1)
    vs = seg(v, r)
    gs, bs = seg(g, r).squeeze(-1), seg(beta, r).squeeze(-1)  # [B, Hk, r, n, C]
    gamma = gs.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    diff = gamma.unsqueeze(-1) - gamma.unsqueeze(-2)  # [.., i, j] = gamma_i - gamma_j
    decay = diff.masked_fill(~lower, float("-inf")).exp()  # M (j <= i), 0 above the diagonal
    # A_jl = beta_j exp(gamma_j - gamma_l) k_j.k_l; the solve reads its strict lower triangle
    # only (unit diagonal), so the diagonal and the zeros above it need no masking
    system = (ks @ ks.transpose(-1, -2)) * decay * bs.unsqueeze(-1)
    rhs = torch.cat([vs * bs.unsqueeze(-1), ks * (bs * gamma.exp()).unsqueeze(-1)], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u_base, w = solved.split([dv, dk], dim=-1)
    attn = (qs @ ks.transpose(-1, -2)) * decay
    q_decayed = qs * gamma.exp().unsqueeze(-1)
    k_tail = ks * (gamma[..., -1:] - gamma).exp().unsqueeze(-1)
    chunk_decay = gamma[..., -1].exp()  # [B, Hk, r, n]
    if initial_state is None:
        state = q.new_zeros(n_seg, hk, r, dk, dv)
    else:
        if tuple(initial_state.shape) != (n_seg, hv, dk, dv):
            raise ValueError(f"initial_state shaped {list(initial_state.shape)}, want [{n_seg}, {hv}, {dk}, {dv}]")
        state = initial_state.float().reshape(n_seg, hk, r, dk, dv)
    outs = []
    for i in range(n_chunks):
        u = u_base[..., i, :, :] - w[..., i, :, :] @ state
        outs.append(q_decayed[..., i, :, :] @ state + attn[..., i, :, :] @ u)
        state = state * chunk_decay[..., i, None, None] + k_tail[..., i, :, :].transpose(-1, -2) @ u
    o = torch.stack(outs, dim=3).reshape(n_seg, hk * r, length, dv).transpose(1, 2)  # [B, L, Hv, dv]
    o = o.reshape(n_seg * length, hv, dv).index_select(0, scatter).to(out_dtype)
    return (o, state.reshape(n_seg, hv, dk, dv)) if output_final_state else o


def recurrent_with_states(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                          bounds: Sequence[tuple[int, int]], initial_state: Tensor | None) -> tuple[Tensor, Tensor]:
    """`recurrent_gated_delta_rule` from given states, with each segment's final state: the
    definition the chunked form's states are tested against."""
    hk, hv = k.shape[1], v.shape[1]
    q = l2norm(q.repeat_interleave(hv // hk, dim=1).float()) * q.shape[-1] ** -0.5
    k = l2norm(k.repeat_interleave(hv // hk, dim=1).float())
    v, g, beta = v.float(), g.float(), beta.float()
    out, finals = torch.zeros_like(v), []
    for i, (a, b) in enumerate(bounds):
        state = v.new_zeros(hv, k.shape[-1], v.shape[-1]) if initial_state is None else initial_state[i].float()
        for t in range(a, b):
            state = state * g[t].exp()[:, None, None]
            pred = (state * k[t].unsqueeze(-1)).sum(-2)
            state = state + k[t].unsqueeze(-1) * ((v[t] - pred) * beta[t].unsqueeze(-1)).unsqueeze(-2)
            out[t] = (state * q[t].unsqueeze(-1)).sum(-2)
        finals.append(state)
    return out, torch.stack(finals)


# --------------------------------------------------------------------------- shared prompts
class SharedLayout:
    """Index maps of a shared-prompt layout (`PackedSequence.parents`) for a Gated DeltaNet
    layer, built once per forward from the host layout and shared by the layers:

    - the short convolution runs over `conv_index` (every segment's rows; a segment with a
      parent preceded by its parent's last K-1 real rows, so it continues the parent's
      window) in `conv_bounds`; `conv_keep` picks the packed rows back out of its output;
    - the recurrence runs twice: over the roots' rows (`root_index`, `root_bounds`, each
      root's final state kept), then over the children's (`child_index`, `child_bounds`),
      each child from its parent's state (`child_parent`: the parent's place among the
      roots); `order` puts the two outputs back in packed order."""

    def __init__(self, offsets: Sequence[int], real_lens: Sequence[int], parents: Sequence[int], conv_k: int,
                 device: torch.device) -> None:
        offsets = [int(x) for x in offsets]
        lens = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
        if len(parents) != len(lens) or len(real_lens) != len(lens):
            raise ValueError(f"{len(parents)} parents and {len(real_lens)} lengths for {len(lens)} segments")
        conv, conv_bounds, keep = [], [], []
        roots, root_bounds, root_pos = [], [], {}
        children, child_bounds, child_parent = [], [], []
        at = 0
        for j, (a, n) in enumerate(zip(offsets[:-1], lens)):
            p = int(parents[j])
            rows = list(range(a, a + n))
            if p < 0:
                tail = []
                root_pos[j] = len(root_bounds)
                root_bounds.append((len(roots), len(roots) + n))
                roots.extend(rows)
            else:
                if p not in root_pos:
                    raise ValueError(f"segment {j}: its parent {p} is not a segment before it without a parent")
                pa, pn = offsets[p], int(real_lens[p])
                tail = list(range(pa + max(0, pn - (conv_k - 1)), pa + pn))
                child_bounds.append((len(children), len(children) + n))
                child_parent.append(root_pos[p])
                children.extend(rows)
            conv_bounds.append((at, at + len(tail) + n))
            keep.extend(range(at + len(tail), at + len(tail) + n))
            conv.extend(tail + rows)
            at += len(tail) + n
        self.conv_bounds, self.root_bounds, self.child_bounds = conv_bounds, root_bounds, child_bounds
        as_index = functools.partial(torch.tensor, dtype=torch.long)
        self.conv_index = to_device(as_index(conv), device)
        self.conv_keep = to_device(as_index(keep), device)
        self.root_index = to_device(as_index(roots), device)
        self.child_index = to_device(as_index(children), device)
        self.child_parent = to_device(as_index(child_parent), device)
        inverse = torch.empty(len(roots) + len(children), dtype=torch.long)
        inverse[as_index(roots + children)] = torch.arange(len(roots) + len(children))
        self.order = to_device(inverse, device)


def shared_causal_conv1d(x: Tensor, weight: Tensor, layout: SharedLayout) -> Tensor:
    """`causal_conv1d` (+ SiLU) of packed x [T, C] over a shared-prompt layout: a child's
    first tokens see its parent's last ones, as they would right after them."""
    out = causal_conv1d(x.index_select(0, layout.conv_index), weight, layout.conv_bounds)
    return out.index_select(0, layout.conv_keep)


def shared_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                            layout: SharedLayout) -> Tensor:
    """`chunk_gated_delta_rule` over a shared-prompt layout: the roots from zero states, then
    each child from its parent's final state (the gradient of every child reaches its
    parent's tokens through that state)."""
    def rows(x: Tensor, index: Tensor) -> Tensor:
        return x.index_select(0, index)

    parts = (q, k, v, g, beta)
    o_root, finals = chunk_gated_delta_rule(*(rows(x, layout.root_index) for x in parts), layout.root_bounds,
                                            output_final_state=True)
    if not layout.child_bounds:
        return o_root.index_select(0, layout.order)
    o_child = chunk_gated_delta_rule(*(rows(x, layout.child_index) for x in parts), layout.child_bounds,
                                     initial_state=finals.index_select(0, layout.child_parent))
    return torch.cat([o_root, o_child]).index_select(0, layout.order)


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               bounds: Sequence[tuple[int, int]]) -> Tensor:
    """The same recurrence token by token (float32) from zero states: the definition, for tests."""
    return recurrent_with_states(q, k, v, g, beta, bounds, None)[0]


# --------------------------------------------------------------------------- gated norm
def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of x [..., d] (float32 statistics, plain weight) times SiLU(gate), in x's dtype.

    The normalised input is cast back to x's dtype before the weight (the weight stays in
    its own dtype: float32 in published checkpoints) and the gate is applied in float32.
    """
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(gate.float())).to(dtype)


def decay_and_beta(a: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """g = -exp(A_log) * softplus(a + dt_bias) (float32) and beta = sigmoid(b)."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.sigmoid()


# --------------------------------------------------------------------------- GPU kernels
class FastPathError(RuntimeError):
    """The fla kernels disagree with the torch reference: training on them is refused."""


@functools.cache
def _fla() -> tuple:
    try:
        from fla.modules.convolution import causal_conv1d as fla_conv
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule
    except ImportError as e:
        raise ImportError("hardware.gdn_backend=fla needs flash-linear-attention (pip install "
                          "'vlmrl[gpu]'); use hardware.gdn_backend=torch without it") from e
    return fla_conv, fla_rule


@functools.cache
def _flash_qla_backend() -> Any:
    """fla's FlashQLA backend object where fla would dispatch to it (installed, not switched
    off by FLA_FLASH_QLA=0 or FLA_DISABLE_BACKEND_DISPATCH=1), else None. Each call is still
    put to the backend's own verifier (device, dtype, head sizes)."""
    try:
        import flash_qla  # noqa: F401
        from fla.ops.gated_delta_rule.backends.flash_qla import FlashQLABackend
    except ImportError:
        return None
    if os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1" or not FlashQLABackend.can_use():
        return None
    return FlashQLABackend()


# fla's varlen causal_conv1d tiles each sample into chunks of this many tokens (its default)
FLA_CONV_CHUNK = 64


def chunk_indices(lengths: Sequence[int], chunk: int) -> Tensor:
    """[n_chunks, 2] long: (sample, chunk within the sample) of every chunk of `chunk` tokens,
    samples of `lengths` in order (an empty sample has none): the varlen tiling fla's and
    FlashQLA's kernels take, built on the host."""
    rows = [(i, j) for i, n in enumerate(lengths) for j in range(-(-int(n) // chunk))]
    return torch.tensor(rows, dtype=torch.long).view(-1, 2)


class PackedOffsets:
    """The sample offsets of one packed layout in the forms the fla / FlashQLA kernels take,
    built from the host offsets once per layout and shared by every Gated DeltaNet layer:
    the device offsets (`cu`), their host copy (`cu_host`), fla's convolution chunk tiling
    and FlashQLA's intra-card split of long samples.

    Left to themselves the libraries derive the last two by reading the offsets back from
    the GPU (FlashQLA's split decision through fla, whose FlashQLA backend drops the host
    offsets) or by a blocking copy from pageable memory (fla's chunk tiling): a host sync
    each, once per step, which drains the GPU's queue so that the host cannot run ahead
    into the next forward. Built here, every copy goes up from pinned memory without
    blocking and nothing is read back."""

    def __init__(self, bounds: Sequence[tuple[int, int]], device: torch.device, force_split: bool = False) -> None:
        self._device = device
        self.force_split = force_split  # FlashQLA splits long samples even where it would not (the check)
        self.cu_host = cu_seqlens_of(bounds, torch.device("cpu"))
        self.cu = to_device(self.cu_host, device)
        self._conv: Tensor | None = None
        self._qla: dict[tuple[int, bool], Any] = {}

    def conv_chunks(self) -> Tensor:
        """fla's `prepare_chunk_indices(cu, FLA_CONV_CHUNK)`, on the device."""
        if self._conv is None:
            self._conv = to_device(chunk_indices(self.cu_host.diff().tolist(), FLA_CONV_CHUNK), self._device)
        return self._conv

    def flash_qla_context(self, num_v_heads: int, is_train: bool) -> Any:
        """FlashQLA's context for this layout: the same decision and split its automatic path
        makes (`build_cp_context(enable_intra=True)`; with `force_split` it splits whatever
        the decision), taken on the host offsets, its tensors
        then copied up; the chunk tiling of each offsets tensor the kernels read is attached
        from the host (`prepare_varlen_metadata`)."""
        key = (num_v_heads, is_train)
        if key not in self._qla:
            from flash_qla.ops.gated_delta_rule.chunk import CHUNK_SIZE
            from flash_qla.ops.gated_delta_rule.chunk.cp import build_cp_context
            from flash_qla.utils.index import prepare_varlen_metadata

            host = build_cp_context(self.cu_host, enable_intra=True, num_v_heads=num_v_heads,
                                    chunk_size=CHUNK_SIZE, is_train=is_train, force_intra_cp=self.force_split)
            moved = {f.name: to_device(getattr(host, f.name), self._device) for f in dataclasses.fields(host)
                     if isinstance(getattr(host, f.name), Tensor) and f.name != "cu_seqlens"}
            ctx = dataclasses.replace(host, cu_seqlens=self.cu, **moved)
            if getattr(self.cu, "_flash_qla_prepared_varlen", None) is None:
                _attach_varlen_metadata(prepare_varlen_metadata, self.cu, self.cu_host)
            if ctx.is_intra:
                _attach_varlen_metadata(prepare_varlen_metadata, ctx.intra_cp_cu_seqlens, host.intra_cp_cu_seqlens)
            self._qla[key] = ctx
        return self._qla[key]


def _attach_varlen_metadata(prepare: Any, cu: Tensor, cu_host: Tensor) -> None:
    """FlashQLA's `prepare_varlen_metadata(cu, cu_host)` (its chunk offsets and indices,
    attached to the device offsets `cu` for its kernels), with the copies up made from pinned
    memory without blocking. FlashQLA's own call copies them from pageable memory, in the
    first Gated DeltaNet layer of every step; a pageable copy can hold the host until the GPU
    has drained its queue (0.8-1.0 ms of idle GPU there in the H200 timelines of 2026-12-03).
    Its tensors are computed by FlashQLA itself, on a host copy of the offsets, and then
    moved; the GPU test holds the result to FlashQLA's own call."""
    staged = cu_host.to(cu.dtype).clone()
    prepare(staged, cu_host)
    size, offsets, total, indices = staged._flash_qla_prepared_varlen
    cu._flash_qla_prepared_varlen = (size, to_device(offsets, cu.device), total, to_device(indices, cu.device))


def fla_causal_conv1d(x: Tensor, weight: Tensor, offsets: PackedOffsets) -> Tensor:
    """fla's varlen causal convolution + SiLU of packed x [T, C] (weight [C, K]), its chunk
    tiling given from the host (`PackedOffsets`)."""
    fla_conv, _ = _fla()
    out = fla_conv(x.unsqueeze(0), weight=weight.to(x.dtype), bias=None, activation="silu",
                   cu_seqlens=offsets.cu, cu_seqlens_cpu=offsets.cu_host, chunk_indices=offsets.conv_chunks())
    out = out[0] if isinstance(out, tuple) else out
    return out.squeeze(0)


def packed_causal_conv1d(x: Tensor, weight: Tensor, offsets: PackedOffsets) -> Tensor:
    """The fla backend's varlen short convolution + SiLU of packed x [T, C] (weight [C, K]):
    vlmrl's Triton kernels (`vlmrl.models.short_conv`, one backward kernel where fla runs
    two) where they take the tensors (CUDA, unit channel stride), else fla's."""
    from . import short_conv

    if short_conv.supported(x, weight):
        return short_conv.short_conv(x, weight, offsets.cu, offsets.conv_chunks())
    return fla_causal_conv1d(x, weight, offsets)


def kernel_inputs(q: Tensor, k: Tensor, v: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor, Tensor]:
    """What fla's and FlashQLA's kernels read with `use_qk_l2norm_in_kernel=False`: q and k
    l2-normalised over the head dim (float32 statistics, back in their dtype, the kernels' own
    norm), v as is, each one contiguous tensor (q, k, v come in as views of the convolution's
    output)."""
    return l2norm(q.float(), eps).to(q.dtype), l2norm(k.float(), eps).to(k.dtype), v.contiguous()


def fla_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, offsets: PackedOffsets) -> Tensor:
    """fla's chunked gated delta rule on packed q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv]
    (value heads grouped over key heads natively: fla's GVA).

    Where fla would dispatch to FlashQLA (Hopper and Blackwell, head size 128), FlashQLA is
    called directly with its context built from the host offsets (`PackedOffsets`): the same
    kernels and the same split, without the read-back. Elsewhere fla's own path.

    The q / k norm and the copies that make q, k, v contiguous run as one compiled graph
    (`kernel_inputs`; on a GPU) before the kernels, not as the kernels' own norm: FlashQLA
    runs that as two compiled calls each way and the copies as three more kernels, each a
    trip through the host in a forward that waits for the host."""
    _, fla_rule = _fla()
    q, k, v = pick(kernel_inputs, q.is_cuda)(q, k, v)
    args = (q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.float().unsqueeze(0), beta.unsqueeze(0))
    kwargs = dict(scale=q.shape[-1] ** -0.5, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, cu_seqlens=offsets.cu)
    backend = _flash_qla_backend()
    if backend is not None and backend.verify("chunk_gated_delta_rule", *args, **kwargs)[0]:
        import flash_qla

        is_train = torch.is_grad_enabled() and any(t.requires_grad for t in args)
        o, _ = flash_qla.chunk_gated_delta_rule(
            *args, **kwargs, cp_context=offsets.flash_qla_context(v.shape[1], is_train))
    else:
        o, _ = fla_rule(*args, **kwargs, cu_seqlens_cpu=offsets.cu_host)
    return o.squeeze(0)


def cu_seqlens_of(bounds: Sequence[tuple[int, int]], device: torch.device) -> Tensor:
    return torch.tensor([0] + [b for _, b in bounds], dtype=torch.long, device=device)


_CHECKED: dict[tuple, float] = {}

# bf16 tolerances of the fast-path check (relative to the largest reference magnitude):
# bf16 carries 8 significant bits (relative step 2^-8 = 3.9e-3); the chunked kernels add
# a few roundings per chunk, so 2e-2 admits bf16 noise and still flags a wrong kernel,
# whose errors are O(1) relative (e.g. the known-wrong Triton backward on Hopper).
FAST_PATH_TOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 2e-3}


def check_model_fast_path(lm: Any, device: torch.device, dtype: torch.dtype, split: int = 1) -> float:
    """`check_fast_path` at one rank's Gated DeltaNet heads of language model `lm` (its
    LanguageModelConfig; `split`: how many ways TP x CP divide the heads). FlashQLA's TileLang
    kernels are JIT-compiled per head count, so the kernels compiled for the check are the
    ones the model then runs, not a second set compiled at its first step."""
    return check_fast_path(device, dtype, hk=lm.linear_num_key_heads // split, hv=lm.linear_num_value_heads // split,
                           dk=lm.linear_key_head_dim, dv=lm.linear_value_head_dim, conv_k=lm.linear_conv_kernel_dim)


# the layout of the forced-split check: FlashQLA cuts its long sample into pieces of a few
# chunks that run on separate SMs and joins their states (the path long samples take)
SPLIT_CHECK_LENS = (37, 1000)
# the sample length of the tile-width layouts (`flash_qla_tile_counts`): short enough that
# FlashQLA keeps every sample whole, longer than one chunk
TILE_CHECK_LEN = 96


def flash_qla_tile(grid: int, target_ctas: int) -> int:
    """The value-column tile width FlashQLA's Hopper forward kernel takes for a grid of `grid`
    (samples x value heads) thread blocks against `target_ctas` (its share of the SMs): 128 when
    the grid fills that share, 64 when half of it does, else 32. The kernel is JIT-compiled
    once per width."""
    return 128 if grid >= target_ctas else 64 if 2 * grid >= target_ctas else 32


def flash_qla_tile_counts(num_v_heads: int, target_ctas: int) -> list[int]:
    """The fewest whole samples that reach each tile width FlashQLA's forward can take with
    `num_v_heads` value heads (`flash_qla_tile`), one count per width, ascending.

    A micro-batch of one or two samples takes a narrower tile than the check's layouts of three
    and more, and so compiled its own kernel in the middle of a run (on the H200 with 32 value
    heads: 10-11 s at a step of the trainer, 2026-12-05, `bench/results/trainer_steps.md`).
    Checking one layout per width compiles all of them at the start, into the cache a later
    process or machine finds."""
    if num_v_heads < 1 or target_ctas < 1:
        raise ValueError(f"need value heads and a target grid of at least 1, got {num_v_heads}, {target_ctas}")
    counts: dict[int, int] = {}
    for n in (1, -(-target_ctas // (2 * num_v_heads)), -(-target_ctas // num_v_heads)):
        counts.setdefault(flash_qla_tile(n * num_v_heads, target_ctas), max(n, 1))
    return sorted(counts.values())


def _flash_qla_target_ctas() -> int | None:
    """FlashQLA's target grid on this GPU (its Hopper forward's share of the SMs), or None
    where that kernel module does not load here (another architecture or version)."""
    try:
        from flash_qla.ops.gated_delta_rule.chunk.hopper import fused_fwd
    except Exception:  # noqa: BLE001 - any failure to load means: no tile widths to warm
        return None
    target = getattr(fused_fwd, "TARGET_NUM_CTAS", None)
    return int(target) if isinstance(target, int) and target > 0 else None


def check_fast_path(device: torch.device, dtype: torch.dtype, *, hk: int = 2, hv: int = 4, dk: int = 64,
                    dv: int = 64, conv_k: int = 4, lens: Sequence[int] = (37, 130, 91), seed: int = 0) -> float:
    """Compare fla's conv + recurrence in `dtype`, forward and backward, with the torch path in
    float32 on the same inputs (the same `dtype` values, upcast) on a small packed input; raise
    FastPathError naming what disagrees. Returns the worst relative difference (to the largest
    reference magnitude). Run once per process and shape signature (cached).

    Where FlashQLA runs the recurrence it is checked a second time with its intra-card split
    forced on a longer sample (`SPLIT_CHECK_LENS`): that path has kernels of its own, which
    would otherwise be compiled, unchecked, at the first long sample of a run. It is also
    checked on one layout per tile width its forward can take (`flash_qla_tile_counts`)
    that `lens` does not take already: each width is a kernel of its own.

    q, k and v reach the kernels as the model gives them: views of the convolution's output
    with its rows grouped by key head (q, k, then the value heads of each group), so the
    compiled functions between see the model's strides and are not compiled a second time
    at its first step."""
    key = (str(device), dtype, hk, hv, dk, dv, conv_k)
    if key in _CHECKED:
        return _CHECKED[key]
    worst = _check_layout(device, dtype, hk, hv, dk, dv, conv_k, lens, seed, force_split=False)
    if device.type == "cuda" and _flash_qla_backend() is not None:
        worst = max(worst, _check_layout(device, dtype, hk, hv, dk, dv, conv_k, SPLIT_CHECK_LENS, seed,
                                         force_split=True))
        target = _flash_qla_target_ctas()
        if target is not None:
            taken = flash_qla_tile(len(lens) * hv, target)
            for n in flash_qla_tile_counts(hv, target):
                if flash_qla_tile(n * hv, target) != taken:
                    worst = max(worst, _check_layout(device, dtype, hk, hv, dk, dv, conv_k,
                                                     (TILE_CHECK_LEN,) * n, seed, force_split=False))
    _CHECKED[key] = worst
    return worst


def _check_layout(device: torch.device, dtype: torch.dtype, hk: int, hv: int, dk: int, dv: int, conv_k: int,
                  lens: Sequence[int], seed: int, force_split: bool) -> float:
    """`check_fast_path` on one packed layout of samples `lens`."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    total = sum(lens)
    channels = 2 * hk * dk + hv * dv

    def rnd(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    x = rnd(total, channels)
    w = rnd(channels, conv_k, scale=0.5)
    a = rnd(total, hv)
    b = rnd(total, hv)
    a_log = torch.empty(hv).uniform_(0.0, 2.0, generator=gen).to(device)
    dt_bias = torch.ones(hv, device=device)
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    bounds = segment_bounds(offsets[:-1], total)
    packed = PackedOffsets(bounds, device, force_split=force_split)
    grad_out = rnd(total, hv, dv)

    def run(fast: bool) -> tuple[Tensor, list[Tensor]]:
        leaves = [(t if fast else t.float()).detach().clone().requires_grad_(True) for t in (x, w, a, b)]
        xx, ww, aa, bb = leaves
        mixed = packed_causal_conv1d(xx, ww, packed) if fast else causal_conv1d(xx, ww, bounds)
        # the model's layout (`GatedDeltaNet.recurrence`): per key head, its q, its k, then
        # the values of its group
        q, k, vv = mixed.view(total, hk, channels // hk).split([dk, dk, hv // hk * dv], dim=-1)
        v = vv.reshape(total, hv, dv)
        g, beta = decay_and_beta(aa, bb, a_log, dt_bias)
        o = (fla_gated_delta_rule(q, k, v, g, beta, packed) if fast
             else chunk_gated_delta_rule(q, k, v, g, beta, bounds))
        o.float().backward(grad_out.float())
        return o.detach().float(), [t.grad.detach().float() for t in leaves]

    ref_o, ref_g = run(False)
    o, grads = run(True)
    tol = FAST_PATH_TOL.get(dtype, 2e-2)
    worst, bad = worst_relative([("output", o, ref_o)] + [(f"grad of {n}", gg, rg) for n, gg, rg in
                                                          zip(("input", "conv weight", "a", "b"), grads, ref_g)], tol)
    if bad is not None:
        raise FastPathError(
            f"the fla Gated DeltaNet path{' (FlashQLA split across SMs)' if force_split else ''} disagrees "
            f"with the torch reference: {bad[0]} differs by "
            f"{bad[1]:.3g} relative (tolerance {tol:g}, {dtype}, {device}); refusing to train on it. "
            "Install a flash-linear-attention / FlashQLA build that passes, or set "
            "hardware.gdn_backend=torch")
    # the contexts FlashQLA ran with (none where its verifier turned these shapes to fla's path)
    if force_split and not all(ctx.is_intra for ctx in packed._qla.values()):
        raise FastPathError("FlashQLA did not split the check's long sample as forced: its split path went unchecked")
    return worst
