"""Megatron Qwen3.5 (Gated DeltaNet + gated attention, dense or MoE) vs HF transformers, and
every parallel layout vs one process (CPU, gloo, fp32): the acceptance gate of the family.

One pair of gloo processes runs, for each model, the HF reference (one sample at a time:
transformers' Gated DeltaNet ignores packing), the single-process Megatron model (which
also runs each sample alone, the state-leak check) and the layouts, on a batch with images,
two images in one sample, and a 520-token sample whose slow decays carry its start to its end. The MoE miniature runs
under tensor parallelism with sequence parallelism (validation requires it: each TP rank
routes its own tokens). The parity CLI is run as a user would, on a tiny checkpoint
directory, and refuses a layout the model cannot take before starting any process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from _dist import parity_runs_worker, run_in_processes

from vlmrl import parity
from vlmrl.config import load
from vlmrl.config.schema import ParallelConfig

MOE_LAYOUTS = {"tp2+sp": ParallelConfig(tp=2, sequence_parallel=True), "pp2": ParallelConfig(pp=2),
               "cp2": ParallelConfig(cp=2), "ep2": ParallelConfig(ep=2),
               "tp2+ep2+sp": ParallelConfig(tp=2, ep=2, sequence_parallel=True)}
DENSE_LAYOUTS = {"tp2": ParallelConfig(tp=2), "tp2+sp": ParallelConfig(tp=2, sequence_parallel=True),
                 "pp2": ParallelConfig(pp=2), "cp2": ParallelConfig(cp=2)}


# routing replay: the tokens a rank routes are cut by sequence parallelism (TP slices), the
# CP zigzag and nothing else (EP routes before dispatch, PP keeps whole layers); these two
# layouts hold every cut. All five MoE layouts ran on 2026-12-04 (`python -m vlmrl.parity ...
# algo.routing_replay=rollout parallel...`, README).
REPLAY_LAYOUTS = {k: MOE_LAYOUTS[k] for k in ("cp2", "tp2+ep2+sp")}


@pytest.fixture(scope="module")
def two_rank_runs():
    """The MoE layouts, the MoE layouts replaying random engine experts
    (`parity.with_engine_experts`) and the dense layouts, in one pair of gloo processes: each
    process start imports Megatron, seconds apiece on a suite worker's core."""
    moe = load(["model=tiny_qwen3_5_moe"], check_rules=False).model
    dense = load(["model=tiny_qwen3_5"], check_rules=False).model
    single = parity.single_layout(2)
    runs = [(moe, [single, *MOE_LAYOUTS.values()], 0),
            (moe, [single, *REPLAY_LAYOUTS.values()], 0, False, False, None, "torch", True),
            (dense, [single, *DENSE_LAYOUTS.values()], 0)]
    return run_in_processes(parity_runs_worker, 2, runs, timeout_s=900)[0]


@pytest.fixture(scope="module")
def moe_results(two_rank_runs):
    return two_rank_runs[0]


@pytest.fixture(scope="module")
def replay_results(two_rank_runs):
    return two_rank_runs[1]


@pytest.fixture(scope="module")
def dense_results(two_rank_runs):
    return two_rank_runs[2]


@pytest.mark.parametrize("which", ["moe", "dense"])
def test_single_process_matches_hf(which, moe_results, dense_results):
    res = moe_results if which == "moe" else dense_results
    assert parity.max_abs_diff(res["single"].logits, res["hf"].logits) <= parity.LOGITS_VS_HF
    assert parity.max_abs_diff(res["single"].grads, res["hf"].grads) <= parity.GRADS_VS_HF
    assert parity.rel_l2_diff(res["single"].grads, res["hf"].grads) <= parity.GRADS_VS_HF


@pytest.mark.parametrize("which", ["moe", "dense"])
def test_a_sample_in_a_pack_equals_it_alone(which, moe_results, dense_results):
    res = moe_results if which == "moe" else dense_results
    assert res["single"].pack_vs_alone <= parity.PACK_VS_ALONE


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_moe_layout_matches_single(moe_results, layout):
    res = moe_results[parity.layout_name(MOE_LAYOUTS[layout])]
    assert parity.max_abs_diff(res.logits, moe_results["single"].logits) <= parity.LOGITS_VS_SINGLE
    assert parity.max_abs_diff(res.grads, moe_results["single"].grads) <= parity.GRADS_VS_SINGLE
    assert res.roundtrip == 0.0 and res.buckets > 1


