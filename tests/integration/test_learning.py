"""The embedded default learns: a shorter version of `make train` (same model, task and
optimizer; fewer GRPO steps) raises greedy eval accuracy during GRPO.

The run is deterministic on a given machine (seeded data, sampling and initialisation), so
this is a check of the loop's learning, not a statistical test.
"""

from __future__ import annotations

import json


def test_grpo_raises_eval_accuracy_after_the_sft_warm_up(tmp_path, cache_dir):
    from vlmrl.config import load
    from vlmrl.loop import train

    cfg = load([f"run_dir={tmp_path}", f"model.cache_dir={cache_dir}", "num_steps=60", "eval_interval=30",
                "logger.wandb=false", "logger.progress=false"])
    summary = train(cfg)
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    assert summary["sft_steps"] == 60 and summary["rl_steps"] == 60
    assert summary["eval_accuracy_start"] > 0.3  # chance is 0.25: the warm-up started reading images
    assert summary["eval_accuracy_end"] >= summary["eval_accuracy_start"] + 0.1, summary
