"""What a recipe learns: whole runs of `python -m vlmrl.train`, several configurations x RL seeds x
warm-ups, side by side as separate processes, summarised per run and per configuration.

Greedy accuracy moves by as much between seeds of one configuration as between configurations
(bench/results/learning-qwen35.md), so a claim about what a recipe gains rests on several seeds
and on more than one SFT warm-up (`data.seed` draws the warm-up's batches; `seed` the RL phase's
prompts, samples and shuffles). Each run gets its own run dir and log; the driver starts at
most `--parallel` at once. A tiny model leaves a GPU mostly idle, so runs share it; on a CPU
give each run a core (`cluster.cpu_threads=1` in `--base`).

    python -m vlmrl.bench.learning --base "experiment=tiny_qwen35_moe cluster.cpu_threads=1" \\
        --variant "fp32=" --variant "bf16=hardware.train_dtype=bfloat16 model.dtype=bfloat16" \\
        --seeds 1234,1,2 --data-seeds 1234,1 --parallel 2 --out bench/results --tag cpu

Per run: greedy accuracy after the warm-up and after RL (and every eval between), the sampled
reward in windows of 10 RL steps, the policy's entropy, the KL to the reference, the
trainer-engine logprob gap (`train/train_rollout_logprob_abs_diff`), training seconds and the
exit status. Per configuration: the gains of its runs and their mean. Writes
`learning-<tag>.json` (every row, the commands) and `learning-<tag>.md` (the tables) under
`--out`; `--summarize-only` reads existing run dirs again. `--warm` first builds the model's
checkpoint and compiles the run's GPU kernel checks (Gated DeltaNet on fla, FlashAttention 4)
once, into the compile cache the runs share, so that parallel runs do not all compile at once.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

WINDOW = 10  # RL steps per sampled-reward window


@dataclass
class Run:
    variant: str
    seed: int
    data_seed: int
    overrides: list[str]
    run_dir: Path
    sglang_port: int | None = None  # this run's rollout.sglang.base_port (runs side by side need their own)

    @property
    def name(self) -> str:
        return f"{self.variant}_s{self.seed}_d{self.data_seed}"

    def command(self, python: str) -> list[str]:
        ports = [] if self.sglang_port is None else [f"rollout.sglang.base_port={self.sglang_port}"]
        return [python, "-m", "vlmrl.train", f"run_dir={self.run_dir}", "logger.wandb=false",
                "logger.progress=false", f"seed={self.seed}", f"data.seed={self.data_seed}", *ports, *self.overrides]


@dataclass
class Row:
    variant: str
    seed: int
    data_seed: int
    run_dir: str
    exit_code: int | None
    eval_start: float | None = None
    eval_end: float | None = None
    gain: float | None = None
    evals: list[tuple[int, float]] = field(default_factory=list)
    reward_windows: list[float] = field(default_factory=list)
    entropy: tuple[float, float] | None = None  # mean of the first and of the last window
    kl_last: float | None = None
    gap_mean: float | None = None
    train_seconds: float | None = None
    rl_steps: int = 0


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def read_run(run: Run, exit_code: int | None) -> Row:
    """The row of one run from its `metrics.jsonl` and `summary.json` (whatever exists: a run
    that died keeps the evals and steps it logged)."""
    row = Row(run.variant, run.seed, run.data_seed, str(run.run_dir), exit_code)
    metrics = run.run_dir / "metrics.jsonl"
    rows: list[dict[str, Any]] = []
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a kill
    for r in rows:
        for k, v in r.items():
            if k.startswith("eval/") and k.count("/") == 1 and isinstance(v, (int, float)):
                row.evals.append((int(r.get("step", 0)), float(v)))
    rl = [r for r in rows if "rollout/raw_reward" in r]
    row.rl_steps = len(rl)
    rewards = [float(r["rollout/raw_reward"]) for r in rl]
    row.reward_windows = [round(statistics.fmean(rewards[i:i + WINDOW]), 4) for i in range(0, len(rewards), WINDOW)]
    ent = [float(r["train/entropy"]) for r in rl if "train/entropy" in r]
    if ent:
        row.entropy = (statistics.fmean(ent[:WINDOW]), statistics.fmean(ent[-WINDOW:]))
    kl = [float(r["train/kl"]) for r in rl if "train/kl" in r]
    row.kl_last = _mean(kl[-WINDOW:])
    row.gap_mean = _mean([float(r["train/train_rollout_logprob_abs_diff"]) for r in rl
                          if "train/train_rollout_logprob_abs_diff" in r])
    summary = run.run_dir / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        row.eval_start, row.eval_end = s.get("eval_accuracy_start"), s.get("eval_accuracy_end")
        row.train_seconds = s.get("train_seconds")
    if row.eval_start is not None and row.eval_end is not None:
        row.gain = round(row.eval_end - row.eval_start, 4)
    return row


def plan_runs(variants: list[tuple[str, list[str]]], base: list[str], seeds: list[int], data_seeds: list[int],
              root: Path, sglang_ports_from: int | None = None) -> list[Run]:
    """Every (variant, warm-up, seed), warm-ups outermost so that an early stop has seen each
    variant; with `sglang_ports_from`, run i's SGLang engines listen from that port + 100 i."""
    runs = [Run(name, s, d, [*base, *ov], root / f"{name}_s{s}_d{d}")
            for d in data_seeds for s in seeds for name, ov in variants]
    if sglang_ports_from is not None:
        for i, run in enumerate(runs):
            run.sglang_port = sglang_ports_from + 100 * i
    return runs


