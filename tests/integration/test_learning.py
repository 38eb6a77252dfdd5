"""The embedded default, end to end: a shorter version of `make train` (same model, task,
optimizer and GRPO settings; 60 GRPO steps of 4 prompts instead of 80 of 8) raises greedy eval
accuracy during GRPO, and leaves what a run leaves (summary, metrics, samples, plots,
checkpoint, HF export, Ray state in the run dir). `make train` at its full length is the `slow`
test at the end.

The run is deterministic on a given machine (seeded data, sampling and initialisation), so
the learning check is a check of the loop, not a statistical test. It is the suite's longest
run, shared by every test here. On one pinned core of the two (a suite worker), 2026-12-06:
0.453 -> 0.680 (evals 90:.648 120:.680, sampled reward 0.11 -> 0.27 over the first and last
15 steps), 450 s; the former 8 prompts a step went 0.453 -> 0.719 in 805 s. Since the trainer
runs a prompt once for its replies (`trainer.share_prompts`, 2026-12-07) the same evaluations and
rewards in 302 s, and since the engine prefills a group's prompt once, 188 s of training (the whole
fixture 247 s). Shorter runs did
not learn (the learning rate decays over SFT + RL steps, so fewer steps start GRPO lower): 20
or 30 GRPO steps of 8 prompts and 40 of 4 ended within +0.06 of the start, and RL's own
schedule (`trainer.optim.rl_lr` 2e-4 or 3e-4) kept the sampled reward near 0.02 for 20 steps.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

SFT_STEPS, RL_STEPS, EVAL_INTERVAL = 60, 60, 30
PROMPTS = 4  # a GRPO step's prompts (the default's 8 took 805 s in the suite): 64 samples, one optimizer step


def eval_steps(sft_steps: int, rl_steps: int, interval: int) -> list[int]:
    """The logged steps of a run's evaluations: every `interval` SFT steps before the warm-up's
    end, after the warm-up, every `interval` RL steps, and at the end."""
    sft = list(range(interval, sft_steps, interval))
    rl = [sft_steps + s for s in range(interval, rl_steps + 1, interval)]
    end = [] if rl_steps % interval == 0 else [sft_steps + rl_steps]
    return [*sft, sft_steps, *rl, *end]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory, cache_dir):
    from vlmrl.config import load
    from vlmrl.loop import train

    run_dir = tmp_path_factory.mktemp("default-run")
    cfg = load([f"run_dir={run_dir}", f"model.cache_dir={cache_dir}", f"num_steps={RL_STEPS}",
                f"eval_interval={EVAL_INTERVAL}", f"rollout.batch_size={PROMPTS}",
                f"trainer.global_batch_size={PROMPTS * 16}", "logger.wandb=false", "logger.progress=false",
                "save_hf=true"])
    return run_dir, cfg, train(cfg)


def test_grpo_raises_eval_accuracy_after_the_sft_warm_up(default_run):
    _, cfg, summary = default_run
    assert summary["sft_steps"] == cfg.algo.sft_steps == SFT_STEPS and summary["rl_steps"] == RL_STEPS
    assert cfg.algo.n_samples_per_prompt == 16 and cfg.algo.kl_coef > 0  # the default's GRPO
    assert summary["eval_accuracy_start"] > 0.3  # chance is 0.25: the warm-up started reading images
    assert summary["eval_accuracy_end"] >= summary["eval_accuracy_start"] + 0.1, summary


def test_run_writes_summary_metrics_and_plots(default_run):
    from vlmrl.logging.metrics import read_metrics

    run_dir, cfg, summary = default_run
    saved = json.loads((run_dir / "summary.json").read_text())
    assert saved == summary
    assert {"eval_accuracy_start", "eval_accuracy_end", "train_seconds"} <= set(saved)
    rows = read_metrics(run_dir)
    rl = [r for r in rows if "rl_step" in r]
    assert [r["rl_step"] for r in rl] == list(range(1, RL_STEPS + 1))
    for key in ("rollout/raw_reward", "rollout/response_len/mean", "rollout/truncated_ratio", "train/loss",
                "train/pg_clipfrac", "train/entropy", "perf/rollout_time", "perf/train_time",
                "perf/update_weights_time", "perf/step_time", "perf/tokens_per_gpu_per_sec", "perf/experience_time"):
        assert all(key in r for r in rl), key
    # evaluations: during the warm-up, after it, during GRPO and at the end
    assert [r["step"] for r in rows if "eval/synthetic" in r] == eval_steps(SFT_STEPS, RL_STEPS, EVAL_INTERVAL)
    # samples.jsonl: a whole group of each RL step (16 samples, their rewards and group-normalised
    # advantages) and 8 greedy replies of each evaluation, at the steps metrics.jsonl logs them
    samples = read_metrics(run_dir / "samples.jsonl")
    n = cfg.algo.n_samples_per_prompt
    steps = [r["step"] for r in rows if "rl_step" in r]
    assert [r["step"] for r in samples if r["kind"] == "rollout"] == [s for s in steps for _ in range(n)]
    assert [r["step"] for r in samples if r["kind"] == "eval"] == [
        s for s in (r["step"] for r in rows if "eval/synthetic" in r) for _ in range(cfg.logger.eval_samples)]
    for k in range(0, len(steps) * n, n):
        group = [r for r in samples if r["kind"] == "rollout"][k:k + n]
        assert len({r["prompt_index"] for r in group}) == 1 and group[0]["prompt"]
        rewards = [r["reward"] for r in group]
        assert abs(sum(r["advantage"] for r in group)) < 1e-6  # GRPO: advantages sum to zero per group
        if max(rewards) > min(rewards):
            best = max(group, key=lambda r: r["reward"])
            assert best["advantage"] > 0 and best["response"], best
    assert (run_dir / "plots" / "eval_accuracy.png").exists()


def test_engine_matches_trainer_after_each_sync(default_run):
    """Every step's rollout comes from the weights synced after the step before (the SFT
    warm-up's for the first): the trainer recomputes the engine's logprobs on the same tokens."""
    from vlmrl.logging.metrics import read_metrics

    run_dir, _, _ = default_run
    rl = [r for r in read_metrics(run_dir) if "rl_step" in r]
    diffs = [r["train/train_rollout_logprob_abs_diff"] for r in rl]
    assert len(diffs) == RL_STEPS and all(d <= 1e-5 for d in diffs), max(diffs)
    # synchronous: no sample from older weights, and one optimizer step per rollout is on-policy
    assert all(r["rollout/stale_samples"] == 0 and r["train/ppo_kl"] == 0.0 for r in rl)


def test_ray_state_stays_in_run_dir(default_run):
    run_dir, _, _ = default_run
    assert (run_dir / "ray").is_dir() and any((run_dir / "ray").iterdir())
    # only the cluster's own links count: other runs (or tests) may leave directories there
    links = [p for p in Path("/tmp").glob("vlmrl-ray-*") if p.is_symlink()]
    assert not [p for p in links if os.readlink(p).startswith(str(run_dir))]


def test_checkpoint_and_hf_export(default_run):
    from transformers import AutoModelForImageTextToText

    from vlmrl.training.checkpoint import find_latest, read_loop_state

    run_dir, _, _ = default_run
    latest = find_latest(run_dir / "checkpoints")
    assert latest is not None
    state = read_loop_state(latest)
    assert state["step"] == RL_STEPS and state["sft_steps_done"] == SFT_STEPS
    model = AutoModelForImageTextToText.from_pretrained(run_dir / "hf")
    assert sum(p.numel() for p in model.parameters()) > 5e6


@pytest.mark.slow
def test_make_train_learns_at_full_length(tmp_path, cache_dir):
    """`make train` as it stands, the embedded default's 60 SFT + 80 GRPO steps (evals every 20
    steps): greedy accuracy rises by at least +0.2 over the warm-up's (+0.21 to +0.36 on three
    seeds, 0.594 -> 0.844 with this seed, bench/results/make_train.md); minutes on two cores."""
    from vlmrl.config import load
    from vlmrl.loop import train

    cfg = load([f"run_dir={tmp_path}", f"model.cache_dir={cache_dir}", "logger.wandb=false",
                "logger.progress=false"])
    summary = train(cfg)
    assert summary["rl_steps"] == cfg.num_steps == 80 and summary["sft_steps"] == cfg.algo.sft_steps == 60
    assert summary["eval_accuracy_start"] > 0.3
    assert summary["eval_accuracy_end"] >= summary["eval_accuracy_start"] + 0.2, summary


@pytest.mark.slow
def test_qwen35_moe_experiment_learns(tmp_path, cache_dir):
    """`experiment=tiny_qwen35_moe` (the KL term to the warm-up policy and 16 samples a prompt)
    raises the Qwen3.5-MoE miniature's greedy accuracy by at least +0.2 (+0.26 to +0.31 on three
    seeds, bench/results/learning-qwen35.md); about 7 minutes on two cores."""
    from vlmrl.config import load
    from vlmrl.loop import train

    cfg = load([f"run_dir={tmp_path}", f"model.cache_dir={cache_dir}", "experiment=tiny_qwen35_moe", "seed=1234",
                "logger.wandb=false", "logger.progress=false"])
    summary = train(cfg)
    assert summary["rl_steps"] == cfg.num_steps and summary["sft_steps"] == cfg.algo.sft_steps
    assert summary["eval_accuracy_end"] >= summary["eval_accuracy_start"] + 0.2, summary
