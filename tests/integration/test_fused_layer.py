"""`FusedTransformerLayer` (`hardware.fused_kernels`) on the Qwen3.5-MoE miniature's two layer
kinds against Megatron's forward of the same layer, in a gloo process (Inductor's CPU backend
compiles the graphs; tests/gpu runs the same worker on CUDA).

float32: the fast path is Megatron's maths up to summation order, so outputs and every
gradient (input, norms, projections, gates, conv, decay parameters, experts) agree to 1e-5 of
their scale. bf16 (the MoE block compiled as well) is checked on the GPU
(tests/gpu/test_qwen35_gpu.py::test_fused_layers_on_cuda, the same worker): its worst
difference from the float32 reference may not exceed 1.5x Megatron's own bf16 difference plus
1e-2, i.e. it rounds like a bf16 forward, not like another computation (a wrong head split or
a missed gate is O(1)).
"""

from __future__ import annotations

import pytest
from _dist import fused_layer_worker, run_in_processes


@pytest.fixture(scope="module")
def result():
    return run_in_processes(fused_layer_worker, 1, (37, 50, 41), "cpu", "torch", False, timeout_s=600)[0]


def test_every_layer_of_the_hybrid_model_takes_the_fast_path(result):
    assert result["fast_path"] and all(result["fast_path"])
    assert result["compiled_graphs"] >= 4  # gdn_in, gdn_out, attention_in, attention_out
    assert result["gdn"]["moe_compiled"] and result["attention"]["moe_compiled"]  # set for the bf16 block


@pytest.mark.parametrize("kind", ["gdn", "attention"])
def test_fast_path_is_megatrons_maths_in_fp32(result, kind):
    assert result[kind]["fp32"] <= 1e-5


@pytest.mark.parametrize("kind", ["gdn", "attention"])
def test_fast_path_reports_the_mixer_span(result, kind):
    """The mixer module is not called on the fast path; the layer reports its span (one fast
    forward), Megatron's forward reports none through the sink."""
    assert result[kind]["spans"] == [(kind, "start"), (kind, "stop")]


def test_the_step_observer_times_every_mixer_on_the_fast_path(result):
    """`StepObserver` (the trainer's) over the whole miniature: one span per layer and kind
    (3 Gated DeltaNet and 1 attention layer, 4 MoE blocks), and none of its sinks left after close()."""
    assert result["observed_spans"] == {"gdn": 3, "attention": 1, "moe": 4}
    assert result["sinks_left"] == 0
