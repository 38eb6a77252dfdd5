"""vlmrl's Triton short convolution (`vlmrl.models.short_conv`, the fla backend's varlen
convolution + SiLU) against the torch reference `gated_delta.causal_conv1d` and fla's kernels.

Float32: the same sums (four taps, then the tile and tile-partial sums of the weight
gradient in another order) to 1e-5 of the largest value. bf16 inputs: the reference runs in
float32 on the same bf16 values; y and dx are rounded once to bf16 (2^-8 of a value) and dw
once to the weight's dtype, so 1e-2 of the largest value admits the rounding and fails a
wrong tap, boundary or sign (O(1) errors). Samples of 1-3 tokens (shorter than the
kernel), a sample longer than a tile, a channel count that is no multiple of the block,
and rows strided as the layer's projection output leaves them are all covered."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

LENS = (1, 37, 2, 130, 3, 91, 700)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _inputs(total: int, channels: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(total, channels + 40, generator=gen)  # x is a strided view of wider rows
    w = torch.randn(channels, 4, generator=gen) * 0.5
    dy = torch.randn(total, channels, generator=gen)
    return (wide.to("cuda", dtype), w.to("cuda", dtype), dy.to("cuda", dtype))


@pytest.mark.parametrize("dtype,channels", [(torch.float32, 200), (torch.bfloat16, 8192)])
def test_short_conv_matches_the_torch_reference(dtype, channels):
    from vlmrl.models import gated_delta as gd
    from vlmrl.models import short_conv

    total = sum(LENS)
    bounds = gd.segment_bounds([sum(LENS[:i]) for i in range(len(LENS))], total)
    offsets = gd.PackedOffsets(bounds, torch.device("cuda"))
    wide, w, dy = _inputs(total, channels, dtype)

    x = wide[:, 13:13 + channels].detach().requires_grad_()
    wt = w.detach().clone().requires_grad_()
    assert x.stride(0) == channels + 40 and short_conv.supported(x, wt)
    y = gd.packed_causal_conv1d(x, wt, offsets)
    y.backward(dy)

    xr = wide[:, 13:13 + channels].float().detach().requires_grad_()
    wr = w.float().detach().requires_grad_()
    ref = gd.causal_conv1d(xr, wr, bounds)
    ref.backward(dy.float())

    bound = 1e-5 if dtype == torch.float32 else 1e-2
    assert y.dtype == dtype and x.grad.dtype == dtype and wt.grad.dtype == dtype
    for name, got, want in (("y", y, ref), ("dx", x.grad, xr.grad), ("dw", wt.grad, wr.grad)):
        assert _rel(got, want) <= bound, (name, _rel(got, want))
    # the first token of every sample sees only itself: nothing leaks across a boundary
    starts = [a for a, _ in bounds]
    torch.testing.assert_close(y[starts].float(), torch.nn.functional.silu(x[starts].float() * w[:, -1].float()),
                               rtol=bound, atol=bound)


def test_short_conv_agrees_with_fla_in_bf16():
    """The same inputs through fla's varlen kernels: outputs and gradients within bf16
    rounding of each other (both sum in float32)."""
    from vlmrl.models import gated_delta as gd

    fla_conv, _ = gd._fla()
    total = sum(LENS)
    bounds = gd.segment_bounds([sum(LENS[:i]) for i in range(len(LENS))], total)
    offsets = gd.PackedOffsets(bounds, torch.device("cuda"))
    wide, w, dy = _inputs(total, 1024, torch.bfloat16, seed=1)
    grads = []
    for ours in (True, False):
        x = wide[:, :1024].detach().clone().requires_grad_()
        wt = w.detach().clone().requires_grad_()
        if ours:
            y = gd.packed_causal_conv1d(x, wt, offsets)
        else:
            y = fla_conv(x.unsqueeze(0), weight=wt, bias=None, activation="silu",
                         cu_seqlens=offsets.cu_host.to("cuda"))[0][0]
        y.backward(dy)
        grads.append((y.detach(), x.grad, wt.grad))
    for name, a, b in zip(("y", "dx", "dw"), *grads):
        assert _rel(a, b) <= 1e-2, (name, _rel(a, b))
