"""The per-run `metrics.jsonl` and `MetricsLogger` (the metric names: `vlmrl.logging.keys`).

`metrics.jsonl` (in the run directory) is the record of a run: one JSON object a line,
`{"step": int, "time": unix seconds, <metric>: value, ...}`, flushed as it is written.
Several lines may share a step (say, train metrics and eval metrics logged apart).
wandb and the PNG plots are views of the same numbers. `samples.jsonl` beside it keeps some
of what the model wrote: `{"step": int, "kind": "rollout" | "eval", "response": ..., ...}`
a line (`vlmrl.experience.sample_rows`).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vlmrl.config.schema import LoggerConfig

    from .wandb_logger import WandbLogger

from .keys import RESERVED_KEYS

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
PLOTS_DIR = "plots"


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl (or of `<path>/metrics.jsonl` when path is a directory).

    A missing file gives []. Blank lines and lines that are not a JSON object with an
    integer "step" (for instance a line torn by a kill) are skipped.
    """
    p = Path(path)
    if p.is_dir():
        p = p / METRICS_FILE
    try:
        text = p.read_text()
    except FileNotFoundError:
        return []
    rows = []
    for line in text.splitlines():
        row = _parse_line(line)
        if row is not None:
            rows.append(row)
    return rows


def _parse_line(line: str) -> dict[str, Any] | None:
    line = line.strip()
    if not line:
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(row, dict) or not isinstance(row.get("step"), int):
        return None
    return row


def _plain(value: Any) -> Any:
    """A JSON-friendly value: numpy / torch scalars become Python numbers."""
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError, RuntimeError):
            pass
    return value


def _truncate_after(path: Path, resume_step: int) -> list[dict[str, Any]]:
    """Drop rows with step > resume_step (and unreadable lines); returns the rows kept.

    The file is rewritten through a temporary file and os.replace, so a kill during the
    rewrite leaves either the old or the new file, never a half one.
    """
    if not path.exists():
        return []
    rows = [r for r in read_metrics(path) if r["step"] <= resume_step]
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return rows


class MetricsLogger:
    """Writes `<run_dir>/metrics.jsonl`, forwards to wandb and refreshes the PNG plots.

    ``resume_step``: when a run resumes from a checkpoint taken after step s, pass s; rows
    with step > s already in metrics.jsonl (logged after that checkpoint by the killed
    job) are dropped, so the file has no duplicate steps once the steps are logged again.
    Pass -1 to start a used run directory afresh. None (a fresh run) appends to whatever
    is there.

    Which sinks are on follows the logger config: `jsonl`, `wandb` (mode from
    `wandb_mode`, see `wandb_logger.resolve_mode`), `plots`. wandb failures never raise:
    they are reported once and wandb is switched off. Plot failures are reported and
    skipped. A failure to write metrics.jsonl does raise: it is the record of the run.

    Use as a context manager (or call `close()`): closing finishes the wandb run and
    redraws the plots when rows arrived since the last redraw.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        logger_cfg: LoggerConfig,
        full_config: dict[str, Any] | None = None,
        run_name: str | None = None,
        *,
        resume_step: int | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.cfg = logger_cfg
        self.run_name = run_name or self.run_dir.resolve().name
        self.path = self.run_dir / METRICS_FILE
        self.plots_dir = self.run_dir / PLOTS_DIR
        self.run_dir.mkdir(parents=True, exist_ok=True)

        self.samples_path = self.run_dir / SAMPLES_FILE
        if resume_step is not None:
            self._rows = _truncate_after(self.path, resume_step)
            _truncate_after(self.samples_path, resume_step)
        else:
            self._rows = read_metrics(self.path)
        self._file = open(self.path, "a") if logger_cfg.jsonl else None
        self._samples_file = None  # opened by the first log_samples
        self._rows_at_last_plot = len(self._rows)
        self._plot_warned = False
        self._closed = False

        self.wandb: WandbLogger | None = None
        if logger_cfg.wandb:
            from .wandb_logger import WandbLogger

            self.wandb = WandbLogger(
                self.run_dir,
                project=logger_cfg.project,
                group=logger_cfg.group,
                name=self.run_name,
                mode=logger_cfg.wandb_mode,
                config=full_config,
            )

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ logging
    @property
    def rows(self) -> list[dict[str, Any]]:
        """Every row of this run so far (kept rows of the file plus rows logged since)."""
        return list(self._rows)

    def log(self, step: int, metrics: dict[str, Any], *, refresh_plots: bool = False) -> None:
        """Record `metrics` at `step`: a jsonl line, a wandb log and, if asked, new plots."""
        if self._closed:
            raise RuntimeError("MetricsLogger.log after close()")
        if isinstance(step, bool) or not isinstance(step, int):
            step = int(_plain(step))
        clash = [k for k in RESERVED_KEYS if k in metrics]
        if clash:
            raise ValueError(f"metric names {clash} are reserved in metrics.jsonl")
        values = {k: _plain(v) for k, v in metrics.items()}
        row = {"step": step, "time": time.time(), **values}
        self._rows.append(row)
        if self._file is not None:
            self._file.write(json.dumps(row, default=str) + "\n")
            self._file.flush()
        if self.wandb is not None:
            self.wandb.log(step, values)
        if refresh_plots:
            self.refresh_plots()

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Append `rows` (what the model wrote, `vlmrl.experience.sample_rows`) to samples.jsonl,
        each with its `step`, and give wandb a table of them per `kind` (`samples/rollout`,
        `samples/eval`)."""
        if self._closed:
            raise RuntimeError("MetricsLogger.log_samples after close()")
        if not rows:
            return
        if self.cfg.jsonl:
            if self._samples_file is None:
                self._samples_file = open(self.samples_path, "a")
            for row in rows:
                self._samples_file.write(json.dumps({"step": int(step), **row}, default=str) + "\n")
            self._samples_file.flush()
        if self.wandb is not None:
            by_kind: dict[str, list[dict[str, Any]]] = {}
            for row in rows:
                by_kind.setdefault(str(row.get("kind", "samples")), []).append(
                    {k: v for k, v in row.items() if k != "kind"})
            for kind, table in by_kind.items():
                self.wandb.log_table(int(step), f"samples/{kind}", table)

    def refresh_plots(self) -> list[Path]:
        """Redraw `<run_dir>/plots/*.png` from every row so far (no-op if plots are off)."""
        if not self.cfg.plots:
            return []
        self._rows_at_last_plot = len(self._rows)
        try:
            from .plots import write_plots

            return write_plots(self._rows, self.plots_dir)
        except Exception as exc:  # plots are a convenience: never stop the run
            if not self._plot_warned:
                warnings.warn(
                    f"writing plots failed ({type(exc).__name__}: {exc})", RuntimeWarning, stacklevel=2
                )
                self._plot_warned = True
            return []

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if len(self._rows) > self._rows_at_last_plot:
            self.refresh_plots()
        for f in (self._file, self._samples_file):
            if f is not None:
                f.close()
        self._file = self._samples_file = None
        if self.wandb is not None:
            self.wandb.finish()
