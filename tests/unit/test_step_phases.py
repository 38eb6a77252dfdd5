"""The step split of `python -m vlmrl.bench step-phases`: its parts add up to the step, and
the moves inside a stage leave that stage's own time."""

from __future__ import annotations

import pytest

from vlmrl.bench.step_phases import split, summarise
from vlmrl.logging import keys as mk


def _row(step: int, **moves: float) -> dict[str, float]:
    row = {"step": step, "rl_step": step, mk.PERF_STEP_TIME: 4.0, mk.PERF_ROLLOUT_TIME: 1.5,
           mk.PERF_TRAIN_TIME: 2.0, mk.PERF_UPDATE_WEIGHTS_TIME: 0.1}
    row.update({mk.perf_move_to(p): s for p, s in moves.items()})
    return row


def test_a_step_without_moves_is_generation_training_and_the_sync():
    s = split(_row(1))
    assert (s["generate"], s["train"], s["sync"]) == (1.5, 2.0, 0.1)
    assert s["outside"] == pytest.approx(0.5) and s["loop"] == pytest.approx(0.4)


def test_moves_leave_the_stage_they_entered_and_count_outside():
    row = _row(1, generate=0.3, train=0.4, sync=0.2) | {mk.PERF_ONLOAD_OVERLAP_WAIT_TIME: 0.1,
                                                         mk.PERF_EXPERIENCE_TIME: 0.05}
    s = split(row)
    assert s["generate"] == pytest.approx(1.2) and s["train"] == pytest.approx(1.5)
    assert s["outside"] == pytest.approx(4.0 - 1.2 - 1.5)
    assert s["generate"] + s["train"] + s["outside"] == pytest.approx(s["step"])
    # the sync's move sits between training and the sync, in neither stage's clock
    assert s["loop"] == pytest.approx(s["outside"] - 0.3 - 0.4 - 0.2 - 0.1 - 0.1 - 0.05)
    assert s["outside_share"] == pytest.approx(s["outside"] / 4.0)


def test_the_mean_leaves_out_the_first_steps_and_a_row_without_times_is_named():
    rows = [_row(1, generate=2.0), _row(2, generate=0.5), _row(3, generate=0.3)]
    m = summarise(rows, skip=1)
    assert m["steps"] == 2 and m["move_generate"] == pytest.approx(0.4)
    with pytest.raises(ValueError, match="untraced RL steps after the first 3"):
        summarise(rows, skip=3)
    with pytest.raises(KeyError, match="step 7.*perf/train_time"):
        split({"step": 7, mk.PERF_STEP_TIME: 1.0, mk.PERF_ROLLOUT_TIME: 0.5})


def test_the_command_names_a_run_without_metrics(tmp_path, capsys):
    from vlmrl.bench.step_phases import main

    assert main([str(tmp_path)]) == 1
    assert f"no {tmp_path / 'metrics.jsonl'}" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "sft/loss": 1.0}\n')
    assert main([str(tmp_path)]) == 1
    assert "no RL steps" in capsys.readouterr().err


def test_traced_steps_are_marked_and_left_out_of_the_mean(tmp_path):
    """A step traced with torch.profiler (`profile_steps`, its profile/rl_step_<n> folder)
    runs slower: shown, marked, and not averaged."""
    import json

    from vlmrl.bench.step_phases import main

    rows = [_row(1), _row(2, generate=0.5), _row(3, generate=0.3), _row(4, generate=3.0)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "profile" / "rl_step_4").mkdir(parents=True)
    (tmp_path / "profile" / "notes").mkdir()  # not a step's folder
    out = tmp_path / "phases.md"
    assert main([str(tmp_path), "--out", str(out)]) == 0
    text = out.read_text()
    assert "| 4 (traced) |" in text and "| 3 |" in text
    mean = next(line for line in text.splitlines() if line.startswith("| mean of 2 (after 1, untraced)"))
    assert mean.split(" | ")[5] == "0.400"  # move_generate: steps 2 and 3 only
