"""Training throughput on one GPU: vlmrl's Megatron path against HF transformers.

Same language-model shape, same tokens and the same attention work: `--seq` tokens split into
`--samples` equal samples, which vlmrl packs into one varlen sequence and HF takes as the rows
of one batch (no padding; before 2026-12-05 HF got one causal row of `--seq` tokens whatever
`--samples` said, i.e. up to `--samples` times vlmrl's attention work). Every row records its
`token_layout` and a pair of other layouts is refused; HF rows record which fast paths
transformers found (fla, causal_conv1d) and every warning it logged. bf16, one forward +
backward with a next-token loss over the full vocabulary, after warm-up; median of `--iters`
steps. Two shapes (`--shape`):

- dense (default): Qwen2.5 (~1.5B parameters), against HF + SDPA;
- qwen35_moe: a scaled Qwen3.5-MoE (8 layers: 6 Gated DeltaNet + 2 gated attention, hidden
  2048, 64 experts top-8 with FFN 512, shared expert 512, vocab 248320; 2.91B parameters),
  against HF + flash-linear-attention.

    python -m vlmrl.bench.train_gpu --seq 4096 --out bench/results
    python -m vlmrl.bench.train_gpu --shape qwen35_moe --samples 8 --variants hf_qwen35_moe,vlmrl_qwen35_moe

Each step is also split where the forward and the loss are queued: the host's time until
then, and on a GPU the time until the GPU got there (CUDA events). When the two are close,
the GPU spent the forward waiting for launches; the backward's share is the rest.

Each timed step starts on an idle GPU (the bench waits for it first): the ratios (`vs_hf`)
are of these medians. The same number of steps is then also run back to back, without that
wait, as a trainer runs its micro-batches (`back_to_back_step_s`, `vs_hf_back_to_back`):
where a step never waits for the GPU, its host can queue the next forward while the GPU
still runs the last backward. `--timeline` shows one step's GPU idle time and its gaps.
Every ratio is given twice: to the HF row just before, and to the run's first HF row
(`vs_first_hf*`, see `add_ratios`).

TFLOP/s count 6 x (matmul parameters a token passes through: active experts only, the LM
head included, the embedding table excluded) plus causal attention over the full-attention
layers (6 x layers x heads x head_dim x seq per token); the Gated DeltaNet recurrence and
the elementwise work are not counted.

Variants (all on the same weights' shapes; in the qwen35_moe pair, on the same weights:
vlmrl's model loads the HF variant's seeded initialisation, `hf_qwen35_moe_model`):
- hf_sdpa: `Qwen2ForCausalLM`-shaped HF text model (Qwen2.5-VL's language model),
  attn_implementation="sdpa", the samples as the rows of one batch.
- vlmrl_megatron: the bridge's Megatron model (fused QKV and gate/up GEMMs, flash varlen
  attention on the packed sequence), loss through vlmrl's vocab-parallel logprobs.
- vlmrl_megatron_fused: the same with `hardware.fused_kernels=true` (the GPU hardware
  configs' setting): Inductor-compiled RMSNorm, M-RoPE and log-softmax
  (`vlmrl.models.kernels`) and megatron-core's compiled SwiGLU.
- hf_qwen35_moe: transformers' `Qwen3_5MoeForCausalLM` (fla kernels when installed).
- vlmrl_qwen35_moe: the bridge's Qwen3.5-MoE Megatron model with fused kernels,
  hardware.gdn_backend=fla after its check, grouped-GEMM experts.
- a `_graphs` suffix on a vlmrl variant (`vlmrl_qwen35_moe_graphs`,
  `vlmrl_megatron_fused_graphs`): the same model with `hardware.cuda_graphs=true`, built,
  packed and stepped as the trainer does then (`build_model(cuda_graphs=True)`, the
  micro-batch padded to its `graph_bucket` (4096 tokens are a bucket already),
  `begin_graph_step` before each forward). These are what the GPU hardware configs train,
  and what `make bench` pairs with HF.
- a `_flash4` suffix after that (`vlmrl_megatron_fused_graphs_flash4`,
  `vlmrl_qwen35_moe_graphs_flash4`): the language model's attention through
  `hardware.lm_attention_backend=flash4` (FlashAttention 4's varlen kernels, one call per
  layer) instead of torch SDPA's per-sample cuDNN calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch


def model_config(hidden: int, layers: int, heads: int, kv: int, ffn: int, vocab: int) -> Any:
    from ..config.schema import LanguageModelConfig, ModelConfig, VisionConfig

    return ModelConfig(
        name="bench", family="qwen2_5_vl", dtype="bfloat16",
        lm=LanguageModelConfig(num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
                               num_query_groups=kv, head_dim=hidden // heads, vocab_size=vocab,
                               max_position_embeddings=32768, rope_theta=1e6,
                               mrope_section=[(hidden // heads) // 8, 3 * (hidden // heads) // 16,
                                              3 * (hidden // heads) // 16],
                               tie_word_embeddings=True, add_qkv_bias=True),
        vision=VisionConfig(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=hidden,
                            window_size=56, fullatt_block_indexes=[0]),
    )


def qwen35_moe_config(layers: int = 8, hidden: int = 2048, experts: int = 64, topk: int = 8, moe_ffn: int = 512,
                      shared: int = 512, vocab: int = 248320) -> Any:
    """The scaled Qwen3.5-MoE shape: the 35B-A3B layer (GDN 16/32 heads of 128, attention 16/2
    heads of 256, partial rotary 0.25) with fewer layers and experts."""
    from ..config.schema import LanguageModelConfig, ModelConfig, VisionConfig

    types = (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4)
    return ModelConfig(
        name="bench-qwen35-moe", family="qwen3_5_moe", dtype="bfloat16",
        lm=LanguageModelConfig(
            num_layers=layers, hidden_size=hidden, ffn_hidden_size=moe_ffn, num_attention_heads=16,
            num_query_groups=2, head_dim=256, vocab_size=vocab, max_position_embeddings=32768,
            rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[11, 11, 10], mrope_interleaved=True,
            tie_word_embeddings=False, add_qkv_bias=False, qk_layernorm=True, attention_output_gate=True,
            layer_types=types, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=experts, moe_router_topk=topk,
            moe_ffn_hidden_size=moe_ffn, shared_expert_ffn_hidden_size=shared, shared_expert_gate=True),
        vision=VisionConfig(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=16,
                            out_hidden_size=hidden, window_size=0, fullatt_block_indexes=[],
                            num_position_embeddings=64),
        image_token_id=248056, vision_start_token_id=248053, vision_end_token_id=248054,
    )


def active_matmul_params(mcfg: Any) -> int:
    """Parameters of the matmuls one token passes through (LM head in, embedding out)."""
    lm = mcfg.lm
    h = lm.hidden_size
    types = list(lm.layer_types) or ["full_attention"] * lm.num_layers
    attn = h * lm.head_dim * (lm.num_attention_heads * (2 if lm.attention_output_gate else 1)
                              + 2 * lm.num_query_groups) + lm.num_attention_heads * lm.head_dim * h
    gdn = 0
    if lm.linear_num_key_heads:
        kd, vd = lm.linear_num_key_heads * lm.linear_key_head_dim, lm.linear_num_value_heads * lm.linear_value_head_dim
        gdn = h * (2 * kd + 2 * vd + 2 * lm.linear_num_value_heads) + vd * h
    if lm.num_experts:
        mlp = 3 * h * (lm.moe_router_topk * lm.moe_ffn_hidden_size + lm.shared_expert_ffn_hidden_size) \
            + h * lm.num_experts + h
    else:
        mlp = 3 * h * lm.ffn_hidden_size
    mixers = sum(attn if t == "full_attention" else gdn for t in types)
    return mixers + lm.num_layers * mlp + lm.vocab_size * h


def flops_per_token_of(mcfg: Any, seq: int) -> float:
    lm = mcfg.lm
    n_attn = (list(lm.layer_types) or ["full_attention"] * lm.num_layers).count("full_attention")
    return 6 * active_matmul_params(mcfg) + 6 * n_attn * lm.num_attention_heads * lm.head_dim * seq


def params_of(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_token(n_params_no_embed: int, layers: int, hidden: int, seq: int) -> float:
    """6N for the matmuls plus causal attention (6 * layers * hidden * seq per token)."""
    return 6 * n_params_no_embed + 6 * layers * hidden * seq


CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"  # CPU: a smoke test of the script with a small shape


PROFILE_TOP = 0  # > 0: print the top kernels of a profiled step per variant (--profile N)


def profile(step: Any, name: str, top: int | None = None, steps: int = 2, by_total: bool = False) -> dict[str, float]:
    """Print the top ops of `steps` profiled steps by their own GPU time (own CPU time without
    CUDA); with `by_total` also by CPU time including children, where the trainer's phases
    (`torch.profiler.record_function` scopes, e.g. "vlmrl.optimizer_step") come first.
    Returns those phases' host milliseconds per step, children included."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    top = top or PROFILE_TOP
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if CUDA:
            torch.cuda.synchronize()
    keys = ["self_cuda_time_total" if CUDA else "self_cpu_time_total"] + (["cpu_time_total"] if by_total else [])
    for key in keys:
        print(f"--- {name}: top {top} ops by {key} ({steps} steps)")
        print(prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=60))
    return phase_host_ms(((e.key, e.cpu_time_total) for e in prof.key_averages()), steps)


