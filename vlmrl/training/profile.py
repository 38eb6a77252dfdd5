"""A trainer rank's torch.profiler trace of chosen RL steps (`profile_steps`).

The trace covers everything the rank does between the loop's start and stop calls: the memory
moves into and out of the phases (onload, the overlapped optimizer-state copies, stage,
offload), the logprob recompute, the forward, backward and optimizer step (named by the
trainer's `record_function` scopes: `vlmrl.forward_backward`, `vlmrl.optimizer_step`,
`vlmrl.metrics`), and the weight sync's gathers. Each rank writes a Chrome trace
(`rank<r>.json.gz`, opened by Perfetto or chrome://tracing) and a table of its most costly
operators (`rank<r>.txt`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def start() -> profile:
    """Start tracing this process: host operators, and the device's kernels and copies where
    the rank runs on a GPU."""
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities, record_shapes=False, with_stack=False)
    prof.start()
    return prof


def stop(prof: profile, out_dir: str | Path, rank: int, *, rows: int = 40) -> dict[str, str]:
    """Stop `prof` and write rank `rank`'s trace and operator table under `out_dir`; returns
    their paths."""
    prof.stop()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trace, table = out / f"rank{rank}.json.gz", out / f"rank{rank}.txt"
    prof.export_chrome_trace(str(trace))  # gzip-compressed: the name ends in .gz
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    table.write_text(prof.key_averages().table(sort_by=sort, row_limit=rows) + "\n")
    return {"trace": str(trace), "table": str(table)}
