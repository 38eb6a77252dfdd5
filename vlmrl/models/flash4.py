"""FlashAttention 4's varlen kernels as torch custom ops, so a compiled graph can hold them.

`hardware.lm_attention_backend=flash4` runs the language model's attention through the
`flash-attn-4` package (`flash_attn.cute`, CuTe DSL kernels for Hopper and Blackwell). Its
public function is an autograd.Function with a long Python preamble per call; wrapped here as
two custom ops with a fake (shape-only) twin and a registered backward,

    vlmrl::flash4_varlen_fwd   q [T, h, d], k / v [T, g, d], cu_seqlens [n + 1] -> out [T, h, d], lse [h, T]
    vlmrl::flash4_varlen_bwd   dout, q, k, v, out, lse, cu_seqlens -> dq, dk, dv

Inductor keeps them inside a compiled graph as opaque calls. The fused attention layer
(`vlmrl.models.fused_layer.attention_layer`) is then one graph from its input norm to its
MLP, and with `hardware.cuda_graphs` one CUDA-graph replay per layer and direction: no
attention launch, no copy of the attention's output into the next graph's input buffers and
no Python preamble on the host per layer.

A recorded graph is specialised on its inputs' shapes and on `max_len`, so a packed
micro-batch reaches it in a bounded set of layouts (`graph_layout`): the sample offsets
padded to a power-of-two count with empty samples at the end (FlashAttention skips a sample
of length 0), and the longest sample rounded up to a power of two (the kernels' grid covers
`max_len` rows per sample; rows past a sample's end do no work).

The ops run on CUDA only, and import `flash_attn.cute` at their first call.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

FLASH4_PACKAGE = "flash-attn-4"  # pip name of FlashAttention 4 (module flash_attn.cute)
MIN_GRAPH_MAX_LEN = 128  # the forward kernel's row tile on Hopper and Blackwell


@functools.cache
def interface() -> Any:
    """`flash_attn.cute.interface`, or an ImportError that says what to install."""
    try:
        from flash_attn.cute import interface as iface
    except ImportError as e:
        raise ImportError(f"hardware.lm_attention_backend=flash4 needs FlashAttention 4 (pip install "
                          f"{FLASH4_PACKAGE}, module flash_attn.cute), which did not import: {e}") from e
    return iface


def installed() -> bool:
    """Whether FlashAttention 4 imports here."""
    return missing() is None


def missing() -> str | None:
    """Why FlashAttention 4 does not import here (the import error, which names the module or
    library at fault), or None where it does."""
    try:
        interface()
    except ImportError as e:
        return str(e)
    return None


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def graph_layout(offsets: list[int], min_max_len: int = MIN_GRAPH_MAX_LEN) -> tuple[list[int], int]:
    """Sample offsets [0, ..., T] of a packed row -> (offsets padded with T to a power-of-two
    length, the longest sample rounded up to a power of two, at least `min_max_len`, at most T).

    Both values key a recorded graph: RL micro-batches bring a new sample count and a new
    longest sample nearly every step, and this keeps them to about log2(T) each."""
    if len(offsets) < 2 or offsets[0] != 0 or any(b < a for a, b in zip(offsets[:-1], offsets[1:])):
        raise ValueError(f"sample offsets must start at 0 and not decrease, got {offsets[:8]}...")
    total = offsets[-1]
    padded = list(offsets) + [total] * (_pow2_at_least(len(offsets)) - len(offsets))
    longest = max(b - a for a, b in zip(offsets[:-1], offsets[1:]))
    return padded, min(total, max(min_max_len, _pow2_at_least(longest)))


@torch.library.custom_op("vlmrl::flash4_varlen_fwd", mutates_args=(), device_types="cuda")
def flash4_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_len: int, scale: float,
                      causal: bool) -> tuple[Tensor, Tensor]:
    out, lse, *_ = interface()._flash_attn_fwd(
        q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
        max_seqlen_q=max_len, max_seqlen_k=max_len, softmax_scale=scale, causal=causal, return_lse=True)
    return out, lse


@flash4_varlen_fwd.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_len: int, scale: float,
      causal: bool) -> tuple[Tensor, Tensor]:
    return (q.new_empty(q.shape[0], q.shape[1], v.shape[2]),
            q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32))


@torch.library.custom_op("vlmrl::flash4_varlen_bwd", mutates_args=(), device_types="cuda")
def flash4_varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                      cu_seqlens: Tensor, max_len: int, scale: float,
                      causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = interface()._flash_attn_bwd(
        q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), dout.contiguous(), lse, scale,
        causal, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_len, max_seqlen_k=max_len)
    return dq, dk, dv


@flash4_varlen_bwd.register_fake
def _(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor,
      max_len: int, scale: float, causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, cu_seqlens, max_len, scale, causal = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_seqlens)
    ctx.args = (max_len, scale, causal)
    ctx.set_materialize_grads(False)  # the lse has no gradient: no zeros made for it


def _backward(ctx: Any, dout: Tensor, _dlse: Tensor | None) -> tuple[Tensor | None, ...]:
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = flash4_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens, *ctx.args)
    return dq, dk, dv, None, None, None, None


flash4_varlen_fwd.register_autograd(_backward, setup_context=_setup_context)


def flash4_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_len: int, scale: float,
                     causal: bool) -> Tensor:
    """Attention within each packed sample: q [T, h, d], k / v [T, g, d] (g divides h; each
    query head reads its group's K / V), `cu_seqlens` int32 [n + 1] on the device (empty
    samples allowed), `max_len` >= the longest sample -> [T, h, d]."""
    return flash4_varlen_fwd(q, k, v, cu_seqlens, max_len, scale, causal)[0]
