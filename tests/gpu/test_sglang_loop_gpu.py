"""The RL loop with the real SGLang, colocated with the trainer on one GPU: rollouts on image
prompts, rewards, GRPO steps, the trainer offloaded while the engine generates, the engine
released while the trainer trains, weight syncs checked by the logprob gap, a checkpoint and
a resume from it. Set-up and skips as in test_sglang_gpu.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).resolve().parent))

LOOP = ["num_steps=2", "algo.sft_steps=0", "eval_interval=0", "rollout.eval.max_prompts=8", "rollout.batch_size=4",
        "algo.n_samples_per_prompt=4", "trainer.global_batch_size=16", "rollout.max_new_tokens=32",
        "save_interval=2", "data.synthetic.num_train=64", "data.synthetic.num_test=16"]


def test_colocated_loop_with_sglang_checkpoint_and_resume(tmp_path, cache_dir):
    from test_sglang_gpu import MEAN_LOGPROB_TOL, sglang_overrides

    from vlmrl.config import load
    from vlmrl.logging.metrics import read_metrics
    from vlmrl.loop import train
    from vlmrl.training.checkpoint import find_latest

    offload = importlib.util.find_spec("torch_memory_saver") is not None
    base = [*sglang_overrides(str(tmp_path), cache_dir), *LOOP, f"trainer.offload={str(offload).lower()}"]
    summary = train(load(base))
    assert summary["rl_steps"] == 2
    assert find_latest(tmp_path / "checkpoints") is not None
    # the same run dir, one step further: resumes from the step-2 checkpoint
    summary = train(load([*base, "num_steps=3"]))
    assert summary["rl_steps"] == 3
    rl = [r for r in read_metrics(tmp_path) if "rl_step" in r]
    assert [r["rl_step"] for r in rl] == [1, 2, 3]
    for r in rl:
        assert r["train/train_rollout_logprob_abs_diff"] < MEAN_LOGPROB_TOL, r
        assert r["rollout/stale_samples"] == 0 and r["rollout/dropped_groups"] == 0
        assert r["perf/rollout_time"] > 0 and r["perf/update_weights_time"] > 0
        if offload:
            assert r["perf/offload_time"] > 0 and r["perf/onload_time"] > 0
