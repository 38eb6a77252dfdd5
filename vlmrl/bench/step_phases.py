"""Where a synchronous RL step's time goes: generation, training, and everything else.

Reads the RL steps of one or more run directories (their metrics.jsonl) and splits each step:

    generate  the rollout (generation and scoring) less the memory moves that entered it
    train     logprobs and optimizer steps less the moves that entered training and what the
              optimizer step waited for the overlapped copy of its state
    outside   the rest of the step: memory moves (into generation, training and the sync),
              that wait, the weight sync, the trainer's samples built from the rollout, and
              the loop's other work between the stages

Colocated runs log their moves by phase (`perf/move_to_<phase>_time`); elsewhere nothing
moves and `outside` is the sync and the loop's own work. Async runs generate while they train,
so their steps do not split this way.

    python -m vlmrl.bench step-phases RUN_DIR [RUN_DIR ...] [--skip 1] [--out FILE.md]

Prints, per run, a row per step and the mean of the steps after the first `--skip` (the first
step compiles and warms caches), with the share of the step spent outside generation and
training. Steps traced with torch.profiler (`profile_steps`: the run's profile/rl_step_<n>
folders) are shown, marked, and left out of the mean: tracing slows them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..cluster.step_profile import traced_steps
from ..logging import keys as mk
from . import report

COLUMNS = ("step", "generate", "train", "outside", "move_generate", "move_train", "move_sync", "onload_wait",
           "sync", "experience", "loop")


def split(row: Mapping[str, float]) -> dict[str, float]:
    """One RL step's metrics row -> seconds by part (`COLUMNS`) and `outside_share`.

    `generate + train + outside == step`; `outside` is the sum of the moves, the onload wait,
    the sync, `experience` (the trainer's samples from the rollout; 0 in runs before it was
    logged) and `loop` (the rest of the loop's work between the stages: memory probes, logging)."""
    for key in (mk.PERF_STEP_TIME, mk.PERF_ROLLOUT_TIME, mk.PERF_TRAIN_TIME):
        if key not in row:
            raise KeyError(f"step {row.get('step')}: no {key!r}; is this an RL step's row?")
    step, rollout, train = row[mk.PERF_STEP_TIME], row[mk.PERF_ROLLOUT_TIME], row[mk.PERF_TRAIN_TIME]
    sync = row.get(mk.PERF_UPDATE_WEIGHTS_TIME, 0.0)
    moves = {p: row.get(mk.perf_move_to(p), 0.0) for p in mk.MOVE_PHASES}
    wait = row.get(mk.PERF_ONLOAD_OVERLAP_WAIT_TIME, 0.0)
    experience = row.get(mk.PERF_EXPERIENCE_TIME, 0.0)
    generate = rollout - moves["generate"]
    training = train - moves["train"] - wait
    outside = step - generate - training
    out = {"step": step, "generate": generate, "train": training, "outside": outside,
           "move_generate": moves["generate"], "move_train": moves["train"], "move_sync": moves["sync"],
           "onload_wait": wait, "sync": sync, "experience": experience,
           "loop": outside - moves["generate"] - moves["train"] - moves["sync"] - wait - sync - experience}
    out["outside_share"] = outside / step if step > 0 else 0.0
    return out


def summarise(rows: Sequence[Mapping[str, float]], skip: int = 1, traced: frozenset[int] = frozenset()
              ) -> dict[str, float]:
    """The mean of each part over the steps after the first `skip`, less the `traced` RL steps;
    the share is that of the means."""
    parts = [split(r) for r in rows[skip:] if int(r["rl_step"]) not in traced]
    if not parts:
        raise ValueError(f"no untraced RL steps after the first {skip}")
    mean = {c: statistics.fmean(p[c] for p in parts) for c in COLUMNS}
    mean["outside_share"] = mean["outside"] / mean["step"] if mean["step"] > 0 else 0.0
    mean["steps"] = len(parts)
    return mean


def rl_rows(run_dir: str | Path) -> list[dict[str, float]]:
    from ..logging.metrics import read_metrics

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no {path}")
    rows = [r for r in read_metrics(Path(run_dir)) if "rl_step" in r]
    if not rows:
        raise ValueError(f"no RL steps in {path}")
    return rows


def table(name: str, rows: Sequence[Mapping[str, float]], skip: int = 1,
          traced: frozenset[int] = frozenset()) -> list[str]:
    """Markdown lines: one row per step, then the mean of the untraced steps after the first `skip`."""
    head = ["rl step", *COLUMNS, "outside share"]
    lines = [f"**{name}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        s, n = split(r), int(r["rl_step"])
        lines.append(f"| {n}{' (traced)' if n in traced else ''} | " + " | ".join(f"{s[c]:.3f}" for c in COLUMNS)
                     + f" | {s['outside_share']:.1%} |")
    m = summarise(rows, skip, traced)
    left = f"after {skip}" + (", untraced" if traced else "")
    lines.append(f"| mean of {m['steps']:.0f} ({left}) | " + " | ".join(f"{m[c]:.3f}" for c in COLUMNS)
                 + f" | {m['outside_share']:.1%} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="+", help="run directories (each with its metrics.jsonl)")
    p.add_argument("--skip", type=int, default=1, help="steps left out of the mean (the first compiles)")
    p.add_argument("--out", help="also write the tables to this markdown file")
    args = p.parse_args(argv)
    lines = ["Seconds of each RL step (`python -m vlmrl.bench step-phases "
             + " ".join(args.run_dirs) + f" --skip {args.skip}`)", ""]
    for d in args.run_dirs:
        try:
            lines += [*table(str(d), rl_rows(d), args.skip, frozenset(traced_steps(d))), ""]
        except (OSError, ValueError, KeyError) as err:
            print(f"step-phases: {err}", file=sys.stderr)
            return 1
    return report("\n".join(lines), args.out)


if __name__ == "__main__":
    sys.exit(main())
