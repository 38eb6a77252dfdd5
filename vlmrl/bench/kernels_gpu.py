"""Single kernels of the Qwen3.5-MoE step on one GPU, timed against what they replace.

- short convolution (`vlmrl.models.short_conv`) against fla's varlen `causal_conv1d`,
  forward and backward, at the bench shape (4,096 tokens in `--samples` samples, 8,192
  channels: 16 key heads x 128 x 2 + 32 value heads x 128, kernel 4), for each
  (block of channels, warps) in `--blocks`;
- the loss's log-softmax (`logprobs.fused_log_softmax_pick`, no entropy), forward and
  backward over 4,096 x 248,320 bf16 logits: the Triton kernels against Inductor's form;
- the gradient accumulation of one micro-batch (float32 main gradients += bf16 gradients) over
  the scaled MoE's largest tensors: torch's add (Megatron's hook) against
  `grad_accumulation.accumulate` (`hardware.fused_grad_accumulation`);
- the router GEMM of the compiled MoE block (`moe.router_logits`: bf16 tensor-core GEMMs
  with float32 results) against Megatron's float32 GEMM of the upcast inputs, forward and
  backward, tokens x hidden 2048 x 64 experts.

Per call: the median wall time of `--iters` calls after `--warmup` (CUDA events, launch
gaps included) and the kernel time (the profiler's device events, summed); each variant's
largest difference from the reference is printed beside its times.

    python -m vlmrl.bench.kernels_gpu --out bench/results
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch


def _time(fn: Any, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def _gpu_time(fn: Any, iters: int) -> float:
    """Seconds of kernel time per call (the profiler's device events of `iters` calls, summed):
    what a call costs the GPU, without the launch gaps that `_time` counts."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total_us = sum(e.device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
    return total_us / 1e6 / iters


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max())


def _timings(run: Any, iters: int, warmup: int) -> dict[str, float]:
    """Forward alone and forward + backward: wall time per call (CUDA events) and kernel time."""
    return {"forward_ms": _time(lambda: run(False), iters, warmup) * 1e3,
            "forward_backward_ms": _time(lambda: run(True), iters, warmup) * 1e3,
            "forward_gpu_ms": _gpu_time(lambda: run(False), iters) * 1e3,
            "forward_backward_gpu_ms": _gpu_time(lambda: run(True), iters) * 1e3}


def conv_rows(tokens: int, samples: int, channels: int, blocks: list[tuple[int, int]],
              iters: int, warmup: int) -> list[dict[str, Any]]:
    from ..models import gated_delta as gd
    from ..models import short_conv

    fla_conv, _ = gd._fla()
    per = tokens // samples
    bounds = gd.segment_bounds([i * per for i in range(samples)], tokens)
    offsets = gd.PackedOffsets(bounds, torch.device("cuda"))
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(tokens, channels + 4096, generator=gen).to("cuda", torch.bfloat16)
    x = wide[:, :channels]  # strided, as the layer's projection leaves it
    w = (torch.randn(channels, 4, generator=gen) * 0.5).to("cuda", torch.bfloat16)
    dy = torch.randn(tokens, channels, generator=gen).to("cuda", torch.bfloat16)

    def run_fla(backward: bool) -> Any:
        xx, ww = x.detach().requires_grad_(backward), w.detach().requires_grad_(backward)
        y = fla_conv(xx.unsqueeze(0), weight=ww, bias=None, activation="silu", cu_seqlens=offsets.cu,
                     cu_seqlens_cpu=offsets.cu_host, chunk_indices=offsets.conv_chunks())[0][0]
        if backward:
            y.backward(dy)
            return y, xx.grad, ww.grad
        return (y,)

    def run_ours(backward: bool) -> Any:
        xx, ww = x.detach().requires_grad_(backward), w.detach().requires_grad_(backward)
        y = short_conv.short_conv(xx, ww, offsets.cu, offsets.conv_chunks())
        if backward:
            y.backward(dy)
            return y, xx.grad, ww.grad
        return (y,)

    ref = run_fla(True)
    rows = []
    rows.append({"kernel": "short_conv", "variant": "fla", **_timings(run_fla, iters, warmup)})
    saved = short_conv.BLOCK_D, short_conv.WARPS
    try:
        for bd, warps in blocks:
            short_conv.BLOCK_D, short_conv.WARPS = bd, warps
            got = run_ours(True)
            rows.append({"kernel": "short_conv", "variant": f"vlmrl BD={bd} warps={warps}",
                         **_timings(run_ours, iters, warmup),
                         "vs_fla": {n: _rel(a, b) for n, a, b in zip(("y", "dx", "dw"), got, ref)}})
    finally:
        short_conv.BLOCK_D, short_conv.WARPS = saved
    return rows


def router_rows(tokens: int, hidden: int, experts: int, iters: int, warmup: int) -> list[dict[str, Any]]:
    import torch.nn.functional as F

    from ..models.moe import router_logits

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen).to("cuda", torch.bfloat16)
    w = (torch.randn(experts, hidden, generator=gen) * 0.02).to("cuda", torch.bfloat16)
    g = torch.randn(tokens, experts, generator=gen).to("cuda")

    def fp32() -> Any:
        xx, ww = x.detach().requires_grad_(), w.detach().requires_grad_()
        out = F.linear(xx.float(), ww.float())
        out.backward(g)
        return out, xx.grad, ww.grad

    def ours() -> Any:
        xx, ww = x.detach().requires_grad_(), w.detach().requires_grad_()
        out = router_logits(xx, ww)
        out.backward(g)
        return out, xx.grad, ww.grad

    ref = fp32()
    rows = []
    for name, fn in (("float32 GEMMs (Megatron)", fp32), ("bf16 GEMMs, float32 results", ours)):
        got = fn()
        rows.append({"kernel": "router", "variant": name, "forward_backward_ms": _time(fn, iters, warmup) * 1e3,
                     "forward_backward_gpu_ms": _gpu_time(fn, iters) * 1e3,
                     "vs_float32": {n: _rel(a, b) for n, a, b in zip(("logits", "dx", "dw"), got, ref)}})
    return rows


