"""The memory plan's training activations (`vlmrl.config.memory.layer_activation_bytes` and
the backward's MoE peak) against the real layers: the Qwen3.5-MoE miniature in bf16 with the
paths the H200 runs measured (torch Gated DeltaNet, SDPA attention, Megatron's MoE layer with
vlmrl's experts, no fused kernels), run forward and backward in a gloo process, with the
bytes of every tensor autograd saves counted per layer kind and part. The formula is the
plan's count of the same code: a change to what a layer keeps that the plan does not follow
moves one of these figures beyond its bound."""

from __future__ import annotations

import pytest
from _dist import activation_bytes_worker, run_in_processes

from vlmrl.config import load
from vlmrl.config.memory import (
    gdn_chunk_size,
    head_activation_bytes,
    layer_activation_bytes,
    moe_backward_bytes,
)

OVERRIDES = ["model=tiny_qwen3_5_moe", "model.dtype=bfloat16", "hardware.train_dtype=bfloat16",
             "hardware.gdn_backend=torch", "hardware.fused_kernels=false"]
# packed samples of one length, a whole number of the Gated DeltaNet path's chunks (96 tokens:
# chunks of 16), so that nothing is padded; two sizes of micro-batch
PACKS = [(96, 96), (96, 96, 96, 96)]


@pytest.fixture(scope="module")
def measured():
    return run_in_processes(activation_bytes_worker, 1, OVERRIDES, PACKS, timeout_s=300)[0]


def _cfg():
    return load(OVERRIDES, check_rules=False)


def test_the_plan_mirrors_the_gated_deltanet_chunk():
    from vlmrl.models.gated_delta import chunk_size

    assert [gdn_chunk_size(n) for n in range(1, 5000)] == [chunk_size(n) for n in range(1, 5000)]
    assert gdn_chunk_size(96) == 16


def test_saved_bytes_are_linear_in_tokens(measured):
    """Twice the tokens, twice the bytes: the same bytes per token within 1%."""
    small, large = (p["per_token"] for p in measured["packs"])
    assert set(small) == set(large)
    for part in small:
        assert large[part] == pytest.approx(small[part], rel=0.01), part


@pytest.mark.parametrize("kind", ["linear_attention", "full_attention"])
@pytest.mark.parametrize("part", ["norms", "mixer", "mlp"])
def test_each_layer_part_keeps_what_the_plan_counts(measured, kind, part):
    want = getattr(layer_activation_bytes(_cfg(), kind, longest=96), part)
    for pack in measured["packs"]:
        assert pack["per_token"][f"{kind}/{part}"] == pytest.approx(want, rel=0.01), (pack["lens"], want)


def test_the_head_keeps_what_the_plan_counts(measured):
    """Final norm, the output layer's input and the loss's float32 log-softmax; the embedding
    and anything else outside the layers keep nothing worth counting."""
    want = head_activation_bytes(_cfg())
    for pack in measured["packs"]:
        per = pack["per_token"]
        assert per["head"] == pytest.approx(want, rel=0.01)
        assert per.get("other", 0.0) < 0.01 * want


def test_the_moe_backward_allocates_what_the_plan_counts(measured):
    """One MoE block's backward beyond what was live when it started. The plan counts the GPU's
    grouped GEMM (the [gate; up] weight gradient with the gradients of fc1's output and of the
    dispatched tokens); the CPU loops over the experts and stacks their weight gradients
    (`unbind`'s backward), which may also hold the down projection's: between the plan's
    weight gradient alone and the plan with the down projection's gradient added."""
    cfg = _cfg()
    lm = cfg.model.lm
    want = moe_backward_bytes(cfg, measured["moe_tokens"])
    gate_up = lm.num_experts * 2 * lm.moe_ffn_hidden_size * lm.hidden_size * 2
    down = gate_up / 2
    assert gate_up < measured["moe_backward"] <= want + down, (measured["moe_backward"], want)
