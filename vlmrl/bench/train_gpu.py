"""Training throughput on one GPU: vlmrl's Megatron path against HF transformers + SDPA.

Same dense Qwen2.5 language-model shape (~1.5B parameters), same tokens (one packed
sequence of `--seq` tokens, `--samples` samples), bf16, one forward + backward with a
next-token loss over the full vocabulary, after warm-up; median of `--iters` steps.

    python -m vlmrl.bench.train_gpu --seq 4096 --out bench/results

Variants (all on the same weights' shapes):
- hf_sdpa: `Qwen2ForCausalLM`-shaped HF text model (Qwen2.5-VL's language model),
  attn_implementation="sdpa", one padded-free batch row of `seq` tokens.
- vlmrl_megatron: the bridge's Megatron model (fused QKV and gate/up GEMMs, flash varlen
  attention on the packed sequence), loss through vlmrl's vocab-parallel logprobs.
- vlmrl_megatron_fused: the same with `hardware.fused_kernels=true` (the GPU hardware
  configs' setting): Inductor-compiled RMSNorm, M-RoPE and log-softmax
  (`vlmrl.models.kernels`) and megatron-core's compiled SwiGLU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
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


def params_of(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_token(n_params_no_embed: int, layers: int, hidden: int, seq: int) -> float:
    """6N for the matmuls plus causal attention (6 * layers * hidden * seq per token)."""
    return 6 * n_params_no_embed + 6 * layers * hidden * seq


CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"  # CPU: a smoke test of the script with a small shape


PROFILE_TOP = 0  # > 0: print the top kernels of a profiled step per variant (--profile N)


def profile(step: Any, name: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(2):
            step()
        if CUDA:
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if CUDA else "self_cpu_time_total"
    print(f"--- {name}: top {PROFILE_TOP} ops by {key} (2 steps)")
    print(prof.key_averages().table(sort_by=key, row_limit=PROFILE_TOP, max_name_column_width=60))


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


def timed(step: Any, iters: int, warmup: int) -> dict[str, list[float]]:
    """Wall seconds per step, and host seconds (until the step has queued its last kernel:
    close to the wall time means the step is bound by Python / kernel launches)."""
    for _ in range(warmup):
        step()
    times, host = [], []
    for _ in range(iters):
        if CUDA:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        host.append(time.perf_counter() - t0)
        if CUDA:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"times": times, "host_times": host}


def bench_hf(mcfg: Any, ids: torch.Tensor, iters: int, warmup: int) -> dict[str, Any]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    lm = mcfg.lm
    cfg = Qwen2Config(vocab_size=lm.vocab_size, hidden_size=lm.hidden_size, intermediate_size=lm.ffn_hidden_size,
                      num_hidden_layers=lm.num_layers, num_attention_heads=lm.num_attention_heads,
                      num_key_value_heads=lm.num_query_groups, tie_word_embeddings=True,
                      max_position_embeddings=32768, attn_implementation="sdpa")
    model = Qwen2ForCausalLM(cfg).to(device=DEVICE, dtype=torch.bfloat16 if CUDA else torch.float32).train()
    x = ids.view(1, -1).to(DEVICE)

    def step() -> None:
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        model.zero_grad(set_to_none=True)

    r = timed(step, iters, warmup)
    if PROFILE_TOP:
        profile(step, "hf_sdpa")
    if CPROFILE_TOP:
        host_profile(step, "hf_sdpa")
    return {**r, "params": params_of(model)}


def bench_vlmrl(mcfg: Any, ids: torch.Tensor, samples: int, iters: int, warmup: int,
                fused: bool) -> dict[str, Any]:
    from ..config.schema import ParallelConfig
    from ..models.bridge import build_model
    from ..training.batch import TrainSample, build_micro_batch
    from ..training.logprobs import logprobs_and_entropy
    from ..training.parallel_state import destroy_parallel_state, init_parallel_state

    parallel = ParallelConfig(name="bench")
    init_parallel_state(parallel, backend="nccl" if CUDA else "gloo", seed=0)
    chunks = build_model(mcfg, parallel, params_dtype=torch.bfloat16 if CUDA else torch.float32, attention_backend="sdpa",
                         fused_kernels=fused)
    model = chunks[0].train()
    per = ids.numel() // samples
    batch = [TrainSample(input_ids=ids[i * per:(i + 1) * per].tolist(),
                         loss_mask=[0.0] + [1.0] * (per - 1)) for i in range(samples)]
    mb = build_micro_batch(batch, image_token_id=mcfg.image_token_id, spatial_merge_size=2)
    packed = mb.packed  # host-side, as the trainer passes it (the model moves what it needs)
    targets, mask = mb.targets.to(DEVICE), mb.loss_mask.to(DEVICE)

    def step() -> None:
        logits = model(packed)
        logp, _ = logprobs_and_entropy(logits, targets, with_entropy=False, fused=fused)
        loss = -(logp * mask).sum() / mask.sum()
        loss.backward()
        model.zero_grad(set_to_none=True)

    r = timed(step, iters, warmup)
    if PROFILE_TOP:
        profile(step, f"vlmrl (fused={fused})")
    if CPROFILE_TOP:
        host_profile(step, f"vlmrl (fused={fused})")
    n = sum(p.numel() for name, p in model.named_parameters() if "visual" not in name)
    destroy_parallel_state()
    return {**r, "params": n}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=1, help="samples packed into the sequence (vlmrl)")
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=8960)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--variants", default="hf_sdpa,vlmrl_megatron,vlmrl_megatron_fused")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--profile", type=int, default=0, help="print the top N ops of a profiled step")
    ap.add_argument("--cprofile", type=int, default=0, help="print the top N Python functions (host time)")
    args = ap.parse_args(argv)
    global PROFILE_TOP, CPROFILE_TOP
    PROFILE_TOP, CPROFILE_TOP = args.profile, args.cprofile

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    torch.manual_seed(0)
    mcfg = model_config(args.hidden, args.layers, args.heads, args.kv, args.ffn, args.vocab)
    # below the vision special tokens (a random image placeholder would need an image)
    ids = torch.randint(0, min(args.vocab, mcfg.vision_start_token_id), (args.seq,))
    rows = []
    for variant in args.variants.split(","):
        if CUDA:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        if variant == "hf_sdpa":
            r = bench_hf(mcfg, ids, args.iters, args.warmup)
        else:
            r = bench_vlmrl(mcfg, ids, args.samples, args.iters, args.warmup, fused="fused" in variant)
        med = statistics.median(r["times"])
        embed = args.vocab * args.hidden
        fpt = flops_per_token(r["params"] - embed, args.layers, args.hidden, args.seq) + 6 * embed
        rows.append({"variant": variant, "median_s": med, "host_median_s": statistics.median(r["host_times"]),
                     "tokens_per_s": args.seq / med,
                     "tflops": fpt * args.seq / med / 1e12, "params": r["params"],
                     "spread_s": [min(r["times"]), max(r["times"])],
                     "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if CUDA else None})
        print(f"{variant:24s} {args.seq / med:10.0f} tok/s {rows[-1]['tflops']:7.1f} TFLOP/s "
              f"median {med * 1e3:.1f} ms (host {rows[-1]['host_median_s'] * 1e3:.1f} ms) "
              f"peak {rows[-1]['peak_memory_gib'] or 0:.1f} GiB", flush=True)
    base = next((r for r in rows if r["variant"] == "hf_sdpa"), None)
    for r in rows:
        r["vs_hf"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
    result = {
        "command": "python -m vlmrl.bench.train_gpu " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name(0) if CUDA else "cpu", "torch": torch.__version__,
        "shape": vars(args), "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_gpu.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({r["variant"]: round(r["vs_hf"] or 0, 3) for r in rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
