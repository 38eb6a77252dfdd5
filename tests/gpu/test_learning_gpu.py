"""GRPO learns on the GPU in bfloat16, as it does on the CPU in float32: the Qwen3.5-MoE
miniature's recipe (`experiment=tiny_qwen35_moe`), trainer and embedded engine on one GPU in
bf16 (the engine on the GPU of its bundle, `rollout.embedded.device=auto`), colocated.

What is checked is what each update did to the samples it trained on: the trainer's logprobs
of a step's samples are taken before and after its optimizer step, and the reward of that
batch, re-weighted by how much likelier each sample became (self-normalised within its prompt's
group), must rise. An update that bf16 rounds away, or that moves against the advantages,
leaves it where it was or lowers it. Greedy accuracy over a whole run, which varies between
warm-ups as much as between precisions, is measured by `python -m vlmrl.bench.learning`
(bench/results/learning-gpu.md), not here.
"""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.gpu

# the tiny model needs none of the compiled kernels (their compile would dominate the test)
SLOW_PATHS = ["hardware.fused_kernels=false", "hardware.cuda_graphs=false", "hardware.gdn_backend=torch",
              "hardware.lm_attention_backend=sdpa", "hardware.vision_attn_implementation=sdpa"]
GPU = ["hardware=h200", "cluster.num_gpus=1", "cluster.colocate=true", "rollout.num_gpus=1", "model.dtype=bfloat16"]
RL_STEPS = 12


def reweighted_reward(rewards: list[float], groups: list[int], shift: list[float]) -> float:
    """The batch's mean reward with each sample weighted by exp(its logprob change), the weights
    normalised within its group (`groups`: the group of each sample)."""
    by: dict[int, list[tuple[float, float]]] = {}
    for r, g, s in zip(rewards, groups, shift):
        by.setdefault(g, []).append((r, s))
    means = []
    for items in by.values():
        top = max(s for _, s in items)
        w = [math.exp(s - top) for _, s in items]
        means.append(sum(r * wi for (r, _), wi in zip(items, w)) / sum(w))
    return sum(means) / len(means)


def prompt_key(sample) -> tuple:
    """The prompt a sample answers: its prompt tokens and its image (a step's samples come shuffled)."""
    start = sample.loss_mask.index(1.0)
    image = None if sample.pixel_values is None else (tuple(sample.pixel_values.shape), float(sample.pixel_values.sum()))
    return (tuple(sample.input_ids[:start]), image)


def learning_loop(run_dir, cache_dir, overrides):
    """A run of the recipe whose trainer records, for every RL update, the rewards of its samples
    and each sample's summed logprob change over the update."""
    import ray

    from vlmrl.cluster.trainer_group import TrainerGroup
    from vlmrl.config import load
    from vlmrl.loop import Loop

    cfg = load([f"run_dir={run_dir}", f"model.cache_dir={cache_dir}", "experiment=tiny_qwen35_moe",
                "logger.wandb=false", "logger.progress=false", f"num_steps={RL_STEPS}", "eval_interval=0",
                *overrides])
    loop = Loop(cfg)
    updates: list[dict[str, list[float]]] = []
    placements: list[dict[str, str]] = []
    train_step, start_engines = TrainerGroup.train_step, loop._start_engines

    def recorded(group, samples):
        before = group.logprobs(samples)
        out = train_step(group, samples)
        after = group.logprobs(samples)
        updates.append({"advantage": [s.advantage for s in samples], "group": [prompt_key(s) for s in samples],
                        "shift": [float((a - b).sum()) for a, b in zip(after, before)]})
        return out

    def start_and_look() -> None:
        start_engines()
        if loop.engine_group._embedded:
            placements.append(ray.get(loop.engine_group._embedded[0].placement.remote()))

    loop._start_engines = start_and_look
    TrainerGroup.train_step = recorded
    try:
        summary = loop.run()
    finally:
        TrainerGroup.train_step = train_step
    return cfg, summary, updates, placements


def test_each_bf16_grpo_update_raises_the_reward_of_its_own_samples(tmp_path, cache_dir):
    from vlmrl.logging.metrics import read_metrics

    cfg, summary, updates, placements = learning_loop(tmp_path, cache_dir, [*GPU, *SLOW_PATHS])
    assert cfg.hardware.train_dtype == "bfloat16"
    assert placements == [{"device": "cuda", "dtype": "bfloat16"}]
    assert summary["rl_steps"] == RL_STEPS and len(updates) == RL_STEPS
    samples = [r for r in read_metrics(tmp_path / "samples.jsonl") if r["kind"] == "rollout"]
    assert samples  # the loop logged its groups
    gains = []
    for u in updates:
        adv, groups = u["advantage"], u["group"]
        assert len(set(groups)) == cfg.rollout.batch_size
        # binary rewards: within a group that holds both, the right replies are those with a
        # positive (group-normalised) advantage; all-equal groups weigh nothing here
        rewards = [1.0 if a > 0 else 0.0 for a in adv]
        if not any(a != 0 for a in adv):
            continue
        gains.append(reweighted_reward(rewards, groups, u["shift"]) - reweighted_reward(rewards, groups, [0.0] * len(adv)))
    assert len(gains) >= RL_STEPS // 2, "too few steps with a right and a wrong reply in a group"
    assert sum(g > 0 for g in gains) >= 0.8 * len(gains), gains
    assert sum(gains) / len(gains) > 1e-3, gains
    rl = [r for r in read_metrics(tmp_path) if "rl_step" in r]
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in rl) < 2e-2  # bf16 both sides: ~2e-3
