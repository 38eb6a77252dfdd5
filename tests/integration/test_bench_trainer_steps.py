"""`python -m vlmrl.bench trainer-steps` on the CPU: the loop's trainer takes GRPO steps on
rollout-shaped batches that change length every step, and the bench reports them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_trainer_steps_bench_reports_real_steps(tmp_path):
    out = subprocess.run([sys.executable, "-m", "vlmrl.bench", "trainer-steps", "--model", "tiny", "--device", "cpu",
                          "--steps", "3", "--samples", "4", "--prompt", "20,40", "--response", "8,32",
                          "--profile", "40", "--compile-cache", str(tmp_path / "compile"), "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "trainer_steps_tiny.json").read_text())
    steps = result["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert len({s["tokens"] for s in steps}) == 3  # a new packing every step, as in RL
    assert all(s["seconds"] > 0 and s["grad_norm"] > 0 for s in steps)  # the policy was trained
    assert result["steady_tokens_per_s"] > 0 and result["warmup_s"] >= 0
    assert result["command"].startswith("python -m vlmrl.bench.trainer_steps")
    # what the packing cost: every step's micro-batches and padding (none on the CPU: no
    # CUDA-graph buckets, no CP / SP), and the time to the first step's end from the start
    assert all(s["micro_batches"] >= 1 and s["pad_tokens"] == 0 for s in steps)
    assert all(s["recompiles"] == [] for s in steps)  # nothing compiled (no fused kernels here)
    assert all(s["kernel_compiles"] == [] for s in steps)  # nor any TileLang kernel (no FlashQLA on a CPU)
    assert result["quiet_steps"] == [2, 3] and result["quiet_tokens_per_s"] > 0  # the first step never counts
    assert result["steady_pad_fraction"] == 0.0
    assert result["to_first_step_end_s"] == result["init_s"] + steps[0]["seconds"]
    # where the trainer's start went, part by part, within the bench's own clock of it
    phases = result["init_phases_s"]
    assert {"build", "check_gdn", "check_attention", "load_weights", "ddp", "optimizer"} <= set(phases)
    assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= result["init_s"]
    # the compilers' caches where it was told, and how warm they were (a new folder: empty)
    assert result["compile_cache"]["root"] == str(tmp_path / "compile")
    assert set(result["compile_cache"]["files_at_start"].values()) == {0}
    # --profile: one more step profiled, the trainer's phases named among its ops
    by_total = out.stdout.split("ops by cpu_time_total")[1]
    assert "vlmrl.forward_backward" in by_total and "vlmrl.optimizer_step" in by_total
    step_phases = result["phases_host_ms"]
    assert step_phases["vlmrl.forward_backward"] > 0 and step_phases["vlmrl.optimizer_step"] > 0


def test_quiet_steps_leave_out_every_step_that_compiled_or_recorded():
    """The trainer's rate once its shapes are met: steps after the first in which no Dynamo
    graph compiled (again or anew), no TileLang kernel compiled and no CUDA graph was recorded."""
    from vlmrl.bench.trainer_steps import quiet_steps

    def row(step, recompiles=(), kernels=(), graphs=4, compiled=7):
        return {"step": step, "recompiles": list(recompiles), "kernel_compiles": list(kernels),
                "cuda_graphs": {"graphs": graphs, "skips": 0}, "graphs_compiled": compiled}

    rows = [row(1, graphs=2, compiled=5), row(2), row(3, kernels=["tilelang_fused_chunk_gdr_fwd_kernel"]),
            row(4, graphs=6), row(5, recompiles=["kernel_inputs: stride"]), row(6, compiled=8), row(7, compiled=8),
            row(8, compiled=8)]
    assert [r["step"] for r in quiet_steps(rows)] == [7, 8]
    assert [r["step"] for r in quiet_steps(rows[:1])] == []


def test_kernel_compile_log_names_the_kernels_tilelang_compiles():
    """TileLang logs the start of each JIT compile under its `tilelang.jit.kernel` logger (its
    line, as the H200 logs show it): the bench keeps the kernel's name, and nothing else."""
    import logging

    from vlmrl.bench.trainer_steps import kernel_compile_log

    names = kernel_compile_log()
    log = logging.getLogger("tilelang.jit.kernel")
    log.setLevel(logging.INFO)
    log.info("TileLang begins to compile kernel `tilelang_fused_chunk_gdr_fwd_kernel` with `out_idx=None`")
    log.info("TileLang completes to compile kernel `tilelang_fused_chunk_gdr_fwd_kernel`")
    logging.getLogger("somebody.else").warning("TileLang begins to compile kernel `not_tilelangs`")
    assert names == ["tilelang_fused_chunk_gdr_fwd_kernel"]
