"""vlmrl.logging: metrics.jsonl, resume truncation, offline wandb, failures, plots, progress."""

from __future__ import annotations

import io
import json
import warnings

import pytest

from vlmrl.config.schema import LoggerConfig
from vlmrl.logging import (
    MetricsLogger,
    Progress,
    eval_key,
    eval_mean_reward_key,
    format_step_summary,
    is_eval_accuracy_key,
    read_metrics,
    write_plots,
)
from vlmrl.logging import keys as M
from vlmrl.logging.wandb_logger import WANDB_ID_FILE, resolve_mode

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def cfg(**kw) -> LoggerConfig:
    base = dict(name="test", wandb=False, wandb_mode="offline", progress=False, plots=False, jsonl=True)
    base.update(kw)
    return LoggerConfig(**base)


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """wandb strictly offline, every wandb directory inside tmp_path, no console capture."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        d = tmp_path / "wandb-home" / var.lower()
        d.mkdir(parents=True)
        monkeypatch.setenv(var, str(d))
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path


def step_metrics(step: int) -> dict[str, float]:
    return {
        M.ROLLOUT_RAW_REWARD: 0.1 * step,
        M.ROLLOUT_RESPONSE_LEN_MEAN: 100.0 + step,
        M.TRAIN_LOSS: 1.0 / (step + 1),
        M.PERF_STEP_TIME: 2.5,
    }


# ---------------------------------------------------------------- jsonl
def test_jsonl_lines_and_keys(tmp_path):
    run_dir = tmp_path / "run"
    with MetricsLogger(run_dir, cfg(), None, "r") as log:
        for step in range(3):
            log.log(step, step_metrics(step))
        # flushed line by line: readable while the logger is still open
        assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1, 2]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    for step, line in enumerate(lines):
        row = json.loads(line)
        assert set(row) == {"step", "time", *step_metrics(0)}
        assert row["step"] == step and isinstance(row["time"], float)
        assert row[M.ROLLOUT_RAW_REWARD] == pytest.approx(0.1 * step)
    assert read_metrics(run_dir) == read_metrics(run_dir / "metrics.jsonl")  # a directory works too
    assert read_metrics(tmp_path / "missing.jsonl") == []


def test_scalar_objects_become_numbers_and_reserved_keys_raise(tmp_path):
    class Scalar:  # stands in for a numpy / torch 0-d value
        def __init__(self, v):
            self.v = v

        def item(self):
            return self.v

    with MetricsLogger(tmp_path, cfg()) as log:
        log.log(Scalar(4), {M.TRAIN_GRAD_NORM: Scalar(0.5)})
        with pytest.raises(ValueError, match="reserved"):
            log.log(5, {"step": 1.0})
    (row,) = read_metrics(tmp_path)
    assert row["step"] == 4 and row[M.TRAIN_GRAD_NORM] == 0.5


def test_metric_key_constants():
    assert M.TRAIN_ROLLOUT_LOGPROB_ABS_DIFF == "train/train_rollout_logprob_abs_diff"
    assert M.PERF_TOKENS_PER_GPU_PER_SEC == "perf/tokens_per_gpu_per_sec"
    assert eval_key("geo3k") == "eval/geo3k"
    assert eval_mean_reward_key("hiyouga/geometry3k") == "eval/hiyouga_geometry3k/mean_reward"
    assert is_eval_accuracy_key("eval/geo3k")
    assert not is_eval_accuracy_key("eval/geo3k/mean_reward")
    assert not is_eval_accuracy_key("eval/") and not is_eval_accuracy_key(M.TRAIN_LOSS)


# ---------------------------------------------------------------- resume
def test_resume_drops_steps_after_the_checkpoint(tmp_path):
    with MetricsLogger(tmp_path, cfg()) as log:
        for step in range(6):
            log.log(step, step_metrics(step))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "time": 1.0, "rollout/raw_rew')  # torn by a kill
    # the job resumes from the checkpoint of step 3 and logs steps 4 and 5 again
    with MetricsLogger(tmp_path, cfg(), resume_step=3) as log:
        assert [r["step"] for r in log.rows] == [0, 1, 2, 3]
        assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3]
        for step in (4, 5):
            log.log(step, {M.ROLLOUT_RAW_REWARD: -1.0})
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert rows[4][M.ROLLOUT_RAW_REWARD] == -1.0
    assert all(json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())
    # resume_step=-1 starts the run directory afresh; None appends
    with MetricsLogger(tmp_path, cfg(), resume_step=-1) as log:
        log.log(0, {M.TRAIN_LOSS: 0.0})
    with MetricsLogger(tmp_path, cfg()) as log:
        log.log(1, {M.TRAIN_LOSS: 0.0})
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]


def test_jsonl_off_writes_no_file(tmp_path):
    with MetricsLogger(tmp_path, cfg(jsonl=False)) as log:
        log.log(0, {M.TRAIN_LOSS: 1.0})
        log.log_samples(0, [{"kind": "rollout", "response": "x"}])
        assert len(log.rows) == 1
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "samples.jsonl").exists()


def test_samples_carry_their_step_and_a_resume_drops_the_killed_job_s(tmp_path):
    with MetricsLogger(tmp_path, cfg()) as log:
        log.log_samples(0, [])  # nothing to keep: no file
        assert not (tmp_path / "samples.jsonl").exists()
        for step in range(1, 5):
            log.log_samples(step, [{"kind": "rollout", "response": f"reply {step}.{i}"} for i in range(2)])
    rows = read_metrics(tmp_path / "samples.jsonl")
    assert [(r["step"], r["response"]) for r in rows[:3]] == [(1, "reply 1.0"), (1, "reply 1.1"), (2, "reply 2.0")]
    # resumed from the checkpoint of step 2: the samples of steps 3 and 4 are logged again
    with MetricsLogger(tmp_path, cfg(), resume_step=2) as log:
        assert [r["step"] for r in read_metrics(tmp_path / "samples.jsonl")] == [1, 1, 2, 2]
        log.log_samples(3, [{"kind": "eval", "response": "again"}])
    assert [r["step"] for r in read_metrics(tmp_path / "samples.jsonl")] == [1, 1, 2, 2, 3]
    with pytest.raises(RuntimeError, match="after close"):
        log.log_samples(4, [{"kind": "eval"}])


# ---------------------------------------------------------------- wandb
def test_resolve_mode(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert resolve_mode(None) == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_mode(None) == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_mode(None) == "disabled"
    assert resolve_mode("offline") == "offline"


def test_wandb_offline_run_lives_in_run_dir_and_id_is_stable(wandb_env):
    run_dir = wandb_env / "run"
    full = {"run_name": "r", "logger": {"project": "p"}}
    with MetricsLogger(run_dir, cfg(wandb=True, project="vlmrl-test"), full, "r") as log:
        assert log.wandb is not None and log.wandb.active and log.wandb.mode == "offline"
        log.log(1, step_metrics(1))
        log.log(2, step_metrics(2))
    run_id = (run_dir / WANDB_ID_FILE).read_text().strip()
    assert run_id
    offline = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(offline) == 1 and any(offline[0].glob("*.wandb"))

    with MetricsLogger(run_dir, cfg(wandb=True, project="vlmrl-test"), full, "r", resume_step=2) as log:
        assert log.wandb.run_id == run_id
        log.log(3, step_metrics(3))
    assert (run_dir / WANDB_ID_FILE).read_text().strip() == run_id
    runs = list((run_dir / "wandb").glob("offline-run-*"))  # wandb adds "-1" within the same second
    assert len(runs) == 2 and all(run_id in p.name for p in runs)
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]


def test_samples_reach_wandb_as_a_table_per_kind(wandb_env):
    run_dir = wandb_env / "run"
    with MetricsLogger(run_dir, cfg(wandb=True, project="vlmrl-test"), {}, "r") as log:
        log.log_samples(1, [{"kind": "rollout", "response": "a", "reward": 1.0},
                            {"kind": "rollout", "response": "b", "reward": 0.0, "prompt": "p"},
                            {"kind": "eval", "response": "c", "reward": 1.0}])
        log.log(1, step_metrics(1))
    tables = {p.parent.name + "/" + p.name.split("_")[0]: json.loads(p.read_text())
              for p in (run_dir / "wandb").glob("offline-run-*/files/media/table/samples/*.table.json")}
    assert tables == {
        "samples/rollout": {"columns": ["response", "reward", "prompt"], "data": [["a", 1.0, None], ["b", 0.0, "p"]]},
        "samples/eval": {"columns": ["response", "reward"], "data": [["c", 1.0]]}}
    assert len(read_metrics(run_dir / "samples.jsonl")) == 3


def test_wandb_init_failure_keeps_jsonl(wandb_env):
    run_dir = wandb_env / "run"
    with pytest.warns(RuntimeWarning, match="wandb init failed"):
        log = MetricsLogger(run_dir, cfg(wandb=True, wandb_mode="not-a-mode"))
    with log, warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert not log.wandb.active
        for step in range(3):
            log.log(step, step_metrics(step))
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2]


def test_wandb_log_failure_warns_once_and_keeps_jsonl(wandb_env, monkeypatch):
    import wandb

    class BrokenRun:
        calls = 0

        def log(self, metrics, step):
            BrokenRun.calls += 1
            raise ConnectionError("service died")

        def finish(self):  # pragma: no cover - never reached once failed
            raise AssertionError

    monkeypatch.setattr(wandb, "init", lambda **kw: BrokenRun())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with MetricsLogger(wandb_env / "run", cfg(wandb=True)) as log:
            for step in range(4):
                log.log(step, step_metrics(step))
    assert len([w for w in caught if "wandb log failed" in str(w.message)]) == 1
    assert BrokenRun.calls == 1
    assert [r["step"] for r in read_metrics(wandb_env / "run")] == [0, 1, 2, 3]


# ---------------------------------------------------------------- plots
def eval_rows(n_steps: int = 30) -> list[dict]:
    rows = []
    for step in range(n_steps):
        rows.append({"step": step, "time": 0.0, **step_metrics(step)})
        if step % 10 == 0:
            rows.append(
                {
                    "step": step,
                    "time": 0.0,
                    "eval/geo3k": 0.2 + step / 100,
                    "eval/geo3k/mean_reward": 0.3,
                    "eval/synthetic": 0.5,
                    M.TRAIN_LOSS: float("nan"),
                }
            )
    return rows


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1024, path


def test_write_plots_are_valid_pngs(tmp_path):
    out = tmp_path / "plots"
    written = write_plots(eval_rows(), out)
    assert sorted(p.name for p in written) == ["eval_accuracy.png", "response_length.png", "reward.png"]
    for p in written:
        assert p.parent == out
        assert_png(p)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in written)  # no temp files left


def test_write_plots_skips_plots_without_data(tmp_path):
    rows = [{"step": s, M.ROLLOUT_RAW_REWARD: 0.5} for s in range(3)] + [
        {"step": 3, "eval/x/mean_reward": 1.0}
    ]
    written = write_plots(rows, tmp_path)
    assert [p.name for p in written] == ["reward.png"]
    assert write_plots([], tmp_path / "empty") == []


def test_logger_refreshes_plots_when_asked(tmp_path):
    with MetricsLogger(tmp_path, cfg(plots=True)) as log:
        for step in range(5):
            log.log(step, step_metrics(step))
        assert not (tmp_path / "plots").exists()
        log.log(5, {eval_key("geo3k"): 0.4, eval_mean_reward_key("geo3k"): 0.45}, refresh_plots=True)
        for name in ("reward.png", "eval_accuracy.png", "response_length.png"):
            assert_png(tmp_path / "plots" / name)


# ---------------------------------------------------------------- progress
def run_phases(progress: Progress) -> None:
    with progress.task("rollout", total=8) as t:
        t.advance(4)
        t.drop()
        t.advance(4)
        with progress.task("eval", total=None) as e:  # nested, unknown total
            e.advance(3)
    with progress.task("train", total=2) as t:
        t.advance()
        t.advance()
    assert t.completed == 2 and t.elapsed >= 0


def test_progress_disabled_prints_nothing(capsys):
    progress = Progress(enabled=False)
    run_phases(progress)
    assert capsys.readouterr().out == ""
    text = progress.print_step_summary(3, step_metrics(3))
    assert capsys.readouterr().out.strip() == text  # a plain line


def test_progress_not_a_terminal_prints_one_line_per_phase():
    from rich.console import Console

    buf = io.StringIO()
    run_phases(Progress(enabled=True, console=Console(file=buf, force_terminal=False)))
    lines = buf.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[1].startswith("rollout: 8/8") and "1 groups dropped" in lines[1]
    assert lines[0].startswith("eval: 3/?")


def test_progress_live_bars_on_a_terminal():
    from rich.console import Console

    buf = io.StringIO()
    progress = Progress(enabled=True, console=Console(file=buf, force_terminal=True, width=100))
    assert progress.live
    run_phases(progress)
    assert progress._bar is None  # the live display stopped after the last phase
    progress.print_step_summary(1, step_metrics(1))
    assert "step 1" in buf.getvalue()


def test_step_summary_line():
    metrics = {
        **step_metrics(2),
        "eval/geo3k": 0.5,
        "eval/geo3k/mean_reward": 0.6,
        M.TRAIN_PPO_KL: float("nan"),
        M.PERF_TOKENS_PER_GPU_PER_SEC: 123456.7,
    }
    line = format_step_summary(2, metrics)
    assert line.startswith("step 2 | reward 0.2 | eval/geo3k 0.5 | len 102")
    assert "mean_reward" not in line and "kl" not in line and "tok/s/gpu 123457" in line
    assert "\n" not in line
    # with a KL term, "kl" is the KL to the reference policy; the PPO ratio's KL has its own label
    line = format_step_summary(3, {**step_metrics(3), M.TRAIN_KL: 0.125, M.TRAIN_PPO_KL: 0.0})
    assert "| kl 0.125 | ppo_kl 0 |" in line


def test_moe_runs_get_a_load_imbalance_plot(tmp_path):
    from vlmrl.logging.plots import MOE_IMBALANCE_PNG

    rows = [{"step": s, **step_metrics(s), "moe/imbalance/layer_1": 1.2 + 0.01 * s,
             "moe/imbalance/layer_12": 2.0, "moe/imbalance_max": 2.0} for s in range(5)]
    written = write_plots(rows, tmp_path)
    assert MOE_IMBALANCE_PNG in [p.name for p in written]
    assert (tmp_path / MOE_IMBALANCE_PNG).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert MOE_IMBALANCE_PNG not in [p.name for p in write_plots(eval_rows(), tmp_path / "dense")]


def test_an_rl_steps_row_is_assembled_from_its_stages():
    """`rl_step_metrics`: loss terms are means over the step's optimizer steps, perf/ counts
    (micro-batches, pad tokens) sums, MoE figures means; throughput divides by the step's time
    and devices; a reason train_samples never saw counts 0; memory moves and dynamic sampling
    appear only when the run has them; every key is one `keys.py` documents."""
    from vlmrl.logging import keys as mk
    from vlmrl.logging.step_metrics import StepCounts, StepTimes, rl_step_metrics

    train = [{"loss": 1.0, "kl": 0.2, "perf/micro_batches": 3, "moe/load_imbalance": 1.5},
             {"loss": 3.0, "kl": 0.4, "perf/micro_batches": 5, "moe/load_imbalance": 2.5}]
    times = StepTimes(rollout=1.0, logprob=0.5, train=2.0, sync=0.5, step=4.0)
    counts = StepCounts(retries=2, skipped={"prompt_mismatch": 1, "no_routed_experts": 2}, stale_samples=3)
    row = rl_step_metrics(rollout={mk.ROLLOUT_RAW_REWARD: 0.25}, sampling=None, train_metrics=train, tokens=800,
                          devices=2, times=times, sync_bytes=2_000_000_000, sync_phases={}, counts=counts, moved=None)
    assert row[mk.TRAIN_LOSS] == 2.0 and abs(row[mk.TRAIN_KL] - 0.3) < 1e-12
    assert row["perf/micro_batches"] == 8 and row["moe/load_imbalance"] == 2.0
    assert row[mk.PERF_TOKENS_PER_GPU_PER_SEC] == 100.0 and row[mk.PERF_UPDATE_WEIGHTS_GB_PER_S] == 4.0
    assert row["rollout/prompt_mismatch_samples"] == 1 and row["rollout/bad_routed_experts_samples"] == 2
    assert row["rollout/retries"] == 2 and row["rollout/stale_samples"] == 3 and row[mk.ROLLOUT_RAW_REWARD] == 0.25
    assert mk.PERF_OFFLOAD_TIME not in row and "rollout/kept_groups" not in row
    row = rl_step_metrics(rollout={}, sampling={"rollout/kept_groups": 4.0}, train_metrics=[], tokens=0, devices=1,
                          times=StepTimes(), sync_bytes=0, sync_phases={}, counts=StepCounts(),
                          moved={"offload": 0.7})
    assert row[mk.PERF_OFFLOAD_TIME] == 0.7 and row[mk.PERF_ONLOAD_TIME] == 0.0 and row["rollout/kept_groups"] == 4
    assert mk.TRAIN_LOSS not in row  # no optimizer step, no loss
    documented = mk.__doc__
    assert not [k for k in row if k.split("/")[0] in ("rollout", "data") and k not in documented]
