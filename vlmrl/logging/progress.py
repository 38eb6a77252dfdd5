"""Progress display of the loop: rollout, train and eval bars, and one line per step.

    progress = Progress(enabled=cfg.logger.progress)
    with progress.task("rollout", total=n_samples) as t:
        ...
        t.advance(len(group))
        t.drop()              # a group dropped (e.g. all rewards equal)
    progress.print_step_summary(step, metrics)

Live rich bars are drawn only when enabled and the console is a terminal; they are
transient (cleared when the phase ends), so a terminal shows the step lines, not a
growing stack of bars. Enabled but not a terminal (Ray logs, batch jobs, pipes): one
plain summary line per phase. Disabled: the tasks count silently and print nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from .keys import (
    PERF_STEP_TIME,
    PERF_TOKENS_PER_GPU_PER_SEC,
    ROLLOUT_RAW_REWARD,
    ROLLOUT_RESPONSE_LEN_MEAN,
    ROLLOUT_TRUNCATED_RATIO,
    TRAIN_ENTROPY,
    TRAIN_GRAD_NORM,
    TRAIN_KL,
    TRAIN_LOSS,
    TRAIN_PG_CLIPFRAC,
    TRAIN_PPO_KL,
    TRAIN_ROLLOUT_LOGPROB_ABS_DIFF,
    finite,
    is_eval_accuracy_key,
)

if TYPE_CHECKING:
    from rich.console import Console


class ProgressTask:
    """Counters of one phase; drives a rich task when the display is live."""

    def __init__(self, owner: Progress, name: str, total: int | None, task_id: Any = None) -> None:
        self._owner = owner
        self.name = name
        self.total = total
        self.completed = 0
        self.dropped = 0
        self._task_id = task_id
        self._start = time.perf_counter()
        self.elapsed = 0.0

    def advance(self, k: int = 1) -> None:
        """k more units done (samples, micro-batches, eval samples)."""
        self.completed += k
        self._owner._update(self)

    def drop(self, k: int = 1) -> None:
        """k groups dropped (counted and shown next to the bar, not in the total)."""
        self.dropped += k
        self._owner._update(self)

    def summary(self) -> str:
        total = "?" if self.total is None else str(self.total)
        line = f"{self.name}: {self.completed}/{total} in {self.elapsed:.1f}s"
        if self.dropped:
            line += f", {self.dropped} groups dropped"
        return line


class Progress:
    """Progress bars for the loop's phases; see the module docstring for what is shown."""

    def __init__(self, enabled: bool = True, *, console: Console | None = None) -> None:
        self.enabled = enabled
        self._console = console
        self._bar: Any = None  # rich.progress.Progress while at least one live task runs
        self._active = 0
        self._lock = threading.Lock()

    @property
    def console(self) -> Console:
        if self._console is None:
            from rich.console import Console

            self._console = Console()
        return self._console

    @property
    def live(self) -> bool:
        """Whether rich bars are drawn (enabled and writing to a terminal)."""
        return self.enabled and self.console.is_terminal

    @contextmanager
    def task(self, name: str, total: int | None = None) -> Iterator[ProgressTask]:
        """A phase with `total` units (None: unknown); yields a `ProgressTask`."""
        live = self.live
        task_id = self._start_task(name, total) if live else None
        t = ProgressTask(self, name, total, task_id)
        try:
            yield t
        finally:
            t.elapsed = time.perf_counter() - t._start
            if live:
                self._end_task(task_id)
            elif self.enabled:
                self.console.print(t.summary(), markup=False, highlight=False, soft_wrap=True)

    def print_step_summary(self, step: int, metrics: Mapping[str, Any]) -> str:
        """One compact line for the step (rich styling when enabled); returns its text."""
        return print_step_summary(step, metrics, console=self.console if self.enabled else None)

    def print_sft_step(self, step: int, total: int, metrics: Mapping[str, Any]) -> str:
        """One line per SFT warm-up step: `sft 12/60 | loss 0.52 | gnorm 1.3 | s 0.81`
        (with an eval accuracy when the step evaluated). Nothing when disabled."""
        items = [("loss", metrics.get("sft/loss")), ("gnorm", metrics.get(TRAIN_GRAD_NORM))]
        items += [(k, metrics[k]) for k in sorted(metrics) if is_eval_accuracy_key(k)]
        items += [("s", metrics.get("perf/train_time"))]
        text = " | ".join([f"sft {step}/{total}"] + [f"{k} {_fmt(float(v))}" for k, v in items if finite(v)])
        if self.enabled:
            self.console.print(text, markup=False, highlight=False, soft_wrap=True)
        return text

    # ------------------------------------------------------------------ rich plumbing
    def _start_task(self, name: str, total: int | None) -> Any:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as RichProgress

        with self._lock:
            if self._bar is None:
                self._bar = RichProgress(
                    TextColumn("[bold]{task.description:<8}"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TextColumn("{task.fields[extra]}"),
                    TimeElapsedColumn(),
                    TimeRemainingColumn(),
                    console=self.console,
                    transient=True,
                )
                self._bar.start()
            self._active += 1
            return self._bar.add_task(name, total=total, extra="")

    def _update(self, t: ProgressTask) -> None:
        bar = self._bar
        if t._task_id is None or bar is None:
            return
        extra = f"dropped {t.dropped}" if t.dropped else ""
        bar.update(t._task_id, completed=t.completed, extra=extra)

    def _end_task(self, task_id: Any) -> None:
        with self._lock:
            bar = self._bar
            if bar is None:
                return
            bar.remove_task(task_id)
            self._active -= 1
            if self._active == 0:
                bar.stop()
                self._bar = None


# (metric key, label) in display order; eval accuracies are inserted after the reward.
SUMMARY_FIELDS: tuple[tuple[str, str], ...] = (
    (ROLLOUT_RAW_REWARD, "reward"),
    (ROLLOUT_RESPONSE_LEN_MEAN, "len"),
    (ROLLOUT_TRUNCATED_RATIO, "trunc"),
    (TRAIN_LOSS, "loss"),
    (TRAIN_PG_CLIPFRAC, "clip"),
    (TRAIN_ENTROPY, "ent"),
    (TRAIN_KL, "kl"),  # to the reference policy, logged when algo.kl_coef > 0
    (TRAIN_PPO_KL, "ppo_kl"),
    (TRAIN_GRAD_NORM, "gnorm"),
    (TRAIN_ROLLOUT_LOGPROB_ABS_DIFF, "dlogp"),
    (PERF_STEP_TIME, "step_s"),
    (PERF_TOKENS_PER_GPU_PER_SEC, "tok/s/gpu"),
)


def _fmt(value: float) -> str:
    if value != 0 and abs(value) >= 1e4:
        return f"{value:.0f}"
    return f"{value:.4g}"


def summary_items(metrics: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(label, formatted value) pairs of the step line, skipping absent or non-finite values."""
    fields = list(SUMMARY_FIELDS[:1])
    fields += [(k, k) for k in sorted(metrics) if is_eval_accuracy_key(k)]
    fields += SUMMARY_FIELDS[1:]
    return [(label, _fmt(float(metrics[key]))) for key, label in fields if finite(metrics.get(key))]


def format_step_summary(step: int, metrics: Mapping[str, Any]) -> str:
    """The plain text of the step line, e.g. `step 12 | reward 0.45 | eval/geo3k 0.5 | ...`."""
    return " | ".join([f"step {step}"] + [f"{label} {value}" for label, value in summary_items(metrics)])


def print_step_summary(step: int, metrics: Mapping[str, Any], *, console: Console | None = None) -> str:
    """Print the step line: styled through `console` if given, else a plain print."""
    text = format_step_summary(step, metrics)
    if console is None:
        print(text, flush=True)
        return text
    from rich.text import Text

    line = Text()
    line.append(f"step {step}", style="bold cyan")
    for label, value in summary_items(metrics):
        line.append(" | ", style="dim")
        line.append(f"{label} ", style="dim")
        line.append(value, style="bold" if label == "reward" or label.startswith("eval/") else "")
    console.print(line, soft_wrap=True)
    return text
