"""What a training step logs, assembled from what its stages returned (the names are in
`keys.py` beside it; pure, standard library). The loop hands over its stages' results and
counters; this module decides which keys they become and how optimizer steps are summarised."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from . import keys as mk

# the trainer's loss terms, averaged over a step's optimizer steps as train/<name>
TRAIN_MEANS = ("loss", "pg_loss", "pg_clipfrac", "entropy", "grad_norm", "ppo_kl", "kl", "tis_mean",
               "mis_masked_frac", "train_rollout_logprob_abs_diff")


def observed(train_metrics: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The MoE routing metrics of a step's optimizer steps (means), the forward time per mixer
    kind (the trainer's StepObserver), and its micro-batches and their padding tokens (sums)."""
    out: dict[str, float] = {}
    keys = {k for m in train_metrics for k in m if k.startswith(("moe/", "perf/"))}
    for key in sorted(keys):
        values = [m[key] for m in train_metrics if key in m]
        out[key] = sum(values) if key.startswith("perf/") else sum(values) / len(values)
    return out


def train_metrics_summary(train_metrics: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """train/<term> means over the step's optimizer steps, then `observed`'s keys."""
    out: dict[str, float] = {}
    last = train_metrics[-1] if train_metrics else {}
    for key in TRAIN_MEANS:
        if key in last:
            out[f"train/{key}"] = sum(m[key] for m in train_metrics) / len(train_metrics)
    out.update(observed(train_metrics))
    return out


@dataclasses.dataclass
class StepTimes:
    """Seconds of an RL step's stages (`logprob` is part of `train`)."""

    rollout: float = 0.0
    experience: float = 0.0  # the trainer's samples from the rollout, after generation: advantages, assembly
    logprob: float = 0.0
    train: float = 0.0
    sync: float = 0.0
    step: float = 0.0


@dataclasses.dataclass
class StepCounts:
    """What went missing or wrong in a step, counted by the stage that saw it."""

    dropped_groups: int = 0  # groups lost after every retry
    retries: int = 0
    engine_restarts: int = 0  # in generation and in the step's memory moves
    stale_samples: int = 0
    skipped: Mapping[str, int] = dataclasses.field(default_factory=dict)  # train_samples' reasons
    reward_timeouts: int = 0
    reward_retries: int = 0
    reward_errors: int = 0
    data_skipped_rows: int = 0


def rl_step_metrics(*, rollout: Mapping[str, float], sampling: Mapping[str, float] | None,
                    train_metrics: Sequence[Mapping[str, float]], tokens: int, devices: int, times: StepTimes,
                    sync_bytes: int, sync_phases: Mapping[str, float], counts: StepCounts,
                    moved: Mapping[str, float] | None) -> dict[str, float]:
    """One RL step's row: `rollout` (experience.rollout_metrics of every scored group),
    `sampling` (dynamic sampling's metrics, None when no filter runs), the trainer's metrics per
    optimizer step, the step's `tokens` over its `devices`, stage `times`, the sync's bytes per
    engine and phases, the step's `counts`, and `moved` (colocated: seconds of each memory move,
    None otherwise)."""
    out: dict[str, float] = dict(rollout)
    if sampling is not None:
        out.update(sampling)
    out.update(train_metrics_summary(train_metrics))
    skipped = counts.skipped
    out.update({
        mk.PERF_ROLLOUT_TIME: times.rollout, mk.PERF_TRAIN_TIME: times.train, mk.PERF_UPDATE_WEIGHTS_TIME: times.sync,
        mk.PERF_STEP_TIME: times.step, mk.PERF_LOGPROB_TIME: times.logprob, mk.PERF_EXPERIENCE_TIME: times.experience,
        mk.PERF_TOKENS_PER_GPU_PER_SEC: tokens / max(times.step, 1e-9) / max(devices, 1),
        mk.PERF_UPDATE_WEIGHTS_GB_PER_S: sync_bytes / max(times.sync, 1e-9) / 1e9,
        **mk.sync_phase_metrics(dict(sync_phases)),
        "rollout/dropped_groups": counts.dropped_groups,
        "rollout/retries": counts.retries,
        "rollout/engine_restarts": counts.engine_restarts,
        "rollout/stale_samples": counts.stale_samples,
        "rollout/prompt_mismatch_samples": skipped.get("prompt_mismatch", 0),
        "rollout/bad_routed_experts_samples": skipped.get("bad_routed_experts", 0) + skipped.get("no_routed_experts", 0),
        "rollout/reward_timeouts": counts.reward_timeouts,
        "rollout/reward_retries": counts.reward_retries,
        "rollout/reward_errors": counts.reward_errors,
        "data/skipped_rows": counts.data_skipped_rows,
    })
    if moved is not None:  # the moves of device memory made during this step
        out.update({mk.PERF_OFFLOAD_TIME: moved.get("offload", 0.0), mk.PERF_ONLOAD_TIME: moved.get("onload", 0.0),
                    mk.PERF_ENGINE_RELEASE_TIME: moved.get("release", 0.0),
                    mk.PERF_ENGINE_RESUME_TIME: moved.get("resume", 0.0),
                    mk.PERF_OFFLOAD_STAGE_TIME: moved.get("stage", 0.0), mk.PERF_TRIM_TIME: moved.get("trim", 0.0),
                    **{mk.perf_move_to(p): moved.get(f"to_{p}", 0.0) for p in mk.MOVE_PHASES}})
    return out


def sft_step_metrics(m: Mapping[str, float], seconds: float) -> dict[str, float]:
    """One SFT step's row."""
    return {"sft/loss": m["loss"], mk.TRAIN_GRAD_NORM: m["grad_norm"], mk.PERF_TRAIN_TIME: seconds, **observed([m])}


def checkpoint_metrics(saved: Mapping[str, Any]) -> dict[str, float]:
    """A checkpoint save's row, from the trainer's save report (bytes, seconds)."""
    gib = float(1 << 30)
    return {mk.PERF_CHECKPOINT_TIME: saved["seconds"],
            mk.MEMORY_CHECKPOINT_HOST_GIB: (saved["host_rss_peak_bytes"] - saved["host_rss_before_bytes"]) / gib,
            mk.MEMORY_CHECKPOINT_HOST_PLAN_GIB: saved["host_need_bytes"] / gib,
            mk.MEMORY_CHECKPOINT_HOST_COPY_DROPPED_GIB: saved["host_copy_dropped_bytes"] / gib,
            mk.MEMORY_CHECKPOINT_HOST_KEPT_GIB: (saved.get("host_rss_after_bytes", saved["host_rss_before_bytes"])
                                                 - saved["host_rss_before_bytes"]) / gib}


def eval_metrics(dataset: str, rewards: Sequence[float]) -> dict[str, float]:
    """An evaluation's row: accuracy (replies the verifier accepts) and mean reward."""
    n = max(len(rewards), 1)
    return {mk.eval_key(dataset): sum(1.0 for r in rewards if r >= 1.0) / n,
            mk.eval_mean_reward_key(dataset): sum(rewards) / n}


def write_summary(run_dir: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """`summary` (eval_accuracy_start/end, train_seconds, ...) as <run_dir>/summary.json with
    where the plots are, and its line on the screen."""
    summary = {**summary, "run_dir": str(run_dir), "plots": str(run_dir / "plots")}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"run dir: {run_dir}\nplots: {run_dir / 'plots'}\n"
          f"eval accuracy {summary['eval_accuracy_start']:.3f} -> {summary['eval_accuracy_end']:.3f} "
          f"in {summary['train_seconds']:.0f}s of training")
    return summary
