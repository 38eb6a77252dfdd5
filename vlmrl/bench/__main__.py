"""`python -m vlmrl.bench [cli|rollout|train-gpu|weight-sync|trainer-steps] [args]` (what `make bench` runs).

Without a name it runs the CPU benchmarks (dry-run latency, embedded-engine rollout
throughput with the tiny model) and, where CUDA is available, the GPU training benchmark
and the colocated weight sync of the dense model.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from . import cli, rollout, train_gpu, trainer_steps, weight_sync

    benches = {"cli": cli.main, "rollout": rollout.main, "train-gpu": train_gpu.main,
               "weight-sync": weight_sync.main, "trainer-steps": trainer_steps.main}
    if argv and argv[0] in benches:
        return benches[argv[0]](argv[1:])
    if argv:
        print(f"unknown benchmark {argv[0]!r}; one of {', '.join(benches)}", file=sys.stderr)
        return 2
    import torch

    rc = cli.main([])
    rc |= rollout.main(["--batch-size", "64", "--max-new-tokens", "64", "--device", "cpu", "--repeats", "3"])
    if torch.cuda.is_available():
        rc |= train_gpu.main(["--seq", "4096"])
        rc |= weight_sync.main(["--model", "dense", "--device", "cuda"])
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
