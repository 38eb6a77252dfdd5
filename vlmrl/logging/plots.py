"""PNG plots of a run's metrics against step: reward, eval accuracy, response length, and for
MoE models the expert load imbalance of each layer, with (where the engines report their
experts) each layer's share of tokens routed unlike the rollout engine below it.

Figures are drawn with matplotlib's object API on an Agg canvas (no pyplot, no global
backend switch, no display needed) and written through a temporary file plus
os.replace, so a reader never sees half a PNG. matplotlib is imported on first use.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .keys import (
    EVAL_PREFIX,
    ROLLOUT_RAW_REWARD,
    ROLLOUT_RESPONSE_LEN_MEAN,
    TRAIN_ROLLOUT_LOGPROB_ABS_DIFF,
    finite,
    is_eval_accuracy_key,
)

REWARD_PNG = "reward.png"
EVAL_ACCURACY_PNG = "eval_accuracy.png"
RESPONSE_LENGTH_PNG = "response_length.png"
MOE_IMBALANCE_PNG = "moe_imbalance.png"
MISMATCH_PNG = "logprob_mismatch.png"
MOE_IMBALANCE_PREFIX = "moe/imbalance/layer_"
MOE_MISMATCH_PREFIX = "moe/route_mismatch/layer_"

Series = tuple[list[int], list[float]]


def series(rows: Iterable[dict[str, Any]], key: str) -> Series:
    """(steps, values) of one key, sorted by step; the last value wins when a step repeats."""
    by_step: dict[int, float] = {}
    for row in rows:
        value = row.get(key)
        step = row.get("step")
        if isinstance(step, int) and finite(value):
            by_step[step] = float(value)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over at most `window` values (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def write_plots(
    metrics_rows: Iterable[dict[str, Any]],
    out_dir: str | os.PathLike[str],
    eval_key_prefix: str = EVAL_PREFIX,
) -> list[Path]:
    """Write reward.png, eval_accuracy.png, response_length.png and (MoE models)
    moe_imbalance.png into `out_dir`.

    A plot whose metric has no finite value yet is skipped (and not written). Eval
    accuracy has one line per `eval/<name>` key; sub-metrics (`eval/<name>/...`) are left
    out. Returns the paths written.
    """
    rows = list(metrics_rows)
    out = Path(out_dir)
    written: list[Path] = []

    steps, reward = series(rows, ROLLOUT_RAW_REWARD)
    if steps:
        window = max(1, len(steps) // 20)
        lines = [("raw reward", steps, reward, {"alpha": 0.4 if window > 1 else 1.0})]
        if window > 1:
            lines.append((f"moving average ({window} steps)", steps, moving_average(reward, window), {}))
        written.append(_save(out / REWARD_PNG, "Rollout reward", "mean reward", lines))

    eval_keys = sorted({k for row in rows for k in row if is_eval_accuracy_key(k, eval_key_prefix)})
    eval_lines = []
    for key in eval_keys:
        s, v = series(rows, key)
        if s:
            eval_lines.append((key[len(eval_key_prefix) :], s, v, {"marker": "o"}))
    if eval_lines:
        written.append(_save(out / EVAL_ACCURACY_PNG, "Eval accuracy", "accuracy", eval_lines))

    steps, length = series(rows, ROLLOUT_RESPONSE_LEN_MEAN)
    if steps:
        written.append(
            _save(
                out / RESPONSE_LENGTH_PNG,
                "Response length",
                "mean tokens",
                [("mean response length", steps, length, {})],
            )
        )
    steps, gap = series(rows, TRAIN_ROLLOUT_LOGPROB_ABS_DIFF)
    if steps:
        written.append(_save(out / MISMATCH_PNG, "Trainer vs rollout engine logprobs", "mean |difference|",
                             [("", steps, gap, {})]))

    panels = [(title, ylabel, lines) for title, ylabel, lines in (
        ("MoE expert load (max / mean, 1 = even)", "imbalance", _layer_lines(rows, MOE_IMBALANCE_PREFIX)),
        ("Tokens routed unlike the rollout engine", "share of tokens", _layer_lines(rows, MOE_MISMATCH_PREFIX)),
    ) if lines]
    if panels:
        written.append(_save_panels(out / MOE_IMBALANCE_PNG, panels))
    return written


Line = tuple[str, list[int], list[float], dict]


def _layer_lines(rows: list[dict[str, Any]], prefix: str) -> list[Line]:
    """One line per layer of the metrics `<prefix><layer>`, in layer order."""
    keys = sorted({k for row in rows for k in row if k.startswith(prefix)}, key=lambda k: int(k[len(prefix):]))
    out = []
    for key in keys:
        s, v = series(rows, key)
        if s:
            out.append((f"layer {key[len(prefix):]}", s, v, {}))
    return out


def _save(path: Path, title: str, ylabel: str, lines: list[Line]) -> Path:
    return _save_panels(path, [(title, ylabel, lines)])


def _save_panels(path: Path, panels: list[tuple[str, str, list[Line]]]) -> Path:
    """One figure of stacked panels (title, y label, lines) sharing the step axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7, 4 * len(panels)), dpi=100)
    FigureCanvasAgg(fig)
    for i, (title, ylabel, lines) in enumerate(panels):
        ax = fig.add_subplot(len(panels), 1, i + 1)
        for label, steps, values, style in lines:
            if len(steps) == 1:
                style = {**style, "marker": style.get("marker", "o")}
            ax.plot(steps, values, label=label, **style)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if len(lines) > 1 or lines[0][0]:
            ax.legend(loc="best", fontsize="small")
    fig.tight_layout()

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)
    return path
