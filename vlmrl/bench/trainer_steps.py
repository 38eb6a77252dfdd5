"""Warm-up inside a run: the trainer's first RL steps against its steady state.

The loop's trainer (`TrainerWorker` -> `MegatronTrainer`, one rank, the hardware config's
fast paths: on a GPU `hardware=h200`, i.e. compiled layers, the compiled MoE block and fla's
Gated DeltaNet) takes GRPO steps on batches shaped like rollouts: every step draws new
prompt and response lengths, so the packed micro-batches change length and layout from
step to step as they do in training. Step 1 pays torch.compile (graphs generic in the token
count, `vlmrl.models.kernels.fused`, so a new length compiles nothing), and fla / TileLang
kernels compile on first use; after that a step costs what it costs.

    python -m vlmrl.bench.trainer_steps --model qwen35_moe --steps 12 --out $OUT     (GPU)
    python -m vlmrl.bench.trainer_steps --model tiny --device cpu --steps 4          (CPU: the script's own check)
    python -m vlmrl.bench.trainer_steps --model qwen35_moe --steps 8 --profile 25 --sync-debug --timeline --out $OUT
                                    (then one more step per diagnostic: where a steady step's time goes)

Reports per step: wall seconds, tokens, tokens/s, the micro-batches and the padding tokens
they carried (`perf/micro_batches`, `perf/pad_tokens`), the number of graphs Dynamo has
compiled so far and, with `hardware.cuda_graphs`, the CUDA graphs recorded so far (one set per
token bucket: recording is warm-up too); then warm-up seconds = sum over steps of (step time -
steady step time per token x step tokens), the steady rate being the median tokens/s of the
second half of the steps, and the time to the end of the first step from the trainer's start
(init included: on a fresh machine that is where FlashQLA's kernels compile, in the Gated
DeltaNet check). The compilers keep their kernels under `--compile-cache` (default
`hardware.compile_cache_dir`, as in a run); the JSON says how many files each cache held at
the start (0: a cold machine). `--profile` also records the trainer's phases (host ms).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def batch(rng: random.Random, n: int, vocab: tuple[int, int], prompt: tuple[int, int],
          response: tuple[int, int]) -> list:
    from ..training.batch import TrainSample

    out = []
    for _ in range(n):
        p, r = rng.randint(*prompt), rng.randint(*response)
        ids = [rng.randrange(*vocab) for _ in range(p + r)]
        out.append(TrainSample(input_ids=ids, loss_mask=[0.0] * p + [1.0] * r, advantage=rng.uniform(-1, 1)))
    return out


def _log_sink(loggers: list[str], pick: Any) -> list[str]:
    """A list that fills, from now on, with `pick(message)` of every record the named loggers
    emit (records for which `pick` gives None are left out)."""
    import logging

    kept: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            item = pick(record.getMessage())
            if item is not None:
                kept.append(item)

    for name in loggers:
        logging.getLogger(name).addHandler(Keep())
    return kept


def recompile_log() -> list[str] | None:
    """From now on, every message Dynamo logs when a compiled function compiles again: which
    function, and the guard that failed (a shape it had specialised on, an int that changed).
    The list fills as they come; torch also prints them (its `recompiles` logs, switched on).
    None where this torch has no such log (the steps then say nothing about recompiles)."""
    import logging

    import torch
    import torch._dynamo  # noqa: F401  (its modules create the artifact loggers)

    torch._logging.set_logs(recompiles=True)
    names = [n for n in logging.root.manager.loggerDict if n.endswith(".__recompiles")]
    if not names:
        print("torch has no `recompiles` log here: the steps will not say what compiled again", file=sys.stderr)
        return None
    return _log_sink(names, lambda message: message)


# TileLang's log line at the start of each kernel it JIT-compiles (FlashQLA's Gated DeltaNet kernels)
TILELANG_COMPILE = "begins to compile kernel"


def kernel_compile_log() -> list[str]:
    """From now on, the name of every kernel TileLang compiles (from its log; kernels found in
    its disk cache are not compiled and not listed). Dynamo's recompile log does not see these,
    and a compile of one costs 10-20 s of a step on the H200."""

    def kernel_name(message: str) -> str | None:
        if TILELANG_COMPILE not in message:
            return None
        return message.split("`")[1] if message.count("`") >= 2 else message

    return _log_sink(["tilelang"], kernel_name)  # its module loggers propagate to "tilelang"


def quiet_steps(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps in which nothing was compiled or recorded: no Dynamo graph compiled, anew or
    again, no TileLang kernel compiled, no CUDA graph recorded (a step that records graphs for a
    new token bucket runs its kernels eagerly and records them). Their rate is the trainer's
    once a run has met its shapes; the first step always compiles and is left out."""
    out = []
    for prev, row in zip(rows, rows[1:]):
        graphs = (row["cuda_graphs"] or {}).get("graphs"), (prev["cuda_graphs"] or {}).get("graphs")
        if (not row["recompiles"] and not row["kernel_compiles"] and graphs[0] == graphs[1]
                and row["graphs_compiled"] == prev["graphs_compiled"]):
            out.append(row)
    return out