def test_routing_replay_routes_by_the_engine_in_every_layout(replay_results):
    """Every layer routes every token the engine routed to the engine's experts, in one process
    and under CP and TP+EP+SP (each layout's logits and gradients equal the single process's),
    and the replay changed the routing (the single process without it differs)."""
    checks = parity.compare(replay_results)
    assert all(c.ok for c in checks), parity.format_table(checks)
    names = {c.what for c in checks}
    assert "replay changes the routing (0: yes)" in names
    for layout in ["single", *REPLAY_LAYOUTS]:
        name = layout if layout == "single" else parity.layout_name(REPLAY_LAYOUTS[layout])
        assert replay_results[name].replay_misses == 0
        assert f"routing {name} vs engine (tokens)" in names


def test_the_long_sample_carries_its_start_to_its_end():
    """The parity batch's long sample (520 tokens, over eight Gated DeltaNet chunks) with the
    parity model's slow decays: changing its first 8 tokens moves the logits of its last
    token, where it is trained, far beyond the parity bounds, so a state lost or mangled
    across chunks or samples could not pass them."""
    import torch

    model = load(["model=tiny_qwen3_5_moe"], check_rules=False).model
    net = parity.make_hf_model(model)
    batch = parity.make_batch(model)
    long = batch.samples[-1]
    assert len(long.input_ids) == parity.LONG_SAMPLE and float(long.loss_mask[-1]) == 1.0
    ids = torch.as_tensor(long.input_ids)[None]
    other = ids.clone()
    other[0, :8] = torch.flip(ids[0, :8], [0]) + 1
    with torch.no_grad():
        moved = float((net(input_ids=ids).logits[0, -1] - net(input_ids=other).logits[0, -1]).abs().max())
    assert moved > 100 * parity.LOGITS_VS_HF, moved


@pytest.mark.parametrize("layout", list(DENSE_LAYOUTS))
def test_dense_layout_matches_single(dense_results, layout):
    res = dense_results[parity.layout_name(DENSE_LAYOUTS[layout])]
    assert parity.max_abs_diff(res.logits, dense_results["single"].logits) <= parity.LOGITS_VS_SINGLE
    assert parity.max_abs_diff(res.grads, dense_results["single"].grads) <= parity.GRADS_VS_SINGLE
    assert res.roundtrip == 0.0


@pytest.mark.parametrize("which", ["moe", "dense"])
def test_plan_counts_the_built_model(which, moe_results, dense_results):
    from vlmrl.config.memory import count_params

    res = moe_results if which == "moe" else dense_results
    option = "tiny_qwen3_5_moe" if which == "moe" else "tiny_qwen3_5"
    assert res["single"].num_parameters == count_params(load([f"model={option}"], check_rules=False)).total


def test_every_hf_parameter_gets_a_gradient(moe_results):
    """Each GDN, gated-attention, router, expert, shared-expert and vision parameter takes
    part (the names cover HF's whole checkpoint, and the routed experts' gradients are not all
    zero)."""
    grads = moe_results["single"].grads
    assert grads.keys() == moe_results["hf"].grads.keys()
    for part in ("linear_attn.A_log", "linear_attn.conv1d.weight", "linear_attn.norm.weight",
                 "self_attn.q_proj.weight", "self_attn.q_norm.weight", "mlp.gate.weight",
                 "mlp.shared_expert_gate.weight", "mlp.experts.0.up_proj.weight", "model.visual.merger"):
        hits = [k for k in grads if part in k]
        assert hits, part
        assert any(float(grads[k].abs().max()) > 0 for k in hits), part


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "vlmrl.parity", *args], capture_output=True, text=True,
                          timeout=600, env=env)


