"""Run logging: metrics.jsonl, wandb, PNG plots and progress display.

`MetricsLogger` is what the loop uses: one `log(step, metrics)` per step writes
`<run_dir>/metrics.jsonl`, forwards to wandb and, at eval steps, redraws
`<run_dir>/plots/*.png`. `Progress` draws the rollout / train / eval bars and the one-line
step summary. wandb, matplotlib and rich are imported only when used.

The metric names are constants in `vlmrl.logging.keys` (documented there).
"""

from __future__ import annotations

from .keys import eval_key, eval_mean_reward_key, is_eval_accuracy_key
from .metrics import METRICS_FILE, MetricsLogger, read_metrics
from .plots import write_plots
from .progress import Progress, format_step_summary, print_step_summary

__all__ = [
    "METRICS_FILE",
    "MetricsLogger",
    "Progress",
    "eval_key",
    "eval_mean_reward_key",
    "format_step_summary",
    "is_eval_accuracy_key",
    "print_step_summary",
    "read_metrics",
    "write_plots",
]
