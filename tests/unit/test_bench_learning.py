"""The learning bench's bookkeeping (`vlmrl.bench.learning`): which runs it plans, what it reads
back from a run dir (also one that died part way), and the per-configuration summary."""

import json

import pytest

from vlmrl.bench.learning import Run, by_variant, markdown, parse_variant, plan_runs, read_run


def _write_run(run_dir, *, rewards, evals, summary=None, entropy=1.0, gap=0.002):
    run_dir.mkdir(parents=True)
    rows = [{"step": s, "eval/synthetic": a} for s, a in evals]
    for i, r in enumerate(rewards, start=61):
        rows.append({"step": i, "rl_step": i - 60, "rollout/raw_reward": r, "train/entropy": entropy - 0.01 * i,
                     "train/kl": 0.1, "train/train_rollout_logprob_abs_diff": gap,
                     "eval/synthetic/mean_reward": 0.9})  # a sub-key of the eval: not an accuracy
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{\"step\": 99, \"trunc")
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))


def test_runs_are_planned_per_warm_up_then_seed_then_variant(tmp_path):
    runs = plan_runs([("a", ["x=1"]), ("b", [])], ["base=0"], [1, 2], [7, 8], tmp_path)
    assert [r.name for r in runs] == ["a_s1_d7", "b_s1_d7", "a_s2_d7", "b_s2_d7",
                                      "a_s1_d8", "b_s1_d8", "a_s2_d8", "b_s2_d8"]
    cmd = runs[0].command("py")
    assert cmd[:3] == ["py", "-m", "vlmrl.train"]
    # the run's own seeds, then the common overrides, then the variant's (which win)
    assert cmd.index("seed=1") < cmd.index("base=0") < cmd.index("x=1") and "data.seed=7" in cmd
    assert not any("base_port" in c for c in cmd)
    # SGLang runs side by side: each its own range of ports
    ports = [r.sglang_port for r in plan_runs([("a", [])], [], [1, 2], [7], tmp_path, sglang_ports_from=20000)]
    assert ports == [20000, 20100]
    assert "rollout.sglang.base_port=20100" in plan_runs([("a", [])], [], [1, 2], [7], tmp_path, 20000)[1].command("py")


def test_a_run_is_read_from_its_metrics_and_summary(tmp_path):
    run = Run("bf16", 1, 7, [], tmp_path / "r")
    _write_run(run.run_dir, rewards=[0.1] * 10 + [0.3] * 5, evals=[(20, 0.25), (60, 0.4), (75, 0.55)],
               summary={"eval_accuracy_start": 0.4, "eval_accuracy_end": 0.55, "train_seconds": 12.5})
    row = read_run(run, 0)
    assert row.gain == pytest.approx(0.15) and row.rl_steps == 15
    assert row.evals == [(20, 0.25), (60, 0.4), (75, 0.55)]  # the cut last line is left out
    assert row.reward_windows == [pytest.approx(0.1), pytest.approx(0.3)]
    assert row.entropy[0] > row.entropy[1] and row.kl_last == pytest.approx(0.1)
    assert row.gap_mean == pytest.approx(0.002) and row.train_seconds == 12.5


def test_a_run_that_died_keeps_what_it_logged_and_counts_as_unfinished(tmp_path):
    done, died = Run("v", 1, 1, [], tmp_path / "a"), Run("v", 2, 1, [], tmp_path / "b")
    _write_run(done.run_dir, rewards=[0.2], evals=[(60, 0.5)],
               summary={"eval_accuracy_start": 0.5, "eval_accuracy_end": 0.7})
    _write_run(died.run_dir, rewards=[0.2, 0.4], evals=[(60, 0.5)])
    rows = [read_run(done, 0), read_run(died, None)]
    assert rows[1].gain is None and rows[1].rl_steps == 2
    [summary] = by_variant(rows)
    assert summary["runs"] == 2 and summary["finished"] == 1 and summary["mean_gain"] == pytest.approx(0.2)
    text = markdown(rows, [("v", [])], [], "cmd", "2026-12-06", "CPU")
    assert "| v | 2 | 1 | +0.200 |" in text and "| v s2 d1 | None |" in text


def test_variants_are_named_overrides():
    assert parse_variant("bf16=hardware.train_dtype=bfloat16 model.dtype=bfloat16") == (
        "bf16", ["hardware.train_dtype=bfloat16", "model.dtype=bfloat16"])
    assert parse_variant("base=") == ("base", [])
    with pytest.raises(Exception, match="NAME=OVERRIDES"):
        parse_variant("no-equals-sign")