def phase_host_ms(rows: Any, steps: int) -> dict[str, float]:
    """(name, host µs with children) rows of a profile -> each "vlmrl." phase's host ms per step.
    On CUDA a `record_function` scope is listed twice, as its host range and as its span on
    the GPU, whose host time is 0: the host range's is kept (taking whichever row came last
    reported every phase as 0 ms in the H200 runs of 2026-12-05)."""
    out: dict[str, float] = {}
    for key, cpu_us in rows:
        if key.startswith("vlmrl."):
            out[key] = max(out.get(key, 0.0), cpu_us / 1e3 / steps)
    return out


TIMELINE = False  # --timeline: where one step's GPU sits idle (CUDA activity only, see `gpu_timeline`)
_TIMELINES: list[str] = []
MARKER_KERNEL = "spin_kernel"  # torch.cuda._sleep's kernel: the forward / backward boundary on the timeline


def idle_gaps(kernels: list[tuple[float, float, str]], marker: str | None = None,
              min_gap_us: float = 5.0) -> dict[str, Any]:
    """From GPU activity intervals (start µs, end µs, name) of one step: the span from the
    first start to the last end, the time covered by any activity, the idle rest, split at
    the first `marker` activity (the forward / backward boundary) when there is one, and the
    gaps of at least `min_gap_us` with the activities on either side, largest first."""
    ks = sorted(kernels)
    if not ks:
        return {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "gaps": []}
    cut = next((s for s, _, n in ks if marker and marker in n), None)
    busy, idle, idle_before, gaps = 0.0, 0.0, 0.0, []
    end, prev = ks[0][0], ks[0][2]
    for s, e, n in ks:
        if s > end:
            gap = s - end
            idle += gap
            if cut is not None and s <= cut:
                idle_before += gap
            if gap >= min_gap_us:
                gaps.append({"at_us": end - ks[0][0], "gap_us": gap, "after": prev, "before": n})
        busy += max(0.0, e - max(s, end))
        if e > end:
            end, prev = e, n
    out = {"span_us": end - ks[0][0], "busy_us": busy, "idle_us": idle,
           "gaps": sorted(gaps, key=lambda g: -g["gap_us"])}
    if cut is not None:
        out.update(forward_span_us=cut - ks[0][0], forward_idle_us=idle_before)
    return out


