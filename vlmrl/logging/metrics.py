"""Metric names, the per-run `metrics.jsonl`, and `MetricsLogger`.

`metrics.jsonl` (in the run directory) is the record of a run: one JSON object a line,
`{"step": int, "time": unix seconds, <metric>: value, ...}`, flushed as it is written.
Several lines may share a step (say, train metrics and eval metrics logged apart).
wandb and the PNG plots are views of the same numbers.

Metric keys written by the loop (values are floats):

rollout
  rollout/raw_reward            mean verifier reward over the step's samples, before
                                advantage normalisation
  rollout/response_len/mean     mean response length in tokens
  rollout/truncated_ratio       fraction of responses cut at the max new tokens
eval (every `eval_interval` steps, one pair per eval dataset)
  eval/<dataset>                accuracy: fraction of samples the verifier accepts
  eval/<dataset>/mean_reward    mean verifier reward (differs from accuracy for
                                non-binary verifiers)
train (averaged over the step's optimizer updates)
  train/loss                    total loss that was backpropagated
  train/pg_loss                 policy-gradient (clipped surrogate) loss
  train/pg_clipfrac             fraction of tokens where the ratio clip was active
  train/entropy                 mean token entropy of the policy
  train/grad_norm               gradient norm before clipping
  train/ppo_kl                  mean (old logprob - new logprob) over response tokens
  train/train_rollout_logprob_abs_diff
                                mean |logp_train - logp_rollout|: the train/rollout
                                mismatch (a growing gap has preceded collapses)
perf (seconds unless stated)
  perf/rollout_time             generation and reward scoring
  perf/train_time               logprob recomputation and optimizer steps
  perf/update_weights_time      weight sync trainer -> rollout engines
  perf/step_time                the whole step, wall clock
  perf/tokens_per_gpu_per_sec   trained tokens (prompt + response) / train_time / GPUs

Eval dataset names must not contain "/" (`eval_key` replaces it with "_"): a key
`eval/<name>` with no further "/" is an accuracy, anything deeper is a sub-metric.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vlmrl.config.schema import LoggerConfig

    from .wandb_logger import WandbLogger

METRICS_FILE = "metrics.jsonl"
PLOTS_DIR = "plots"

ROLLOUT_RAW_REWARD = "rollout/raw_reward"
ROLLOUT_RESPONSE_LEN_MEAN = "rollout/response_len/mean"
ROLLOUT_TRUNCATED_RATIO = "rollout/truncated_ratio"

EVAL_PREFIX = "eval/"
EVAL_MEAN_REWARD_SUFFIX = "/mean_reward"

TRAIN_LOSS = "train/loss"
TRAIN_PG_LOSS = "train/pg_loss"
TRAIN_PG_CLIPFRAC = "train/pg_clipfrac"
TRAIN_ENTROPY = "train/entropy"
TRAIN_GRAD_NORM = "train/grad_norm"
TRAIN_PPO_KL = "train/ppo_kl"
TRAIN_ROLLOUT_LOGPROB_ABS_DIFF = "train/train_rollout_logprob_abs_diff"

PERF_ROLLOUT_TIME = "perf/rollout_time"
PERF_TRAIN_TIME = "perf/train_time"
PERF_UPDATE_WEIGHTS_TIME = "perf/update_weights_time"
PERF_STEP_TIME = "perf/step_time"
PERF_TOKENS_PER_GPU_PER_SEC = "perf/tokens_per_gpu_per_sec"

# Every fixed key (eval keys depend on the dataset names: see eval_key).
ROLLOUT_KEYS = (ROLLOUT_RAW_REWARD, ROLLOUT_RESPONSE_LEN_MEAN, ROLLOUT_TRUNCATED_RATIO)
TRAIN_KEYS = (
    TRAIN_LOSS,
    TRAIN_PG_LOSS,
    TRAIN_PG_CLIPFRAC,
    TRAIN_ENTROPY,
    TRAIN_GRAD_NORM,
    TRAIN_PPO_KL,
    TRAIN_ROLLOUT_LOGPROB_ABS_DIFF,
)
PERF_KEYS = (
    PERF_ROLLOUT_TIME,
    PERF_TRAIN_TIME,
    PERF_UPDATE_WEIGHTS_TIME,
    PERF_STEP_TIME,
    PERF_TOKENS_PER_GPU_PER_SEC,
)
RESERVED_KEYS = ("step", "time")


def eval_key(dataset: str) -> str:
    """`eval/<dataset>`: the eval accuracy of one dataset."""
    return EVAL_PREFIX + dataset.replace("/", "_")


def eval_mean_reward_key(dataset: str) -> str:
    """`eval/<dataset>/mean_reward`: the mean eval reward of one dataset."""
    return eval_key(dataset) + EVAL_MEAN_REWARD_SUFFIX


def is_eval_accuracy_key(key: str, prefix: str = EVAL_PREFIX) -> bool:
    """True for `eval/<name>`, False for sub-metrics such as `eval/<name>/mean_reward`."""
    return key.startswith(prefix) and len(key) > len(prefix) and "/" not in key[len(prefix) :]


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

        if resume_step is not None:
            self._rows = _truncate_after(self.path, resume_step)
        else:
            self._rows = read_metrics(self.path)
        self._file = open(self.path, "a") if logger_cfg.jsonl else None
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
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.wandb is not None:
            self.wandb.finish()


def finite(value: Any) -> bool:
    """True for a real, finite number (plots and summaries skip everything else)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
