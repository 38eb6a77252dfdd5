"""The compiled MoE block (`hardware.fused_kernels`, `vlmrl.models.moe.moe_forward`) against
Megatron's MoE forward on the same layer of the Qwen3.5-MoE miniature, in a gloo process.

float32 (eager): the same maths up to summation order, so outputs and gradients (input,
router, experts, shared expert and its gate) agree to 1e-5 of their scale. bf16 (compiled by
Inductor, the CPU backend here; tests/gpu runs it on CUDA): its worst difference from the
float32 reference may not exceed 1.5x Megatron's own bf16 difference plus 1e-2, i.e. it
rounds like a bf16 forward, not like a different computation (a wrong routing or a missed
weight is O(1)). The routing counts reported to the step observer equal the router's. The
router's precision (`trainer.moe_router_precision`) and routing replay hold on both paths, and
the router in the engines' precision breaks bf16 near-ties as transformers' router does.
"""

from __future__ import annotations

import pytest
from _dist import compiled_moe_worker, run_in_processes


@pytest.fixture(scope="module")
def result():
    return run_in_processes(compiled_moe_worker, 1, 48, timeout_s=600)[0]


def test_compiled_moe_block_is_megatrons_maths(result):
    assert result["eager_fp32_vs_megatron"] <= 1e-5


def test_compiled_moe_block_rounds_like_bf16(result):
    assert result["compiled_bf16_vs_megatron_fp32"] <= 1.5 * result["megatron_bf16_vs_megatron_fp32"] + 1e-2


def test_compiled_moe_block_reports_the_routing(result):
    assert result["counts_match"] == 1.0


def test_configurations_the_block_does_not_compute_keep_megatrons_forward(result):
    """An auxiliary loss, expert bias, pre-softmax routing or a capacity: `compiled_path_problem`
    names it and the layer keeps Megatron's forward."""
    problems = result["problems"]
    assert problems.pop("none") is None
    assert problems == {"moe_aux_loss_coeff": "auxiliary / z losses",
                        "moe_router_enable_expert_bias": "top-k scaling / expert bias / group-limited routing",
                        "moe_router_pre_softmax": "router score function is not softmax after top-k",
                        "moe_expert_capacity_factor": "expert capacity"}


def test_the_compiled_path_ran(result):
    assert result["compiled_graphs"] >= 1  # Dynamo compiled the block (and the test's bf16 run was not eager)
    assert 0 < result["compiled_vs_megatron_bf16_output"] < 0.5  # another rounding, the same values


def test_router_in_the_engines_precision_compiles_and_routes_as_megatron(result):
    """`trainer.moe_router_precision=engine` (Megatron's moe_router_dtype=None: bf16 logits,
    as transformers and SGLang compute them) keeps the compiled block, which then routes every
    token as Megatron's bf16 router does and gives the same outputs up to bf16 rounding."""
    assert result["engine_precision_problem"] is None
    assert result["engine_precision_counts_match"] == 1.0 and result["engine_precision_tokens_differ"] == 0.0
    assert result["engine_precision_compiled_vs_megatron"] < 0.5


def test_compiled_block_replays_and_measures_as_megatrons_router(result):
    """With the engine's experts on the router (`vlmrl.models.routing`) the compiled block
    routes every reported token to them, as Megatron's RouterReplay does (the same tokens per
    expert, the same outputs up to bf16 rounding, other outputs than the layer's own routing),
    and reports the same disagreement with the engine (tokens, of the reported ones)."""
    megatron_counts, compiled_counts = result["replay_counts"]
    assert compiled_counts == megatron_counts
    assert result["replay_compiled_vs_megatron"] < 0.5
    assert result["replay_vs_own_routing"] > 1.0
    (m_differ, m_known), (c_differ, c_known) = result["replay_mismatch_reported"]
    assert m_known == c_known == 48 - 3 and 0 < c_differ == m_differ <= c_known


def test_router_in_the_engines_precision_breaks_bf16_near_ties_as_transformers():
    """Tokens whose top-k set changes when their logits are rounded to bf16 (a near-tie): the
    float32 router (Megatron's default) picks the exact order there and so other experts than
    transformers' bf16 router, the engine's; `trainer.moe_router_precision=engine` picks what
    transformers picks on every token."""
    from _dist import near_tie_router_worker

    res = run_in_processes(near_tie_router_worker, 1, 8192, timeout_s=300)[0]
    assert res["near_ties"] > 0
    assert res["fp32"] == res["near_ties"]
    assert res["engine"] == 0
