"""The train-gpu bench's idle accounting (`idle_gaps`), on activity intervals built here."""

import pytest

from vlmrl.bench.train_gpu import MARKER_KERNEL, idle_gaps


def test_idle_gaps_counts_overlap_once_and_splits_at_the_marker():
    acts = [
        (100.0, 110.0, "gemm"),
        (105.0, 120.0, "copy"),          # overlaps the GEMM: covered time counted once
        (150.0, 160.0, "norm"),          # 30 us idle before it
        (162.0, 163.0, MARKER_KERNEL),   # 2 us idle, below the listed minimum; forward ends here
        (200.0, 260.0, "gemm_bwd"),      # 37 us idle, in the backward
        (210.0, 220.0, "inside"),        # inside the previous activity: no gap, no busy time
    ]
    r = idle_gaps(list(reversed(acts)), MARKER_KERNEL)
    assert r["span_us"] == pytest.approx(160.0)
    assert r["busy_us"] == pytest.approx(20 + 10 + 1 + 60)
    assert r["idle_us"] == pytest.approx(30 + 2 + 37)
    assert r["busy_us"] + r["idle_us"] == pytest.approx(r["span_us"])
    assert r["forward_span_us"] == pytest.approx(62.0) and r["forward_idle_us"] == pytest.approx(32.0)
    assert [(g["gap_us"], g["after"], g["before"]) for g in r["gaps"]] == [
        (pytest.approx(37.0), MARKER_KERNEL, "gemm_bwd"), (pytest.approx(30.0), "copy", "norm")]
    assert r["gaps"][1]["at_us"] == pytest.approx(20.0)


def test_idle_gaps_without_a_marker_or_activity():
    assert idle_gaps([], MARKER_KERNEL)["idle_us"] == 0.0
    r = idle_gaps([(0.0, 5.0, "a"), (5.0, 9.0, "b")], MARKER_KERNEL)
    assert r["idle_us"] == 0.0 and r["busy_us"] == pytest.approx(9.0) and "forward_span_us" not in r