def run_all(runs: list[Run], python: str, parallel: int, timeout_s: float, cwd: Path) -> dict[str, int | None]:
    """Start the runs, at most `parallel` at once; a run past `timeout_s` is killed (exit None).
    A run whose dir already holds a `summary.json` (a finished run of an earlier call) is kept."""
    pending, active, codes = [r for r in runs if not (r.run_dir / "summary.json").exists()], [], {}
    for r in runs:
        if r not in pending:
            print(f"kept {r.name}: finished earlier ({r.run_dir})", flush=True)
    while pending or active:
        while pending and len(active) < parallel:
            run = pending.pop(0)
            run.run_dir.parent.mkdir(parents=True, exist_ok=True)
            log = open(run.run_dir.parent / f"{run.name}.log", "w")  # noqa: SIM115 (closed when the run ends)
            proc = subprocess.Popen(run.command(python), cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            active.append((run, proc, log, time.monotonic()))
            print(f"started {run.name}: {shlex.join(run.command(python))}", flush=True)
        time.sleep(2)
        for item in list(active):
            run, proc, log, t0 = item
            code = proc.poll()
            if code is None and time.monotonic() - t0 > timeout_s:
                os.killpg(proc.pid, 9)
                proc.wait()
                code = None
                print(f"killed {run.name} after {timeout_s:.0f} s", flush=True)
            elif code is None:
                continue
            log.close()
            active.remove(item)
            codes[run.name] = code
            print(f"ended {run.name}: exit {code} after {time.monotonic() - t0:.0f} s", flush=True)
    return codes


def warm(overrides: list[str]) -> None:
    """What every run of these overrides would otherwise do at its start, done once here: the
    tiny checkpoint built, and the fast-path kernels a trainer checks before its first step
    compiled into `hardware.compile_cache_dir` (a cold FlashQLA compile takes minutes)."""
    from ..config import load
    from ..models.kernels import compile_cache_env
    from ..models.tiny import model_path

    cfg = load(overrides)
    os.environ.update(compile_cache_env(cfg.hardware.compile_cache_dir))
    t0 = time.perf_counter()
    print(f"warm: checkpoint {model_path(cfg)}", flush=True)
    if cfg.hardware.device != "cuda":
        return
    import torch

    from ..training.trainer import DTYPES

    device, dtype, lm = torch.device("cuda"), DTYPES[cfg.hardware.train_dtype], cfg.model.lm
    split = cfg.parallel.tp * cfg.parallel.cp
    if cfg.hardware.gdn_backend == "fla" and "linear_attention" in lm.layer_types:
        from ..models.gated_delta import check_model_fast_path

        check_model_fast_path(lm, device, dtype, split=split)
    if cfg.hardware.lm_attention_backend == "flash4":
        from ..models.attention import check_attention_backend

        tp = cfg.parallel.tp
        check_attention_backend("flash4", heads=lm.num_attention_heads // tp, groups=max(lm.num_query_groups // tp, 1),
                                head_dim=lm.head_dim, device=device, dtype=dtype)
    print(f"warm: kernels compiled in {time.perf_counter() - t0:.0f} s", flush=True)


def by_variant(rows: list[Row]) -> list[dict[str, Any]]:
    out = []
    for name in dict.fromkeys(r.variant for r in rows):
        mine = [r for r in rows if r.variant == name]
        gains = [r.gain for r in mine if r.gain is not None]
        ends = [r.eval_end for r in mine if r.eval_end is not None]
        out.append({"variant": name, "runs": len(mine), "finished": len(gains),
                    "gains": gains, "mean_gain": _mean(gains), "min_gain": min(gains) if gains else None,
                    "mean_end": _mean(ends)})
    return out


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "" if x is None else format(x, fmt)


def markdown(rows: list[Row], variants: list[tuple[str, list[str]]], base: list[str], command: str,
             date: str, device: str) -> str:
    lines = [f"# What the recipe learns ({device})", "", f"Measured {date} UTC with", "", f"    {command}", "",
             f"Common overrides: `{' '.join(base)}`.", "", "Configurations:", ""]
    lines += [f"- `{name}`: `{' '.join(ov) or '(none)'}`" for name, ov in variants]
    lines += ["", "| configuration | runs | finished | gain per run | mean gain | min gain | mean end accuracy |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for v in by_variant(rows):
        gains = ", ".join(f"{g:+.3f}" for g in v["gains"])
        lines.append(f"| {v['variant']} | {v['runs']} | {v['finished']} | {gains} | {_f(v['mean_gain'], '+.3f')} | "
                     f"{_f(v['min_gain'], '+.3f')} | {_f(v['mean_end'])} |")
    lines += ["", "| run | exit | after SFT | after RL | gain | greedy evals (step:acc) | sampled reward "
              f"({WINDOW}-step windows) | entropy | KL (last {WINDOW}) | logprob gap | train s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        evals = " ".join(f"{s}:{a:.3f}" for s, a in r.evals)
        ent = f"{r.entropy[0]:.2f} -> {r.entropy[1]:.2f}" if r.entropy else ""
        lines.append(f"| {r.variant} s{r.seed} d{r.data_seed} | {r.exit_code} | {_f(r.eval_start)} | {_f(r.eval_end)} | "
                     f"{_f(r.gain, '+.3f')} | {evals} | {' '.join(f'{w:.2f}' for w in r.reward_windows)} | {ent} | "
                     f"{_f(r.kl_last, '.3f')} | {_f(r.gap_mean, '.2g')} | {_f(r.train_seconds, '.0f')} |")
    return "\n".join(lines) + "\n"


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, sep, rest = text.partition("=")
    if not sep or not name or any(c in name for c in "/ "):
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected NAME=OVERRIDES (NAME without spaces or /)")
    return name, shlex.split(rest)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", action="append", type=parse_variant, required=True,
                   help="NAME=OVERRIDES (space-separated Hydra overrides; repeat for each configuration)")
    p.add_argument("--base", default="", help="overrides every run gets (before the variant's)")
    p.add_argument("--seeds", type=_ints, default=[1234])
    p.add_argument("--data-seeds", type=_ints, default=[1234])
    p.add_argument("--parallel", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=3600.0, help="a run past this is killed")
    p.add_argument("--run-root", default="runs/learning", help="the run dirs go under ROOT/TAG")
    p.add_argument("--out", default="bench/results", help="where learning-TAG.{json,md} go")
    p.add_argument("--tag", default=None, help="names the results (default: the date and time)")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--summarize-only", action="store_true", help="read the run dirs of an earlier call again")
    p.add_argument("--sglang-ports-from", type=int, default=None,
                   help="give run i rollout.sglang.base_port=PORT+100*i (SGLang runs side by side)")
    p.add_argument("--warm", action="store_true",
                   help="build the checkpoint and compile the GPU kernel checks once before the runs")
    args = p.parse_args(argv)

    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M")
    tag = args.tag or dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M")
    base = shlex.split(args.base)
    root = Path(args.run_root) / tag
    runs = plan_runs(args.variant, base, args.seeds, args.data_seeds, root, args.sglang_ports_from)
    command = "python -m vlmrl.bench.learning " + shlex.join(argv if argv is not None else sys.argv[1:])
    codes: dict[str, int | None] = {}
    if args.warm and not args.summarize_only:
        for ov in dict.fromkeys(tuple(r.overrides) for r in runs):  # once per distinct configuration
            warm(list(ov))
    if not args.summarize_only:
        codes = run_all(runs, args.python, args.parallel, args.timeout_s, Path.cwd())
    rows = [read_run(r, codes.get(r.name)) for r in runs]
    device = _device()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"learning-{tag}.json").write_text(json.dumps({
        "date": date, "command": command, "device": device, "base": base,
        "variants": {n: ov for n, ov in args.variant}, "by_variant": by_variant(rows),
        "runs": [asdict(r) for r in rows]}, indent=2))
    text = markdown(rows, args.variant, base, command, date, device)
    (out / f"learning-{tag}.md").write_text(text)
    print(text)
    return 0 if all(r.gain is not None for r in rows) else 1


def _device() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
        return f"CPU ({os.cpu_count()} cores), torch {torch.__version__}"
    except ImportError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
