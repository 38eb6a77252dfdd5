"""`python -m vlmrl.bench [cli|rollout|train-gpu|kernels-gpu|weight-sync|sglang-sync|trainer-steps|learning|step-phases|step-trace] [args]` (what `make bench` runs).

Without a name it runs the CPU benchmarks (dry-run latency, embedded-engine rollout
throughput with the tiny model) and, where CUDA is available, what bench/results reports
for one GPU: the dense and the Qwen3.5-MoE training pairs against HF (interleaved twice in
one process each), the colocated weight sync of both models, and the trainer's warm-up.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from . import (
        cli,
        kernels_gpu,
        learning,
        rollout,
        sglang_sync,
        step_phases,
        step_trace,
        train_gpu,
        trainer_steps,
        weight_sync,
    )

    benches = {"cli": cli.main, "rollout": rollout.main, "train-gpu": train_gpu.main,
               "kernels-gpu": kernels_gpu.main, "weight-sync": weight_sync.main, "sglang-sync": sglang_sync.main,
               "trainer-steps": trainer_steps.main, "learning": learning.main,
               "step-phases": step_phases.main, "step-trace": step_trace.main}
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print(f"\nbenchmarks: {', '.join(benches)} (each answers --help)")
        return 0
    if argv and argv[0] in benches:
        return benches[argv[0]](argv[1:])
    if argv:
        print(f"unknown benchmark {argv[0]!r}; one of {', '.join(benches)}", file=sys.stderr)
        return 2
    import torch

    rc = cli.main([])
    rc |= rollout.main(["--batch-size", "64", "--max-new-tokens", "64", "--device", "cpu", "--repeats", "3"])
    if torch.cuda.is_available():
        from ..models import flash4

        # the attention backend the h100 / h200 configs train with, where it is installed
        why = flash4.missing()
        att = "_flash4" if why is None else ""
        if not att:
            print(f"make bench: {why} (pip install -e '.[gpu]'), so the training benchmarks time the "
                  "sdpa attention backend", file=sys.stderr)
        dense, moe = f"vlmrl_megatron_fused_graphs{att}", f"vlmrl_qwen35_moe_graphs{att}"
        rc |= train_gpu.main(["--seq", "4096", "--iters", "20", "--warmup", "5",
                              "--variants", f"hf_sdpa,{dense},hf_sdpa,{dense}"])
        rc |= train_gpu.main(["--shape", "qwen35_moe", "--samples", "8", "--iters", "10", "--warmup", "3",
                              "--variants", f"hf_qwen35_moe,{moe},hf_qwen35_moe,{moe}"])
        for model in ("dense", "qwen35_moe"):
            rc |= weight_sync.main(["--model", model, "--device", "cuda"])
        rc |= trainer_steps.main(["--model", "qwen35_moe", "--device", "cuda"])
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
