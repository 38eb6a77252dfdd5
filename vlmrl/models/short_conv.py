"""The Gated DeltaNet's short causal convolution + SiLU on packed sequences, as two Triton
kernels (CUDA only; `gated_delta.causal_conv1d` is the reference maths).

    pre[t, c] = sum_j w[c, j] * x[t - (W - 1) + j, c]    (rows before the sample's start: 0)
    y[t, c]   = silu(pre[t, c])

Backward, with g = dy * silu'(pre) (zero past the sample's end):

    dx[t, c]   = sum_i w[c, W - 1 - i] * g[t + i, c]
    dw[c, j]   = sum_t g[t, c] * x[t - (W - 1) + j, c]

fla's varlen kernels compute the same. Their backward runs a second kernel that recomputes
`pre` into memory and then reads it back (and dy) once per tap; on the Qwen3.5-MoE bench's
convolution (8,192 channels, 4,096 tokens) it took 0.36 ms a layer on an H200, a fifth of
memory speed. Here each tile of 64 tokens x BD channels recomputes `pre` for its own rows
and the W - 1 after them from x in registers, so the backward is one kernel reading x and
dy once (each of the seven shifted row blocks x[t - 3 .. t + 3] is loaded once; the
kernel width is 4, Qwen3.5's) and writing dx, plus a sum of the per-tile weight-gradient
partials (float32, [tiles, C, 4]). Tiles follow fla's varlen tiling (`gated_delta.chunk_indices`: each tile
lies in one sample), taken from the host like the rest of the packed layout, so nothing is
read back. All sums are in float32; y and dx are rounded once to x's dtype, dw to the
weight's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

TILE = 64  # tokens per tile: fla's varlen convolution tiling (`gated_delta.FLA_CONV_CHUNK`)


def supported(x: Tensor, weight: Tensor) -> bool:
    """Whether the kernels take these tensors: CUDA, x [T, C] with unit channel stride,
    weight [C, 4] (the kernel width of Qwen3.5's and Qwen3-Next's Gated DeltaNet)."""
    return (x.is_cuda and x.dim() == 2 and x.stride(1) == 1 and weight.dim() == 2
            and tuple(weight.shape) == (x.shape[1], 4))


try:  # Triton comes with CUDA builds of torch; CPU machines have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the kernels are GPU-only
    triton = None

if triton is not None:

    @triton.jit
    def short_conv_fwd(x, w, y, cu, tiles, stride_x, C, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
        i_d, i_c = tl.program_id(0), tl.program_id(1)
        i_n = tl.load(tiles + 2 * i_c).to(tl.int64)
        i_t = tl.load(tiles + 2 * i_c + 1).to(tl.int64)
        bos, eos = tl.load(cu + i_n).to(tl.int64), tl.load(cu + i_n + 1).to(tl.int64)
        o_t = bos + i_t * BT + tl.arange(0, BT)
        o_d = i_d * BD + tl.arange(0, BD)
        m_d = o_d < C
        m_t = o_t < eos
        acc = tl.zeros((BT, BD), dtype=tl.float32)
        for j in tl.static_range(W):
            src = o_t - (W - 1) + j
            m = (src >= bos) & m_t
            xv = tl.load(x + src[:, None] * stride_x + o_d[None, :], mask=m[:, None] & m_d[None, :], other=0.0)
            wj = tl.load(w + o_d * W + j, mask=m_d, other=0.0).to(tl.float32)
            acc += xv.to(tl.float32) * wj[None, :]
        out = acc * tl.sigmoid(acc)
        tl.store(y + o_t[:, None] * C + o_d[None, :], out.to(y.dtype.element_ty), mask=m_t[:, None] & m_d[None, :])

    @triton.jit
    def _rows(x, src, bos, eos, o_d, m_d, stride_x):
        """x[src, o_d] as float32, zero outside the sample [bos, eos)."""
        m = (src >= bos) & (src < eos)
        v = tl.load(x + src[:, None] * stride_x + o_d[None, :], mask=m[:, None] & m_d[None, :], other=0.0)
        return v.to(tl.float32)

    @triton.jit
    def _grad(pre, dy, r, eos, o_d, m_d, C):
        """dy * silu'(pre) at rows r (zero past the sample's end)."""
        m = r < eos
        d = tl.load(dy + r[:, None] * C + o_d[None, :], mask=m[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        s = tl.sigmoid(pre)
        return d * s * (1.0 + pre * (1.0 - s))

    @triton.jit
    def short_conv_bwd(x, w, dy, dx, dw, cu, tiles, stride_x, C, BT: tl.constexpr, BD: tl.constexpr):
        # kernel width 4: the seven shifted row blocks x[t - 3 .. t + 3] are read once each,
        # in order, and each is dropped when the last `pre` that needs it is done
        i_d, i_c = tl.program_id(0), tl.program_id(1)
        i_n = tl.load(tiles + 2 * i_c).to(tl.int64)
        i_t = tl.load(tiles + 2 * i_c + 1).to(tl.int64)
        bos, eos = tl.load(cu + i_n).to(tl.int64), tl.load(cu + i_n + 1).to(tl.int64)
        o_t = bos + i_t * BT + tl.arange(0, BT)
        o_d = i_d * BD + tl.arange(0, BD)
        m_d = o_d < C
        w0 = tl.load(w + o_d * 4, mask=m_d, other=0.0).to(tl.float32)[None, :]
        w1 = tl.load(w + o_d * 4 + 1, mask=m_d, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w + o_d * 4 + 2, mask=m_d, other=0.0).to(tl.float32)[None, :]
        w3 = tl.load(w + o_d * 4 + 3, mask=m_d, other=0.0).to(tl.float32)[None, :]
        xa = _rows(x, o_t - 3, bos, eos, o_d, m_d, stride_x)
        xb = _rows(x, o_t - 2, bos, eos, o_d, m_d, stride_x)
        xc = _rows(x, o_t - 1, bos, eos, o_d, m_d, stride_x)
        xd = _rows(x, o_t, bos, eos, o_d, m_d, stride_x)
        g = _grad(w0 * xa + w1 * xb + w2 * xc + w3 * xd, dy, o_t, eos, o_d, m_d, C)  # rows t
        base = dw + i_c * C * 4 + o_d * 4  # this tile's rows' share of the weight gradient
        tl.store(base, tl.sum(g * xa, axis=0), mask=m_d)
        tl.store(base + 1, tl.sum(g * xb, axis=0), mask=m_d)
        tl.store(base + 2, tl.sum(g * xc, axis=0), mask=m_d)
        tl.store(base + 3, tl.sum(g * xd, axis=0), mask=m_d)
        acc = w3 * g
        xa = _rows(x, o_t + 1, bos, eos, o_d, m_d, stride_x)
        acc += w2 * _grad(w0 * xb + w1 * xc + w2 * xd + w3 * xa, dy, o_t + 1, eos, o_d, m_d, C)
        xb = _rows(x, o_t + 2, bos, eos, o_d, m_d, stride_x)
        acc += w1 * _grad(w0 * xc + w1 * xd + w2 * xa + w3 * xb, dy, o_t + 2, eos, o_d, m_d, C)
        xc = _rows(x, o_t + 3, bos, eos, o_d, m_d, stride_x)
        acc += w0 * _grad(w0 * xd + w1 * xa + w2 * xb + w3 * xc, dy, o_t + 3, eos, o_d, m_d, C)
        tl.store(dx + o_t[:, None] * C + o_d[None, :], acc.to(dx.dtype.element_ty),
                 mask=(o_t < eos)[:, None] & m_d[None, :])


# channels per program and warps: the fastest of `python -m vlmrl.bench kernels-gpu` on an
# H200 for 8,192 channels (bench/results/kernels-gpu-h200-20261203-0306.json); any C works
BLOCK_D = 32
WARPS = 4


def _launch_fwd(x: Tensor, w: Tensor, cu: Tensor, tiles: Tensor) -> Tensor:
    t, c = x.shape
    y = torch.empty((t, c), dtype=x.dtype, device=x.device)
    grid = ((c + BLOCK_D - 1) // BLOCK_D, tiles.shape[0])
    short_conv_fwd[grid](x, w, y, cu, tiles, x.stride(0), c, W=w.shape[1], BT=TILE, BD=BLOCK_D, num_warps=WARPS)
    return y


class _ShortConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, cu: Tensor, tiles: Tensor) -> Tensor:
        w = weight.contiguous()
        ctx.save_for_backward(x, w, cu, tiles)
        ctx.weight_dtype = weight.dtype
        return _launch_fwd(x, w, cu, tiles)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, Tensor, None, None]:
        x, w, cu, tiles = ctx.saved_tensors
        t, c = x.shape
        dy = dy.contiguous()
        dx = torch.empty((t, c), dtype=x.dtype, device=x.device)
        parts = torch.empty((tiles.shape[0], c, w.shape[1]), dtype=torch.float32, device=x.device)
        grid = ((c + BLOCK_D - 1) // BLOCK_D, tiles.shape[0])
        short_conv_bwd[grid](x, w, dy, dx, parts, cu, tiles, x.stride(0), c, BT=TILE, BD=BLOCK_D, num_warps=WARPS)
        return dx, parts.sum(0).to(ctx.weight_dtype), None, None


def short_conv(x: Tensor, weight: Tensor, cu: Tensor, tiles: Tensor) -> Tensor:
    """silu(causal depthwise conv) of packed x [T, C] (rows may be strided, channels not)
    with weight [C, W]; `cu` the sample offsets [S + 1] (int, on the device, the last = T)
    and `tiles` fla's [n, 2] tiling of them into TILE-token chunks (`chunk_indices`).
    Differentiable in x and weight. Every token must lie in a sample of `cu`."""
    if not supported(x, weight):
        raise ValueError(f"short_conv takes CUDA x [T, C] with unit channel stride and weight [C, 4]; "
                         f"got x {tuple(x.shape)} stride {x.stride()} on {x.device}, weight {tuple(weight.shape)}")
    return _ShortConv.apply(x, weight, cu, tiles)