def memory(device: str) -> dict[str, Any]:
    """The caching allocator's figures since the last call: peak allocated, reserved, and its
    retries (a retry frees every cached block and synchronises: a step near the memory limit
    pays for it in time); the peak is reset for the next step."""
    if device != "cuda":
        return {}
    import torch

    s = torch.cuda.memory_stats()
    torch.cuda.reset_peak_memory_stats()
    return {"peak_allocated_gib": s["allocated_bytes.all.peak"] / 2**30,
            "reserved_gib": s["reserved_bytes.all.current"] / 2**30,
            "alloc_retries": int(s["num_alloc_retries"]), "device_allocs": int(s.get("num_device_alloc", 0))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen35_moe", help="a model of vlmrl.bench.weight_sync (dense, qwen35_moe, tiny, ...)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--samples", type=int, default=16, help="samples per step")
    ap.add_argument("--prompt", default="200,600", help="prompt length range (tokens)")
    ap.add_argument("--response", default="64,1024", help="response length range (tokens)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides")
    ap.add_argument("--profile", type=int, default=0,
                    help="after the steps, profile one more step: the top N ops, and the trainer's phases")
    ap.add_argument("--sync-debug", action="store_true", help="after the steps, list the host syncs of one step (CUDA)")
    ap.add_argument("--timeline", action="store_true",
                    help="after the steps, where the GPU idles in one step (CUDA; the trace goes to --out)")
    ap.add_argument("--compile-cache", default=None,
                    help="where the compilers keep their kernels (default: hardware.compile_cache_dir); "
                         "'' for each library's own default")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = ap.parse_args(argv)
    from .train_gpu import compile_cache

    cache = compile_cache(args.compile_cache)  # before any compiler is imported
    dtype = "bfloat16" if args.device == "cuda" else "float32"

    import torch
    import torch._dynamo.utils

    from ..cluster.trainer_group import TrainerWorker
    from ..config import load
    from ..models.kernels import cuda_graph_stats
    from .weight_sync import trainer_overrides, write_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="vlmrl-steps-"))
    try:
        ckpt, overrides = write_checkpoint(args.model, tmp / "ckpt", dtype)
        cfg = load([*overrides, *trainer_overrides(args.device, dtype), *args.set], check_rules=False)
        worker = TrainerWorker(cfg, 0, 1, "127.0.0.1", None)
        t0 = time.perf_counter()
        worker.init(str(ckpt), total_steps=args.steps)
        init_s = time.perf_counter() - t0
        recompiles = recompile_log()  # the steps' recompiles (the start's checks compile first versions)
        kernel_compiles = kernel_compile_log()
        trainer = worker.trainer
        rng = random.Random(0)
        lo_p, hi_p = (int(v) for v in args.prompt.split(","))
        lo_r, hi_r = (int(v) for v in args.response.split(","))
        m = cfg.model  # text tokens only: ids above the vision special tokens
        vocab = (max(m.image_token_id, m.vision_start_token_id, m.vision_end_token_id) + 1, m.lm.vocab_size)
        rows = []
        for step in range(1, args.steps + 1):
            samples = batch(rng, args.samples, vocab, (lo_p, hi_p), (lo_r, hi_r))
            tokens = sum(s.num_tokens for s in samples)
            if args.device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            metrics = trainer.train_step(samples)
            if args.device == "cuda":
                torch.cuda.synchronize()
            sec = time.perf_counter() - t
            replays = cuda_graph_stats() if trainer.cuda_graphs else None
            mem = memory(args.device)
            rows.append({"step": step, "seconds": sec, "tokens": tokens, "tokens_per_s": tokens / sec,
                         "micro_batches": int(metrics["perf/micro_batches"]),
                         "pad_tokens": int(metrics["perf/pad_tokens"]),
                         "graphs_compiled": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
                         # what compiled again in this step, and why (first lines of each message)
                         "recompiles": None if recompiles is None else ["\n".join(m.splitlines()[:3])
                                                                        for m in recompiles],
                         "kernel_compiles": list(kernel_compiles),  # TileLang's, by kernel name
                         "cuda_graphs": replays, "loss": metrics.get("loss"), "grad_norm": metrics.get("grad_norm"),
                         **mem})
            print(f"step {step:3d}  {sec:7.2f} s  {tokens:6d} tokens  {tokens / sec:9.0f} tok/s  "
                  f"{rows[-1]['micro_batches']} micro-batches, {rows[-1]['pad_tokens']} padding  "
                  f"graphs {rows[-1]['graphs_compiled']}"
                  + (f"  CUDA graphs recorded {replays['graphs']}" if replays else "")
                  + (f"  TileLang compiled {', '.join(kernel_compiles)}" if kernel_compiles else "")
                  + (f"  peak {mem['peak_allocated_gib']:.1f} GiB, reserved {mem['reserved_gib']:.1f} GiB, "
                     f"allocator retries {mem['alloc_retries']}" if mem else ""), flush=True)
            if recompiles is not None:
                recompiles.clear()
            kernel_compiles.clear()
        diagnostics: dict[str, Any] = {}
        if args.profile or args.sync_debug or args.timeline:  # one more batch, stepped once per diagnostic
            from . import train_gpu

            extra = batch(rng, args.samples, vocab, (lo_p, hi_p), (lo_r, hi_r))

            def step() -> None:
                trainer.train_step(extra)

            if args.profile:
                diagnostics["phases_host_ms"] = train_gpu.profile(step, "trainer step", top=args.profile, steps=1,
                                                                  by_total=True)
            if args.sync_debug and args.device == "cuda":
                diagnostics["sync_points"] = train_gpu.sync_points(step, "trainer step")
            if args.timeline and args.device == "cuda":
                traced = diagnostics["timeline"] = train_gpu.gpu_timeline(step, "trainer-step", Path(args.out))
                # the same batch once more without the profiler, whose host cost stretches the
                # traced step: the GPU's busy time against the step's own
                torch.cuda.synchronize()
                t = time.perf_counter()
                step()
                torch.cuda.synchronize()
                plain = time.perf_counter() - t
                diagnostics["timeline_batch"] = {
                    "tokens": sum(s.num_tokens for s in extra), "step_s": plain,
                    "gpu_busy_fraction": traced["busy_us"] / 1e6 / plain}
                print(f"the traced batch without the profiler: {plain * 1e3:.1f} ms; the GPU was busy "
                      f"{traced['busy_us'] / 1e3:.1f} ms of it ({traced['busy_us'] / 1e6 / plain:.0%})", flush=True)
        steady_rows = rows[len(rows) // 2:]
        steady = statistics.median(r["tokens_per_s"] for r in steady_rows)
        warmup = sum(max(r["seconds"] - r["tokens"] / steady, 0.0) for r in rows)
        quiet = quiet_steps(rows)
        result = {
            "command": "python -m vlmrl.bench.trainer_steps " + " ".join(sys.argv[1:] if argv is None else argv),
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "device_name": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
            "torch": torch.__version__, "model": args.model, "init_s": init_s,
            "init_phases_s": trainer.init_phases_s, "steps": rows,
            "steady_tokens_per_s": steady, "warmup_s": warmup,
            "first_step_s": rows[0]["seconds"], "to_first_step_end_s": init_s + rows[0]["seconds"],
            "steady_step_s": statistics.median(r["seconds"] for r in steady_rows),
            "steady_pad_fraction": sum(r["pad_tokens"] for r in steady_rows)
            / sum(r["tokens"] + r["pad_tokens"] for r in steady_rows),
            "quiet_steps": [r["step"] for r in quiet],
            "quiet_tokens_per_s": statistics.median(r["tokens_per_s"] for r in quiet) if quiet else None,
            "samples_per_step": args.samples, "compile_cache": cache,
            **diagnostics,
        }
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"trainer_steps_{args.model}.json").write_text(json.dumps(result, indent=2))
        print(f"{args.model}: trainer init {init_s:.1f} s; step 1 {rows[0]['seconds']:.1f} s; steady "
              f"{steady:.0f} tok/s ({result['steady_step_s']:.2f} s/step); warm-up cost {warmup:.1f} s over "
              f"{args.steps} steps; first step done {result['to_first_step_end_s']:.1f} s after the trainer's "
              f"start; padding {result['steady_pad_fraction']:.1%} of the steady steps' tokens", flush=True)
        if quiet:
            print(f"{args.model}: {result['quiet_tokens_per_s']:.0f} tok/s (median) in the {len(quiet)} steps that "
                  f"compiled and recorded nothing: {result['quiet_steps']}", flush=True)
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
