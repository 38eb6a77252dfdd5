"""The Qwen3.5-MoE training bench trains the same weights on both sides of its pair
(`vlmrl.bench.train_gpu.hf_qwen35_moe_model`, `load_hf_language_model`), on the same work:
vlmrl's packed samples and HF's batch rows of them give the same logits. Checked on the
miniature in float32 on the CPU against HF transformers."""

from __future__ import annotations

from _dist import bench_weights_worker

from vlmrl.training.parallel_state import spawn_local


def test_vlmrl_loads_the_hf_variants_weights():
    res = spawn_local(bench_weights_worker, 1, timeout_s=300)[0]
    assert res["same_init"], "the seeded HF initialisation differs between two calls"
    assert res["copied"] == res["lm_params"] > 0
    # the float32 parity bound of the HF comparisons (tests/integration/test_qwen35_parity.py)
    assert res["max_diff"] <= 1e-4 * max(res["scale"], 1.0), res
    # --samples 5: five packed samples against five HF rows, the same computation; not the one
    # causal row HF trained before (the later samples then attend to the earlier ones)
    assert res["packed_max_diff"] <= 1e-4 * max(res["packed_scale"], 1.0), res
    assert res["packed_vs_one_row"] > 1e-2, res