# (kind, patterns of a GPU kernel's name, any of them, case-insensitive), first match wins; a
# pattern is a substring, or a tuple of substrings that must all be in the name
KERNEL_KINDS = (
    ("grouped GEMM", ("grouped", "enable_3x_kernel_for_sm9x")),  # torch's grouped mm (CUTLASS 3)
    ("GEMM", ("nvjet", "gemm")),
    # the loss: a compiled log-softmax, the compiled pair of `fused_log_softmax_pick` (a
    # logsumexp forward and an elementwise backward that builds the one-hot from an arange),
    # or its Triton kernels on CUDA (`vlmrl.training.logprob_kernels`)
    ("softmax / log-softmax (loss)", ("softmax", "logsumexp", "arange_eq_exp", "lse_partials", "logits_grad")),
    ("attention", ("flash", "sdpa", "fmha")),
    ("Gated DeltaNet (fla / FlashQLA)", ("tilelang", "gated_delta", "chunk_gdr", "fused_recurrent")),
    ("short convolution", ("conv",)),
    ("gather / scatter / sort (MoE dispatch and combine, embedding)", ("index", "gather", "scatter", "radix",
                                                                       "sort", "histc", "bincount")),
    # torch's foreach copy: in a bench step (no optimizer), the CUDA graph trees copying each
    # replay's inputs that no earlier graph produced into the graph's own buffers
    ("foreach copies (CUDA graph inputs)", ("native::copy<",)),
    # Megatron's DDP adds each micro-batch's bf16 gradient into the float32 main gradient, one
    # eager add per parameter: torch's casting (unrolled, not vectorised) elementwise kernel
    ("gradient accumulation (bf16 into fp32 main grads)", (("cudafunctor_add<float>", "loadwithcast"),)),
    ("multi-tensor (optimizer: Adam, grad norm and scale)", ("multi_tensor",)),
    ("copies and fills", ("memcpy", "memset", "copy_kernel", "fillfunctor")),
    ("other compiled (Inductor)", ("triton_",)),
    ("other eager elementwise / reductions", ("elementwise", "reduce_kernel")),
)


def kernel_kind(name: str) -> str:
    """The `KERNEL_KINDS` kind of a GPU kernel's name ("other" when none matches): a rough
    grouping by name, enough to say where a step's GPU time goes."""
    low = name.lower()

    def hit(pattern: str | tuple[str, ...]) -> bool:
        return all(p in low for p in pattern) if isinstance(pattern, tuple) else pattern in low

    return next((kind for kind, keys in KERNEL_KINDS if any(hit(k) for k in keys)), "other")


def kernel_time_by_kind(kernels: list[tuple[float, float, str]]) -> dict[str, float]:
    """GPU milliseconds per `kernel_kind` of (start µs, end µs, name) activities, largest
    first (summed durations: kernels running side by side count twice)."""
    ms: dict[str, float] = {}
    for s, e, n in kernels:
        kind = kernel_kind(n)
        ms[kind] = ms.get(kind, 0.0) + (e - s) / 1e3
    return dict(sorted(ms.items(), key=lambda kv: -kv[1]))


