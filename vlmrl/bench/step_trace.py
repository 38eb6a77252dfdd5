"""What a traced RL step's trainer ranks did on the device (`profile_steps`'s traces).

For each rank's Chrome trace (`run_dir/profile/rl_step_<n>/rank<r>.json.gz`) and each of the
trainer's named stages in it (`vlmrl.micro_batches`, `vlmrl.forward_backward`,
`vlmrl.optimizer_step`, `vlmrl.metrics`, `vlmrl.ref_logprobs`, ...; the whole trace as `step`):

    span      the stage's wall time on the host
    kernels   the time any GPU kernel ran in it (a union: kernels side by side count once)
    busy      kernels / span: below 1 the device waited for the host (launches, Python,
              synchronisation) or for copies
    copies    the time any copy or fill ran in it (offload copies on their side stream, too)

then the whole step's kernel time by kind (`vlmrl.bench.train_gpu.kernel_kind`). A trace of a
CPU rank has no device activity: its stages show their spans alone.

    python -m vlmrl.bench step-trace RUN_DIR [--step N] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ..cluster.step_profile import profile_dir, traced_steps
from . import report

KERNEL_CATS = ("kernel",)
COPY_CATS = ("gpu_memcpy", "gpu_memset")


def union_us(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    """Microseconds of [lo, hi] covered by any of `intervals` (start, end)."""
    covered, end = 0.0, lo
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in intervals if s < hi and e > lo):
        if e > end:
            covered += e - max(s, end)
            end = e
    return covered


def load_events(path: str | Path) -> list[dict[str, Any]]:
    raw = Path(path).read_bytes()
    return json.loads(gzip.decompress(raw) if str(path).endswith(".gz") else raw).get("traceEvents", [])


def summarize(events: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One rank's trace -> its stages (`step`, then each `vlmrl.*` annotation in time order) with
    span, kernels, copies (ms) and busy, and the step's kernel ms by kind."""
    from .train_gpu import kernel_time_by_kind

    timed = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    if not timed:
        raise ValueError("the trace holds no timed events")
    kernels = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in timed if e.get("cat") in KERNEL_CATS]
    copies = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in timed if e.get("cat") in COPY_CATS]
    host = [e for e in timed if e.get("cat") not in KERNEL_CATS + COPY_CATS]
    lo = min(float(e["ts"]) for e in host or timed)
    hi = max(float(e["ts"]) + float(e["dur"]) for e in host or timed)
    stages = [("step", lo, hi)] + sorted(
        ((str(e["name"]), float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in timed
         if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("vlmrl.")), key=lambda s: s[1])
    rows = []
    for name, a, b in stages:
        span = b - a
        k = union_us(kernels, a, b)
        rows.append({"stage": name, "span_ms": span / 1e3, "kernels_ms": k / 1e3, "copies_ms": union_us(copies, a, b) / 1e3,
                     "busy": k / span if span > 0 else 0.0})
    acts = [(float(e["ts"]), float(e["ts"]) + float(e["dur"]), str(e.get("name", ""))) for e in timed
            if e.get("cat") in KERNEL_CATS]
    return {"stages": rows, "kernel_ms_by_kind": kernel_time_by_kind(acts), "on_gpu": bool(kernels or copies)}


def table(name: str, summary: dict[str, Any], kinds: int = 8) -> list[str]:
    lines = [f"**{name}**", "", "| stage | span ms | kernels ms | busy | copies ms |", "|---|---|---|---|---|"]
    for r in summary["stages"]:
        lines.append(f"| {r['stage']} | {r['span_ms']:.1f} | {r['kernels_ms']:.1f} | {r['busy']:.0%} | "
                     f"{r['copies_ms']:.1f} |")
    if summary["kernel_ms_by_kind"]:
        lines += ["", "kernel ms by kind: " + ", ".join(
            f"{k} {v:.1f}" for k, v in list(summary["kernel_ms_by_kind"].items())[:kinds])]
    elif not summary["on_gpu"]:
        lines += ["", "no device activity (a CPU rank)"]
    return lines


def traced_step_dir(run_dir: str | Path, step: int | None) -> Path:
    """The run's profile folder of RL step `step`, or of its only traced step."""
    found = traced_steps(run_dir)
    names = ", ".join(profile_dir(run_dir, n).name for n in found) or "none"
    if step is None and len(found) != 1:
        raise FileNotFoundError(f"{Path(run_dir, 'profile')}: {len(found)} traced steps ({names}); name one with --step")
    if step is not None and step not in found:
        raise FileNotFoundError(f"no {profile_dir(run_dir, step)} (traced: {names})")
    return profile_dir(run_dir, found[0] if step is None else step)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="a run directory with profile/rl_step_<n>/ (profile_steps)")
    p.add_argument("--step", type=int, help="the traced RL step (default: the run's only one)")
    p.add_argument("--out", help="also write the tables to this markdown file")
    args = p.parse_args(argv)
    try:
        folder = traced_step_dir(args.run_dir, args.step)
        traces = sorted(folder.glob("rank*.json.gz"), key=lambda q: int(q.name[4:].split(".")[0]))
        if not traces:
            raise FileNotFoundError(f"no rank<r>.json.gz in {folder}")
        lines = [f"The trainer ranks' traced {folder.name} (`python -m vlmrl.bench step-trace {args.run_dir}"
                 + (f" --step {args.step}" if args.step else "") + "`)", ""]
        for t in traces:
            lines += [*table(t.name.split(".")[0], summarize(load_events(t))), ""]
    except (OSError, ValueError) as err:
        print(f"step-trace: {err}", file=sys.stderr)
        return 1
    return report("\n".join(lines), args.out)


if __name__ == "__main__":
    sys.exit(main())
