"""Dry-run latency: how long `python -m vlmrl.train --cfg job ...` takes, end to end.

Each run is a fresh interpreter (what a user waits for); the median of `--repeats`.

    python -m vlmrl.bench.cli --repeats 5
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .rollout import RESULTS_DIR

COMMANDS = (
    ["-m", "vlmrl.train", "--cfg", "job", "experiment=geo3k_qwen35", "parallel.tp=4", "hardware=b200"],
    ["-m", "vlmrl.plan", "experiment=geo3k_qwen35"],
)


def time_command(argv: list[str], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, *argv], check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(RESULTS_DIR))
    args = p.parse_args(argv)
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M")
    rows = []
    for cmd in COMMANDS:
        times = time_command(cmd, args.repeats)
        rows.append({"command": "python " + " ".join(cmd), "median_s": statistics.median(times),
                     "max_s": max(times), "repeats": args.repeats})
        print(f"{statistics.median(times):6.2f} s (max {max(times):.2f})  python {' '.join(cmd)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cli.json").write_text(json.dumps({"date": date, "rows": rows}, indent=2))
    lines = ["# Dry-run latency (fresh interpreter, median)", "",
             f"Measured {date} UTC with `python -m vlmrl.bench.cli --repeats {args.repeats}`.", "",
             "| command | median s | max s |", "|---|---|---|"]
    lines += [f"| `{r['command']}` | {r['median_s']:.2f} | {r['max_s']:.2f} |" for r in rows]
    (out / "cli.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