def test_parity_cli_on_a_tiny_checkpoint(cache_dir):
    from vlmrl.models.tiny import ensure_tiny_checkpoint

    cfg = load(["model=tiny_qwen3_5_moe", f"model.cache_dir={cache_dir}"])
    path = ensure_tiny_checkpoint(cfg.model, min_pixels=cfg.data.min_pixels, max_pixels=cfg.data.max_pixels)
    out = _cli(f"model.path={path}", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "family=qwen3_5_moe" in out.stdout and "weights=checkpoint" in out.stdout
    assert "FAIL" not in out.stdout and out.stdout.count("PASS") >= 7, out.stdout
    refused = _cli(f"model.path={path}", "parallel.tp=2")
    assert refused.returncode == 2 and "moe-tp-sp" in refused.stderr, refused.stderr


# --------------------------------------------------------------------------- TP wider than the KV groups
TP4 = {"moe": ("tiny_qwen3_5_moe", {"tp4+sp": ParallelConfig(tp=4, sequence_parallel=True),
                                    "tp4+ep2+sp": ParallelConfig(tp=4, ep=2, sequence_parallel=True)}),
       "dense": ("tiny_qwen3_5", {"tp4": ParallelConfig(tp=4), "tp4+sp": ParallelConfig(tp=4, sequence_parallel=True)})}


# the dense case's one layout the MoE case lacks is TP4 without SP (MoE needs SP under TP):
# `slow`, to keep the default suite in its time budget (`make test-all` runs it)
@pytest.mark.parametrize("which", ["moe", pytest.param("dense", marks=pytest.mark.slow)])
def test_tp_wider_than_the_kv_groups(which):
    """TP4 over 2 KV groups (each rank: 1/4 of the fused QKV + gate rows, its group's K/V,
    1 of 4 query heads; Gated DeltaNet 1 of 4 key heads) on 4 CPU processes: logits and
    gradients equal one process', and the weights round-trip bitwise."""
    option, layouts = TP4[which]
    model = load([f"model={option}"], check_rules=False).model
    assert model.lm.num_query_groups < 4
    res = run_in_processes(parity.worker, 4, model, [parity.single_layout(4), *layouts.values()], 0, False,
                           timeout_s=600)[0]
    for layout in layouts.values():
        r = res[parity.layout_name(layout)]
        assert parity.max_abs_diff(r.logits, res["single"].logits) <= parity.LOGITS_VS_SINGLE
        assert parity.max_abs_diff(r.grads, res["single"].grads) <= parity.GRADS_VS_SINGLE
        assert r.roundtrip == 0.0


# eight processes on CI's two cores (minutes): `make test-all` runs it
@pytest.mark.slow
def test_the_recipe_layout_on_eight_ranks_matches_one_process():
    """The reference recipe's layout, TP2 + SP with EP8 and full recompute, on eight CPU
    processes (four data-parallel ranks; the tiny model's eight experts, one a rank): logits
    and gradients equal one process' within the bounds the two-rank layouts meet, and the
    weights round-trip bitwise."""
    model = load(["model=tiny_qwen3_5_moe"], check_rules=False).model
    assert model.lm.num_experts == 8
    recipe = ParallelConfig(tp=2, ep=8, sequence_parallel=True, recompute_granularity="full")
    res = run_in_processes(parity.worker, 8, model, [parity.single_layout(8), recipe], 0, False,
                           timeout_s=1200)[0]
    r = res[parity.layout_name(recipe)]
    assert parity.max_abs_diff(r.logits, res["single"].logits) <= parity.LOGITS_VS_SINGLE
    assert parity.max_abs_diff(r.grads, res["single"].grads) <= parity.GRADS_VS_SINGLE
    assert r.roundtrip == 0.0


def test_fused_kernels_match_hf_for_qwen35_moe():
    """hardware.fused_kernels on the Qwen3.5-MoE miniature: every layer, Gated DeltaNet and gated
    attention alike, runs as compiled graphs around its eager kernels (`FusedTransformerLayer`;
    CPU backend, float32, so the MoE blocks keep Megatron's forward: the compiled block is bf16
    and has its own test): HF's parity bounds hold."""
    model = load(["model=tiny_qwen3_5_moe"], check_rules=False).model
    res = run_in_processes(parity.worker, 1, model, [parity.single_layout(1)], 0, True, True,
                           timeout_s=400)[0]
    assert res["single"].fast_path_layers == model.lm.num_layers
    assert parity.max_abs_diff(res["single"].logits, res["hf"].logits) <= parity.LOGITS_VS_HF
    assert parity.max_abs_diff(res["single"].grads, res["hf"].grads) <= parity.GRADS_VS_HF


def test_build_makes_parameters_on_the_compute_device():
    """The model is made where it runs: no parameter is first drawn on the host and copied
    over (the scaled MoE's 2.4B expert weights were drawn on one host core at every trainer
    start: part of a 62.5 s build on the H200). The compute device is stood in for by `meta`."""
    from _dist import build_host_bytes_worker

    out = run_in_processes(build_host_bytes_worker, 1, "tiny_qwen3_5_moe", timeout_s=200)[0]
    assert out["devices"] == ["meta"]
    assert out["param_bytes"] > 1e6
    assert out["host_bytes"] < 0.01 * out["param_bytes"], out