# the scaled Qwen3.5-MoE's largest trained tensors (elements): embedding and output layer
# (248,320 x 2,048), then per layer the experts' fused gate / up (64 x 1,024 x 2,048) and down
# (64 x 2,048 x 512) weights, for its 8 layers: 2.6 of its 2.9B parameters
ACCUMULATION_SIZES = (248320 * 2048,) * 2 + (64 * 1024 * 2048, 64 * 2048 * 512) * 8


def accumulation_rows(iters: int, warmup: int, sizes: tuple[int, ...] = ACCUMULATION_SIZES) -> list[dict[str, Any]]:
    """One micro-batch's gradient accumulation over `sizes`: torch's `main_grad.add_(grad)` per
    tensor (Megatron's hook) against `grad_accumulation.accumulate`, float32 += bf16, with the
    bandwidth each reaches (10 bytes moved per element: read 4 + 2, write 4)."""
    from ..training.grad_accumulation import accumulate

    gen = torch.Generator(device="cuda").manual_seed(0)
    mains = [torch.zeros(n, device="cuda") for n in sizes]
    grads = [torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16) for n in sizes]
    ref = [m.clone().add_(g) for m, g in zip(mains, grads)]
    check = [m.clone() for m in mains]
    for m, g in zip(check, grads):
        assert accumulate(m, g)
    exact = all(torch.equal(a, b) for a, b in zip(check, ref))
    del ref, check

    def torch_add() -> None:
        for m, g in zip(mains, grads):
            m.add_(g)

    def fused() -> None:
        for m, g in zip(mains, grads):
            accumulate(m, g)

    moved = 10 * sum(sizes)  # bytes: read 4 + 2, write 4 per element
    rows = []
    for name, fn in (("torch add_ (Megatron's hook)", torch_add), ("vectorised Triton kernel", fused)):
        wall, gpu = _time(fn, iters, warmup), _gpu_time(fn, iters)
        rows.append({"kernel": "gradient accumulation", "variant": name, "tensors": len(sizes),
                     "elements": sum(sizes), "ms": wall * 1e3, "gpu_ms": gpu * 1e3,
                     "tb_per_s": moved / gpu / 1e12, "same_bits_as_torch": exact})
    return rows


def loss_rows(tokens: int, vocab: int, iters: int, warmup: int) -> list[dict[str, Any]]:
    from ..training import logprob_kernels, logprobs

    gen = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(tokens, vocab, generator=gen)).to("cuda", torch.bfloat16)
    targets = torch.randint(0, vocab, (tokens,), generator=gen).to("cuda")
    g = torch.randn(tokens, generator=gen).to("cuda")

    def run(triton: bool) -> Any:
        saved = logprob_kernels.supported
        if not triton:
            logprob_kernels.supported = lambda _: False  # the compiled (Inductor) form of the same maths
        try:
            x = logits.detach().requires_grad_()
            logp, _ = logprobs.fused_log_softmax_pick(x, targets, 1.0, False)
            logp.backward(g)
            return logp, x.grad
        finally:
            logprob_kernels.supported = saved

    ref = run(False)
    rows = []
    for name, triton in (("Inductor (logsumexp, then the gradient)", False), ("Triton (one read forward)", True)):
        got = run(triton)
        rows.append({"kernel": "loss", "variant": name,
                     "forward_backward_ms": _time(lambda t=triton: run(t), iters, warmup) * 1e3,
                     "forward_backward_gpu_ms": _gpu_time(lambda t=triton: run(t), iters) * 1e3,
                     "vs_inductor": {n: _rel(a, b) for n, a, b in zip(("logp", "grad"), got, ref)}})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--channels", type=int, default=8192)
    ap.add_argument("--blocks", default="16x4,32x4,64x4,64x8", help="BDxWARPS of the short convolution")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--kernels", default="conv,router,loss,accumulation", help="which kernels to time")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = ap.parse_args(argv)
    kernels = set(args.kernels.split(","))
    if kernels - {"conv", "router", "loss", "accumulation"}:
        ap.error(f"--kernels: unknown {sorted(kernels - {'conv', 'router', 'loss', 'accumulation'})}")
    if not torch.cuda.is_available():
        print("kernels_gpu needs CUDA", file=sys.stderr)
        return 2
    blocks = [tuple(int(v) for v in b.split("x")) for b in args.blocks.split(",")]
    rows = conv_rows(args.tokens, args.samples, args.channels, blocks, args.iters, args.warmup) \
        if "conv" in kernels else []
    if "router" in kernels:
        rows += router_rows(args.tokens, 2048, 64, args.iters, args.warmup)
    if "loss" in kernels:
        rows += loss_rows(args.tokens, 248320, min(args.iters, 20), 3)
    if "accumulation" in kernels:
        rows += accumulation_rows(min(args.iters, 20), 3)
    for r in rows:
        print(json.dumps(r), flush=True)
    result = {"command": "python -m vlmrl.bench.kernels_gpu " + " ".join(sys.argv[1:] if argv is None else argv),
              "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
              "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels_gpu.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
