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


@pytest.fixture(scope="module")
def result_bf16():
    """The same worker with its bf16 runs too; Inductor's CPU compile of the bf16 graphs takes
    most of a minute, so the tests that read it are `slow` here and run on every GPU test run
    (tests/gpu/test_qwen35_gpu.py::test_fused_layers_on_cuda asserts the same)."""
    return run_in_processes(fused_layer_worker, 1, (37, 50, 41), "cpu", "torch", True, timeout_s=600)[0]


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


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gdn", "attention"])
def test_bf16_fast_path_runs_the_moe_block_in_the_output_graph(result_bf16, kind):
    """bf16: the compiled MoE block runs inside the mixer's output graph (reported as a "moe"
    span after the mixer's), and the layer rounds like Megatron's own bf16 forward: within
    1.5x its difference from the float32 reference plus 1e-2 (an expert, gate or residual
    lost on the way is a difference of order 1)."""
    r = result_bf16[kind]
    assert r["bf16_spans"] == [(kind, "start"), (kind, "stop"), ("moe", "start"), ("moe", "stop")]
    assert r["bf16_fast"] <= 1.5 * r["bf16_megatron"] + 1e-2, r


def test_the_step_observer_times_every_mixer_on_the_fast_path(result):
    """`StepObserver` (the trainer's) over the whole miniature: one span per layer and kind
    (3 Gated DeltaNet and 1 attention layer, 4 MoE blocks), and none of its sinks left after close()."""
    assert result["observed_spans"] == {"gdn": 3, "attention": 1, "moe": 4}
    assert result["sinks_left"] == 0


@pytest.mark.slow
def test_the_step_observer_sees_the_moe_blocks_fused_into_the_output_graphs(result_bf16):
    """bf16, MoE blocks inside the output graphs: still one MoE span per layer, and every MoE
    layer's routing reaches the observer (all 37 + 50 + 41 tokens, top-k times each)."""
    assert result_bf16["observed_spans_bf16"] == {"gdn": 3, "attention": 1, "moe": 4}
    routed = result_bf16["routed_layers_bf16"]
    assert len(routed) == 4 and set(routed.values()) == {result_bf16["routed_expected"]}
