"""A traced RL step (`profile_steps`): what each process of the step spent its time on.

Every trainer rank records a torch.profiler trace (`vlmrl.training.profile`: its moves, copies,
forward, backward, optimizer step and the sync's gathers, with the device's kernels on a GPU)
and the driver records its own loop with cProfile: building the trainer's samples, the rollout
client, scoring, the calls it waits on. Both cover the step from its start to the end of its
weight sync and land in run_dir/profile/rl_step_<n>/:

    rank<r>.json.gz   Chrome trace (Perfetto, chrome://tracing)
    rank<r>.txt       the rank's costliest operators
    driver.prof       cProfile stats of the driver's loop thread (`python -m pstats`, snakeviz)
    driver.txt        its costliest functions, by cumulative time

A trace that cannot be written is reported and the run goes on: it observes the step, the step
does not need it.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import pstats
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def profile_dir(run_dir: str | Path, rl_step: int) -> Path:
    """The folder of RL step `rl_step`'s traces."""
    return Path(run_dir) / "profile" / f"rl_step_{rl_step}"


def traced_steps(run_dir: str | Path) -> list[int]:
    """The RL steps a run traced (their `profile_dir` folders), in order."""
    names = (p.name.removeprefix("rl_step_") for p in Path(run_dir, "profile").glob("rl_step_*") if p.is_dir())
    return sorted(int(n) for n in names if n.isdigit())


@contextlib.contextmanager
def profiled_step(steps: list[int], run_dir: str | Path, rl_step: int, trainer: Any) -> Iterator[Path | None]:
    """Trace the block as RL step `rl_step` when `steps` (`profile_steps`) names it: the trainer
    group's ranks and this thread. Yields the step's profile folder, or None."""
    if rl_step not in steps:
        yield None
        return
    out = profile_dir(run_dir, rl_step)
    try:
        trainer.profile_start()
    except Exception as err:  # noqa: BLE001 - a rank's error as Ray raises it
        print(f"warning: RL step {rl_step} is not traced: {err}", flush=True)
        yield None
        return
    driver = cProfile.Profile()
    driver.enable()
    try:
        yield out
    finally:
        driver.disable()
        for what, write in (("ranks'", lambda: trainer.profile_stop(out)),  # every rank stops, whatever else fails
                            ("driver's", lambda: write_driver_profile(driver, out))):
            try:
                write()
            except Exception as err:  # noqa: BLE001 - a rank's error as Ray raises it, or the disk's
                print(f"warning: the {what} trace of RL step {rl_step} was not written to {out}: {err}", flush=True)


def write_driver_profile(prof: cProfile.Profile, out: Path, rows: int = 40) -> None:
    """The driver's cProfile stats (driver.prof) and their costliest functions (driver.txt)."""
    out.mkdir(parents=True, exist_ok=True)
    prof.dump_stats(str(out / "driver.prof"))
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(rows)
    (out / "driver.txt").write_text(text.getvalue())