def trace_activities(events: list[dict[str, Any]]) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of the GPU activities (kernels, copies, fills) of a chrome trace."""
    return [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), str(e.get("name", "")))
            for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def summarize_timelines(paths: list[str]) -> list[dict[str, Any]]:
    """`--summarize`: for saved timelines (`--timeline`'s .json.gz), the step's span, busy and
    idle time and its GPU time by kernel kind; printed side by side, and returned."""
    import gzip

    rows = []
    for path in paths:
        raw = Path(path).read_bytes()
        events = json.loads(gzip.decompress(raw) if path.endswith(".gz") else raw).get("traceEvents", [])
        acts = trace_activities(events)
        gaps = idle_gaps(acts, MARKER_KERNEL)
        rows.append({"timeline": path, "span_ms": gaps["span_us"] / 1e3, "busy_ms": gaps["busy_us"] / 1e3,
                     "idle_ms": gaps["idle_us"] / 1e3, "kernel_ms": kernel_time_by_kind(acts)})
    kinds = sorted({k for r in rows for k in r["kernel_ms"]}, key=lambda k: -max(r["kernel_ms"].get(k, 0.0)
                                                                                 for r in rows))
    width = max([len(k) for k in kinds] + [24])
    names = [Path(r["timeline"]).name.removesuffix(".gz").removesuffix(".json").removeprefix("timeline-")[-28:]
             for r in rows]
    print(" " * width + "".join(f"  {n:>28s}" for n in names))
    for label, key in (("step span (ms)", "span_ms"), ("GPU busy (ms)", "busy_ms"), ("GPU idle (ms)", "idle_ms")):
        print(f"{label:{width}s}" + "".join(f"  {r[key]:28.2f}" for r in rows))
    for k in kinds:
        print(f"{k:{width}s}" + "".join(f"  {r['kernel_ms'].get(k, 0.0):28.2f}" for r in rows))
    return rows


def gpu_timeline(step: Any, name: str, out_dir: Path, top: int = 15) -> dict[str, Any]:
    """Profile one step with CUDA activity only (no per-op host instrumentation, so the host
    keeps its own pace) and report where its GPU sat idle (`idle_gaps`); a marker kernel is
    queued where the forward and loss have been queued. The trace goes to
    `out_dir/timeline-<n>-<name>.json.gz` (chrome://tracing, Perfetto)."""
    import gzip
    import tempfile

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    _FORWARD_DONE[:] = [lambda: torch.cuda._sleep(1)]
    try:
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
    finally:
        _FORWARD_DONE.clear()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        raw = path.read_bytes()
    acts = trace_activities(json.loads(raw).get("traceEvents", []))
    r = idle_gaps(acts, MARKER_KERNEL)
    r["kernel_ms"] = kernel_time_by_kind(acts)
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
    out_dir.mkdir(parents=True, exist_ok=True)
    _TIMELINES.append(name)  # a variant measured twice (pairs) keeps both traces
    (out_dir / f"timeline-{len(_TIMELINES)}-{safe}.json.gz").write_bytes(gzip.compress(raw))
    fwd = (f"; forward {r['forward_span_us'] / 1e3:.1f} ms with {r['forward_idle_us'] / 1e3:.1f} ms idle"
           if "forward_span_us" in r else "")
    print(f"--- {name}: one step on the GPU: {r['span_us'] / 1e3:.1f} ms, busy {r['busy_us'] / 1e3:.1f} ms, "
          f"idle {r['idle_us'] / 1e3:.1f} ms in {len(r['gaps'])} gaps of >= 5 us{fwd}", flush=True)
    print("  GPU ms by kind: " + ", ".join(f"{k} {v:.2f}" for k, v in r["kernel_ms"].items()), flush=True)
    for g in r["gaps"][:top]:
        print(f"  {g['gap_us']:8.1f} us at {g['at_us'] / 1e3:7.2f} ms  after {g['after'][:60]}  "
              f"before {g['before'][:60]}", flush=True)
    r["gaps"] = r["gaps"][:50]
    return r


CPROFILE_TOP = 0  # > 0: print the top Python functions (by own time) of 5 steps (--cprofile N)


def host_profile(step: Any, name: str) -> None:
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(5):
        step()
    if CUDA:
        torch.cuda.synchronize()
    pr.disable()
    print(f"--- {name}: top {CPROFILE_TOP} Python functions by own time (5 steps)")
    pstats.Stats(pr).sort_stats("tottime").print_stats(CPROFILE_TOP)
    print(f"--- {name}: top {CPROFILE_TOP} Python functions by time with callees (5 steps)")
    pstats.Stats(pr).sort_stats("cumulative").print_stats(CPROFILE_TOP)
    # the whole profile, for `python -m pstats` or snakeviz elsewhere
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    pr.dump_stats(OUT_DIR / f"cprofile-{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}.prof")


OUT_DIR = Path("bench/results")  # --out
SYNC_DEBUG = False  # --sync-debug: list the calls of one step that wait for the GPU


def sync_points(step: Any, name: str) -> list[str]:
    """Where one step makes the host wait for the GPU (torch's sync debug mode), by call site."""
    import collections
    import traceback
    import warnings

    sites: collections.Counter[str] = collections.Counter()

    def hook(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if "synchroniz" not in str(message):  # other warnings of the step are not syncs
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        inner = [f for f in frames if "/torch/" not in f.filename][-2:]
        sites[" <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(inner))] += 1

    old = warnings.showwarning
    warnings.showwarning = hook
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = hook
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = old
    out = [f"{n:4d}  {site}" for site, n in sites.most_common()]
    print(f"--- {name}: {sum(sites.values())} host syncs in one step", *out, sep="\n", flush=True)
    return out


MANUAL_GC = False  # --manual-gc: no automatic Python collections during the timed steps
_FORWARD_DONE: list[Any] = []  # set by `timed`: what `forward_queued` calls


def forward_queued() -> None:
    """Called by every variant's step once its forward and loss are queued, before the
    backward: `timed` notes the host time and records a CUDA event there, so each step's
    forward is measured on both sides (host: until queued; GPU: until it got there)."""
    if _FORWARD_DONE:
        _FORWARD_DONE[0]()


def timed(step: Any, iters: int, warmup: int) -> dict[str, list[float]]:
    """Wall seconds per step, and host seconds (until the step has queued its last kernel:
    close to the wall time means the step is bound by Python / kernel launches), and the
    host seconds each step spent in Python's garbage collector."""
    import gc

    warm = []
    for i in range(warmup):  # the first steps compile (Inductor, Triton, TileLang): shown, not timed
        t0 = time.perf_counter()
        step()
        if CUDA:
            torch.cuda.synchronize()
        warm.append(time.perf_counter() - t0)
        print(f"  warm-up step {i + 1}: {warm[-1]:.2f} s", flush=True)
    times, host, gc_s = [], [], []
    spent = {"s": 0.0, "t0": 0.0, "gen2": 0}

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            spent["t0"] = time.perf_counter()
        else:
            spent["s"] += time.perf_counter() - spent["t0"]
            spent["gen2"] += info["generation"] == 2

    if MANUAL_GC:  # what a trainer with manual collection does between steps
        gc.collect()
        gc.freeze()
        gc.disable()
    gc.callbacks.append(on_gc)
    fwd_host, fwd_gpu, mark = [], [], {}

    def on_forward() -> None:
        mark["host"] = time.perf_counter()
        if CUDA:
            mark["event"] = torch.cuda.Event(enable_timing=True)
            mark["event"].record()

    _FORWARD_DONE[:] = [on_forward]
    try:
        for _ in range(iters):
            start = None
            if CUDA:
                torch.cuda.synchronize()
                start = torch.cuda.Event(enable_timing=True)
                start.record()  # the GPU is idle: it reaches this at once
            spent["s"] = 0.0
            mark.clear()
            t0 = time.perf_counter()
            step()
            host.append(time.perf_counter() - t0)
            if CUDA:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            gc_s.append(spent["s"])
            if "host" in mark:
                fwd_host.append(mark["host"] - t0)
                if start is not None:
                    fwd_gpu.append(start.elapsed_time(mark["event"]) / 1e3)
    finally:
        _FORWARD_DONE.clear()
        gc.callbacks.remove(on_gc)
        if MANUAL_GC:
            gc.enable()
            gc.unfreeze()
    print(f"  Python GC: {statistics.median(gc_s) * 1e3:.2f} ms per step (median), "
          f"{sum(gc_s) * 1e3:.1f} ms over {iters} steps, {spent['gen2']} full collections", flush=True)
    # back to back: as many steps again without waiting for the GPU between them, as a trainer
    # runs its micro-batches: the host may queue a step's forward while the GPU still runs the
    # last backward (an implementation that reads from the GPU inside a step cannot)
    if CUDA:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    if CUDA:
        torch.cuda.synchronize()
    back_to_back = (time.perf_counter() - t0) / iters
    print(f"  back to back: {back_to_back * 1e3:.1f} ms per step over {iters} steps", flush=True)
    out = {"times": times, "host_times": host, "gc_times": gc_s, "back_to_back_s": back_to_back, "warmup_s": warm}
    if fwd_host:
        out["forward_host_times"] = fwd_host
        line = f"  forward + loss: queued by the host at {statistics.median(fwd_host) * 1e3:.1f} ms"
        if fwd_gpu:
            out["forward_gpu_times"] = fwd_gpu
            line += (f", done on the GPU at {statistics.median(fwd_gpu) * 1e3:.1f} ms (medians; close to the "
                     "host's: the forward waits for launches)")
        print(line, flush=True)
    return out


def token_layout(ids: torch.Tensor, samples: int) -> list[int]:
    """[samples, tokens per sample]: what both sides of a pair train on. vlmrl packs the
    samples into one varlen sequence; HF takes them as the rows of one batch (equal lengths, no
    padding): the same tokens, the same next-token targets and the same attention work."""
    if samples < 1 or ids.numel() % samples:
        raise ValueError(f"--seq {ids.numel()} does not split into --samples {samples} equal samples")
    return [samples, ids.numel() // samples]


class HFKernelLog:
    """What transformers says about its kernels while a model is built and first run: the
    availability of the fast paths it looks for, and every warning it logs (e.g. falling back
    to a torch convolution without causal_conv1d)."""

    def __init__(self) -> None:
        import logging

        from transformers.utils import import_utils

        self.available = {name: bool(getattr(import_utils, f"is_{name}_available", lambda: False)())
                          for name in ("flash_linear_attention", "causal_conv1d", "flash_attn_2")}
        self.messages: list[str] = []
        self._handler = logging.Handler(logging.WARNING)
        self._handler.emit = lambda record: self.messages.append(record.getMessage()[:300])  # type: ignore[method-assign]
        self._logger = logging.getLogger("transformers")

    def __enter__(self) -> HFKernelLog:
        self._logger.addHandler(self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._logger.removeHandler(self._handler)

    def report(self) -> dict[str, Any]:
        return {"available": self.available, "warnings": sorted(set(self.messages))}


def bench_hf(mcfg: Any, ids: torch.Tensor, iters: int, warmup: int, samples: int = 1) -> dict[str, Any]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    lm = mcfg.lm
    cfg = Qwen2Config(vocab_size=lm.vocab_size, hidden_size=lm.hidden_size, intermediate_size=lm.ffn_hidden_size,
                      num_hidden_layers=lm.num_layers, num_attention_heads=lm.num_attention_heads,
                      num_key_value_heads=lm.num_query_groups, tie_word_embeddings=True,
                      max_position_embeddings=32768, attn_implementation="sdpa")
    log = HFKernelLog()
    with log:
        model = Qwen2ForCausalLM(cfg).to(device=DEVICE, dtype=torch.bfloat16 if CUDA else torch.float32).train()
    x = ids.view(*token_layout(ids, samples)).to(DEVICE)

    def step() -> None:
        out = model(input_ids=x, labels=x)
        forward_queued()
        out.loss.backward()
        model.zero_grad(set_to_none=True)

    with log:
        r = timed(step, iters, warmup)
    r["hf_kernels"] = log.report()
    if TIMELINE and CUDA:
        r["timeline"] = gpu_timeline(step, "hf_sdpa", OUT_DIR)
    if PROFILE_TOP:
        profile(step, "hf_sdpa")
    if CPROFILE_TOP:
        host_profile(step, "hf_sdpa")
    return {**r, "params": params_of(model)}


# the seed of the HF Qwen3.5-MoE weights, which vlmrl's model loads too (`hf_qwen35_moe_model`)
HF_WEIGHTS_SEED = 1234


def hf_qwen35_moe_model(mcfg: Any) -> Any:
    """transformers' `Qwen3_5MoeForCausalLM` of the bench's shape with HF's own initialisation
    from a fixed seed, on the device in bf16 (float32 on the CPU): the same weights at every
    call. Both sides of the pair train these, so neither gets a luckier routing (the
    router's weights decide how many tokens each expert gets, and so the grouped GEMMs'
    shapes) from its own random draw."""
    from transformers import Qwen3_5MoeForCausalLM

    from ..models.bridge import hf_config

    text = hf_config(mcfg).text_config
    text._attn_implementation = "sdpa"
    torch.manual_seed(HF_WEIGHTS_SEED)
    with torch.device(DEVICE):
        model = Qwen3_5MoeForCausalLM(text)
    return model.to(dtype=torch.bfloat16 if CUDA else torch.float32)


def load_hf_language_model(model: torch.nn.Module, mcfg: Any, hf_lm: torch.nn.Module) -> int:
    """Copy an HF text model's weights (`model.*` in-memory names, `lm_head.weight`) into the
    language model of vlmrl's Megatron model on one rank, through the loading path
    (`adapters.load_hf_weights`: checkpoint names, fused QKV, grouped GDN projections,
    per-expert slices); the vision tower keeps its weights. Returns the tensors copied."""
    from ..models.adapters import load_hf_weights

    lm = "model.language_model."
    hf = {(lm + k[len("model."):] if k.startswith("model.") else k): v for k, v in hf_lm.state_dict().items()}
    return load_hf_weights([model], mcfg, hf, language_model_only=True)


def bench_hf_qwen35_moe(mcfg: Any, ids: torch.Tensor, iters: int, warmup: int, samples: int = 1) -> dict[str, Any]:
    log = HFKernelLog()
    with log:
        model = hf_qwen35_moe_model(mcfg).train()
    x = ids.view(*token_layout(ids, samples)).to(DEVICE)

    def step() -> None:
        out = model(input_ids=x, labels=x, use_cache=False)
        forward_queued()
        out.loss.backward()
        model.zero_grad(set_to_none=True)

    with log:
        r = timed(step, iters, warmup)
    r["hf_kernels"] = log.report()
    print(f"hf_qwen35_moe kernels: {r['hf_kernels']}", flush=True)
    if TIMELINE and CUDA:
        r["timeline"] = gpu_timeline(step, "hf_qwen35_moe", OUT_DIR)
    if PROFILE_TOP:
        profile(step, "hf_qwen35_moe")
    if SYNC_DEBUG and CUDA:
        r["sync_points"] = sync_points(step, "hf_qwen35_moe")
    return {**r, "params": params_of(model)}


def vlmrl_variant_options(variant: str) -> dict[str, Any]:
    """`cuda_graphs` and `attention` of a vlmrl variant's name (`_graphs`, `_flash4`)."""
    base = variant.removesuffix("_flash4")
    return {"cuda_graphs": base.endswith("_graphs"), "attention": "flash4" if base != variant else "sdpa"}


def bench_vlmrl(mcfg: Any, ids: torch.Tensor, samples: int, iters: int, warmup: int,
                fused: bool, gdn_backend: str = "torch", cuda_graphs: bool = False,
                attention: str = "sdpa") -> dict[str, Any]:
    from ..config.schema import ParallelConfig
    from ..models.bridge import build_model
    from ..models.kernels import begin_graph_step
    from ..training.batch import TrainSample, build_micro_batch
    from ..training.logprobs import logprobs_and_entropy
    from ..training.parallel_state import destroy_parallel_state, init_parallel_state

    parallel = ParallelConfig(name="bench")
    init_parallel_state(parallel, backend="nccl" if CUDA else "gloo", seed=0)
    dtype = torch.bfloat16 if CUDA else torch.float32
    if gdn_backend == "fla":
        from ..models.gated_delta import check_model_fast_path

        worst = check_model_fast_path(mcfg.lm, torch.device(DEVICE), dtype)  # as the trainer checks (one rank)
        print(f"fla Gated DeltaNet check vs torch: worst relative difference {worst:.2e}", flush=True)
    chunks = build_model(mcfg, parallel, params_dtype=dtype, attention_backend=attention,
                         fused_kernels=fused, gdn_backend=gdn_backend, cuda_graphs=cuda_graphs)
    model = chunks[0].train()
    if mcfg.lm.num_experts:  # the HF variant's weights (`hf_qwen35_moe_model`)
        hf_lm = hf_qwen35_moe_model(mcfg)
        copied = load_hf_language_model(model, mcfg, hf_lm)
        del hf_lm
        if CUDA:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        print(f"vlmrl: {copied} language-model tensors loaded from the HF variant's weights", flush=True)
    _, per = token_layout(ids, samples)
    batch = [TrainSample(input_ids=ids[i * per:(i + 1) * per].tolist(),
                         loss_mask=[0.0] + [1.0] * (per - 1)) for i in range(samples)]
    mb = build_micro_batch(batch, image_token_id=mcfg.image_token_id, spatial_merge_size=2, bucket=cuda_graphs)
    packed = mb.packed  # host-side, as the trainer passes it (the model moves what it needs)
    targets, mask = mb.targets.to(DEVICE), mb.loss_mask.to(DEVICE)

    def step() -> None:
        if cuda_graphs:
            begin_graph_step()
        logits = model(packed)
        logp, _ = logprobs_and_entropy(logits, targets, with_entropy=False, fused=fused)
        loss = -(logp * mask).sum() / mask.sum()
        forward_queued()
        loss.backward()
        model.zero_grad(set_to_none=True)

    r = timed(step, iters, warmup)
    label = f"vlmrl (fused={fused}, cuda_graphs={cuda_graphs}{', flash4' if attention == 'flash4' else ''})"
    if cuda_graphs and CUDA:
        from ..models.kernels import cuda_graph_stats

        r["cuda_graphs"] = cuda_graph_stats()
        print(f"CUDA graph trees: {r['cuda_graphs']}", flush=True)
    if TIMELINE and CUDA:
        r["timeline"] = gpu_timeline(step, label, OUT_DIR)
    if PROFILE_TOP:
        profile(step, label)
    if CPROFILE_TOP:
        host_profile(step, label)
    if SYNC_DEBUG and CUDA:
        r["sync_points"] = sync_points(step, label)
    n = sum(p.numel() for name, p in model.named_parameters() if "visual" not in name)
    destroy_parallel_state()
    return {**r, "params": n}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=("dense", "qwen35_moe"), default="dense")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=1,
                    help="equal samples the --seq tokens split into: packed into one sequence (vlmrl), the "
                         "rows of one batch (HF); the same attention work on both sides")
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=8960)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--variants", default=None,
                    help="dense: hf_sdpa,vlmrl_megatron,vlmrl_megatron_fused; qwen35_moe: hf_qwen35_moe,vlmrl_qwen35_moe")
    ap.add_argument("--gdn-backend", default="fla" if CUDA else "torch", choices=("torch", "fla"))
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--profile", type=int, default=0, help="print the top N ops of a profiled step")
    ap.add_argument("--manual-gc", action="store_true",
                    help="freeze the heap and disable Python's automatic GC during the timed steps (all variants)")
    ap.add_argument("--cprofile", type=int, default=0, help="print the top N Python functions (host time)")
    ap.add_argument("--sync-debug", action="store_true", help="list the host syncs of one step per variant")
    ap.add_argument("--summarize", nargs="+", metavar="TIMELINE", default=None,
                    help="print the step span, idle time and GPU time by kernel kind of saved timelines "
                         "(--timeline's .json.gz) side by side, and run nothing")
    ap.add_argument("--timeline", action="store_true",
                    help="profile one step per variant (GPU activity only): idle time, its largest gaps, "
                         "and the trace under --out")
    ap.add_argument("--compile-cache", default=None,
                    help="where the compilers keep their kernels (default: hardware.compile_cache_dir, "
                         "~/.cache/vlmrl/compile); '' for each library's own default")
    ap.add_argument("--stacks-every", type=float, default=0,
                    help="print every thread's Python stack every N seconds (where a slow warm-up spends its time)")
    args = ap.parse_args(argv)
    if args.summarize:
        summarize_timelines(args.summarize)
        return 0
    if args.stacks_every:
        import faulthandler

        faulthandler.dump_traceback_later(args.stacks_every, repeat=True)
    global PROFILE_TOP, CPROFILE_TOP, SYNC_DEBUG, MANUAL_GC, TIMELINE, OUT_DIR
    PROFILE_TOP, CPROFILE_TOP, SYNC_DEBUG = args.profile, args.cprofile, args.sync_debug
    TIMELINE, OUT_DIR = args.timeline, Path(args.out)
    MANUAL_GC = args.manual_gc

    cache = compile_cache(args.compile_cache)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    torch.manual_seed(0)
    if args.shape == "qwen35_moe":
        mcfg = qwen35_moe_config(layers=args.layers if args.layers != 28 else 8, vocab=args.vocab
                                 if args.vocab != 151936 else 248320)
        variants = args.variants or "hf_qwen35_moe,vlmrl_qwen35_moe"
    else:
        mcfg = model_config(args.hidden, args.layers, args.heads, args.kv, args.ffn, args.vocab)
        variants = args.variants or "hf_sdpa,vlmrl_megatron,vlmrl_megatron_fused"
    # below the vision special tokens (a random image placeholder would need an image)
    ids = torch.randint(0, min(mcfg.lm.vocab_size, mcfg.vision_start_token_id), (args.seq,))
    rows = []
    for variant in variants.split(","):
        if CUDA:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        if variant == "hf_sdpa":
            r = bench_hf(mcfg, ids, args.iters, args.warmup, args.samples)
        elif variant == "hf_qwen35_moe":
            r = bench_hf_qwen35_moe(mcfg, ids, args.iters, args.warmup, args.samples)
        elif variant.startswith("vlmrl_qwen35_moe"):
            r = bench_vlmrl(mcfg, ids, args.samples, args.iters, args.warmup, fused=CUDA,
                            gdn_backend=args.gdn_backend, **vlmrl_variant_options(variant))
        else:
            r = bench_vlmrl(mcfg, ids, args.samples, args.iters, args.warmup, fused="fused" in variant,
                            **vlmrl_variant_options(variant))
        med = statistics.median(r["times"])
        if args.shape == "qwen35_moe":
            fpt = flops_per_token_of(mcfg, args.seq)
        else:
            embed = args.vocab * args.hidden
            fpt = flops_per_token(r["params"] - embed, args.layers, args.hidden, args.seq) + 6 * embed
        rows.append({"variant": variant, "median_s": med, "host_median_s": statistics.median(r["host_times"]),
                     "gc_median_s": statistics.median(r["gc_times"]),
                     # forward + loss: host seconds until queued, and (CUDA) until the GPU got there
                     **{f"{k[:-6]}_median_s": statistics.median(r[k])
                        for k in ("forward_host_times", "forward_gpu_times") if r.get(k)},
                     "tokens_per_s": args.seq / med,
                     "back_to_back_step_s": r["back_to_back_s"],
                     "tokens_per_s_back_to_back": args.seq / r["back_to_back_s"],
                     "tflops": fpt * args.seq / med / 1e12, "mfu_vs_788": fpt * args.seq / med / 788e12,
                     "params": r["params"], "token_layout": token_layout(ids, args.samples),
                     "warmup_step_s": r["warmup_s"],
                     "spread_s": [min(r["times"]), max(r["times"])],
                     "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if CUDA else None,
                     **{k: r[k] for k in ("sync_points", "cuda_graphs", "timeline", "hf_kernels") if k in r}})
        print(f"{variant:24s} {args.seq / med:10.0f} tok/s {rows[-1]['tflops']:7.1f} TFLOP/s "
              f"median {med * 1e3:.1f} ms (host {rows[-1]['host_median_s'] * 1e3:.1f} ms) "
              f"peak {rows[-1]['peak_memory_gib'] or 0:.1f} GiB", flush=True)
    add_ratios(rows)
    result = {
        "command": "python -m vlmrl.bench.train_gpu " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name(0) if CUDA else "cpu", "torch": torch.__version__,
        "args": vars(args), "model": dataclasses.asdict(mcfg.lm), "compile_cache": cache,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"train_gpu_{args.shape}.json").write_text(json.dumps(result, indent=2))
    print("variant, vs HF (row before), back to back; vs HF's first instance, back to back")
    print(json.dumps([[r["variant"], round(r["vs_hf"] or 0, 3), round(r["vs_hf_back_to_back"] or 0, 3),
                       round(r["vs_first_hf"] or 0, 3), round(r["vs_first_hf_back_to_back"] or 0, 3)]
                      for r in rows]))
    return 0


def compile_cache(root: str | None) -> dict[str, Any]:
    """Point this process's compilers at `root` (None: the config's `hardware.compile_cache_dir`)
    as a run's processes are, and say how warm it was: the files it held before the first
    compile (0 on a fresh machine; a warm-up figure means little without it)."""
    from ..models.kernels import COMPILE_CACHE_VARS, compile_cache_env

    if root is None:
        from ..config import load

        root = load([]).hardware.compile_cache_dir
    env = compile_cache_env(root)
    os.environ.update(env)
    dirs = {k: os.environ[k] for k in COMPILE_CACHE_VARS if k in os.environ}
    files = {k: sum(len(f) for _, _, f in os.walk(d)) for k, d in dirs.items()}
    print(f"compile caches: {dirs or 'each library default'}; files before the first compile: {files}", flush=True)
    return {"root": root, "set": env, "dirs": dirs, "files_at_start": files}


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's tokens/s (per-step medians and back to back) as a ratio to an HF row's:
    `vs_hf*` to the HF row measured last before it (pairs: --variants a,b,a,b), and
    `vs_first_hf*` to the first HF row of the run.

    The first HF instance ran before any vlmrl model, compile cache or CUDA graph pool
    existed in the process. A later HF instance has run 10-25% slower on the host there
    (2026-12-02, the same GPU work): a ratio to it flatters vlmrl.

    A pair whose sides trained other token layouts (`token_layout`) is refused: ValueError."""
    base = first = None
    for r in rows:
        if r["variant"].startswith("hf_"):
            base = r
            first = first or r
        for ref in (base, first):
            if ref is not None and ref.get("token_layout") != r.get("token_layout"):
                raise ValueError(f"{r['variant']} trained {r.get('token_layout')} (samples, tokens) and "
                                 f"{ref['variant']} {ref.get('token_layout')}: not a pair on equal work")
        for key, ref in (("vs_hf", base), ("vs_first_hf", first)):
            r[key] = r["tokens_per_s"] / ref["tokens_per_s"] if ref else None
            r[f"{key}_back_to_back"] = (r["tokens_per_s_back_to_back"] / ref["tokens_per_s_back_to_back"]
                                        if ref else None)


if __name__ == "__main__":
    sys.exit(main())
