"""`python -m vlmrl.bench step-trace`: a traced step's stages, how long the device worked in
each (kernels side by side counted once) and its copies, read from a rank's Chrome trace."""

from __future__ import annotations

import gzip
import json

import pytest

from vlmrl.bench.step_trace import main, summarize, union_us


def _x(name: str, cat: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": 1}


def test_union_counts_overlaps_once_and_clips_to_the_window():
    assert union_us([(0, 10), (5, 20), (30, 40)], 0, 100) == 30
    assert union_us([(0, 10), (5, 20), (30, 40)], 8, 35) == 17
    assert union_us([], 0, 10) == 0


def test_stages_are_split_into_kernels_copies_and_the_wait_for_the_host():
    events = [
        _x("vlmrl.forward_backward", "user_annotation", 1000, 1000),
        _x("vlmrl.optimizer_step", "user_annotation", 2000, 100),
        _x("aten::mm", "cpu_op", 1000, 900),
        _x("sm90_xmma_gemm_bf16", "kernel", 1100, 200),  # two kernels side by side: 300 us of work
        _x("void at::native::vectorized_elementwise_kernel", "kernel", 1200, 200),
        _x("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 1500, 400),  # the overlapped copy in
        _x("multi_tensor_apply_kernel", "kernel", 2000, 80),
        {"ph": "i", "name": "marker", "ts": 0},  # untimed events are not counted
    ]
    s = summarize(events)
    stages = {r["stage"]: r for r in s["stages"]}
    assert list(stages) == ["step", "vlmrl.forward_backward", "vlmrl.optimizer_step"]
    fb = stages["vlmrl.forward_backward"]
    assert fb["span_ms"] == 1.0 and fb["kernels_ms"] == pytest.approx(0.3) and fb["busy"] == pytest.approx(0.3)
    assert fb["copies_ms"] == pytest.approx(0.4)
    assert stages["vlmrl.optimizer_step"]["busy"] == pytest.approx(0.8)
    assert stages["step"]["span_ms"] == pytest.approx(1.1) and s["on_gpu"]
    assert set(s["kernel_ms_by_kind"]) == {"GEMM", "other eager elementwise / reductions",
                                           "multi-tensor (optimizer: Adam, grad norm and scale)"}


def test_the_command_finds_the_traced_step_and_names_what_is_missing(tmp_path, capsys):
    assert main([str(tmp_path)]) == 1
    assert "0 traced steps" in capsys.readouterr().err
    folder = tmp_path / "profile" / "rl_step_3"
    folder.mkdir(parents=True)
    assert main([str(tmp_path)]) == 1 and "no rank<r>.json.gz" in capsys.readouterr().err
    for rank in (1, 0):
        with gzip.open(folder / f"rank{rank}.json.gz", "wt") as f:
            json.dump({"traceEvents": [_x("vlmrl.forward_backward", "user_annotation", 0, 500),
                                       _x("aten::mm", "cpu_op", 0, 400)]}, f)
    out = tmp_path / "trace.md"
    assert main([str(tmp_path), "--out", str(out)]) == 0
    text = out.read_text()
    assert text.index("**rank0**") < text.index("**rank1**") and "no device activity" in text
    assert "| vlmrl.forward_backward | 0.5 | 0.0 | 0% | 0.0 |" in text
    assert main([str(tmp_path), "--step", "4"]) == 1 and "rl_step_3" in capsys.readouterr().err
