"""Megatron Qwen-VL vs HF transformers, and TP2 / PP2 / CP2 vs one process (CPU, gloo, fp32).

One pair of gloo processes (spawned once per module) runs the HF reference and five
layouts: no model parallelism ("single", the processes act as data-parallel replicas),
tp=2, pp=2, cp=2 and tp=2 with sequence parallelism, each a forward + backward of a packed batch of two samples with
images of different grids plus a text-only sample. The weight adapters' round trip
(HF -> Megatron shards -> HF) is checked bitwise on the live models of every layout, and
as pure functions below.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _dist import run_in_processes

from vlmrl import parity
from vlmrl.config.schema import LanguageModelConfig, ModelConfig, ParallelConfig, VisionConfig

LAYOUTS = {"tp2": ParallelConfig(tp=2), "pp2": ParallelConfig(pp=2), "cp2": ParallelConfig(cp=2),
           "tp2+sp": ParallelConfig(tp=2, sequence_parallel=True)}


def small_model(*, tied: bool = True, layers: int = 4) -> ModelConfig:
    """A Qwen2.5-VL-architecture model small enough for a CPU test (~0.2M parameters)."""
    lm = LanguageModelConfig(num_layers=layers, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                             num_query_groups=2, head_dim=16, vocab_size=256, max_position_embeddings=512,
                             rope_theta=10000.0, mrope_section=[2, 3, 3], rms_norm_eps=1e-6,
                             tie_word_embeddings=tied, add_qkv_bias=True)
    vision = VisionConfig(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=14,
                          temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64, window_size=56,
                          fullatt_block_indexes=[1])
    return ModelConfig(name="parity-small", family="qwen2_5_vl", dtype="float32", lm=lm, vision=vision,
                       image_token_id=5, vision_start_token_id=3, vision_end_token_id=4)


@pytest.fixture(scope="module")
def results() -> dict[str, parity.RunResult]:
    layouts = [parity.single_layout(2), *LAYOUTS.values()]
    return run_in_processes(parity.worker, 2, small_model(), layouts, 0, timeout_s=240)[0]


def test_single_process_logits_match_hf(results):
    diff = parity.max_abs_diff(results["single"].logits, results["hf"].logits)
    assert diff <= parity.LOGITS_VS_HF, diff


def test_single_process_grads_match_hf(results):
    diff = parity.max_abs_diff(results["single"].grads, results["hf"].grads)
    assert diff <= parity.GRADS_VS_HF, diff


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_logits_match_single(results, layout):
    diff = parity.max_abs_diff(results[layout].logits, results["single"].logits)
    assert diff <= parity.LOGITS_VS_SINGLE, diff


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_grads_match_single(results, layout):
    diff = parity.max_abs_diff(results[layout].grads, results["single"].grads)
    assert diff <= parity.GRADS_VS_SINGLE, diff


@pytest.mark.parametrize("layout", ["single", *LAYOUTS])
def test_live_weight_round_trip_is_bitwise(results, layout):
    assert results[layout].roundtrip == 0.0  # whole export and 256 KiB buckets alike
    assert results[layout].buckets > 1


def test_parity_table_passes(results):
    checks = parity.compare(results)
    table = parity.format_table(checks)
    assert all(c.ok for c in checks), table
    assert "FAIL" not in table and table.count("PASS") == len(checks)


def test_fused_kernels_match_hf():
    """hardware.fused_kernels (Inductor-compiled norms, M-RoPE, SwiGLU; CPU backend here):
    the same parity bounds against HF as the plain model, through the compiled dense layer."""
    res = run_in_processes(parity.worker, 1, small_model(layers=2), [parity.single_layout(1)], 0, True, True,
                           timeout_s=240)[0]
    assert res["single"].fast_path_layers == 2  # both layers ran the compiled dense path
    assert parity.max_abs_diff(res["single"].logits, res["hf"].logits) <= parity.LOGITS_VS_HF
    assert parity.max_abs_diff(res["single"].grads, res["hf"].grads) <= parity.GRADS_VS_HF


def test_fused_kernels_reach_every_module():
    from vlmrl.models.bridge import block_spec, transformer_config

    model = small_model(layers=2)
    for fused in (False, True):
        config = transformer_config(model, ParallelConfig(), fused_kernels=fused)
        assert config.bias_activation_fusion is fused and config.bias_dropout_fusion is False
        block = block_spec(model, config, fused_kernels=fused, pp_rank=0)
        assert block.layer_norm.params == {"fused": fused}
        for spec in block.layer_specs:
            assert (spec.module.__name__ == "FusedTransformerLayer") is fused
            sub = spec.submodules
            assert sub.input_layernorm.params == sub.pre_mlp_layernorm.params == {"fused": fused}
            assert sub.self_attention.submodules.core_attention.params["fused"] is fused


# --------------------------------------------------------------------------- pure adapters
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_adapter_round_trip_bitwise(tied, tp, pp):
    from vlmrl.models import adapters, names

    model = small_model(tied=tied)
    net = parity.make_hf_model(model, seed=1)
    hf = {names.to_checkpoint_name(k): v for k, v in net.state_dict().items()}
    vision = [k for k in hf if names.is_vision(k)]
    per_stage = model.lm.num_layers // pp
    back: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        pre, post = stage == 0, stage == pp - 1
        meg_names = adapters.megatron_names(model, num_layers=per_stage, pre_process=pre, post_process=post,
                                            vision_names=vision)
        shards = [adapters.hf_to_megatron(model, net.state_dict(), meg_names, tp_rank=r, tp_size=tp,
                                          layer_offset=stage * per_stage) for r in range(tp)]
        if tp > 1:  # really cut: the shards differ and together hold the full tensor
            qkv = "language_model.decoder.layers.0.self_attention.linear_qkv.weight"
            assert shards[0][qkv].shape[0] * tp == (4 + 2 * 2) * 16
        part = adapters.megatron_to_hf(model, shards, layer_offset=stage * per_stage)
        assert not set(part) & set(back)
        back.update(part)
    expected = dict(hf)
    if tied:
        expected.pop("lm_head.weight")
    assert set(back) == set(expected)
    for k, v in expected.items():
        assert torch.equal(back[k], v), k


def test_qkv_fusion_layout():
    """Megatron's linear_qkv rows per query group: [q heads of the group; k; v]."""
    from vlmrl.models import adapters

    model = small_model()
    hd, g, per = 16, 2, 2
    q = torch.arange(g * per * hd).float().view(-1, 1)
    k = 1000 + torch.arange(g * hd).float().view(-1, 1)
    v = 2000 + torch.arange(g * hd).float().view(-1, 1)
    rule = adapters.Rule("qkv", ("q", "k", "v"))
    fused = adapters.to_megatron(model, rule, [q, k, v], 0, 1).view(g, (per + 2) * hd)
    assert torch.equal(fused[0, : per * hd], q.view(g, per * hd)[0])
    assert torch.equal(fused[0, per * hd:(per + 1) * hd], k.view(g, hd)[0])
    assert torch.equal(fused[1, (per + 1) * hd:], v.view(g, hd)[1])
    # TP rank 1 of 2 holds exactly group 1
    assert torch.equal(adapters.to_megatron(model, rule, [q, k, v], 1, 2).view(-1), fused[1])


def test_gate_up_fusion_layout():
    from vlmrl.models import adapters

    model = small_model()
    gate, up = torch.arange(8).float().view(4, 2), 100 + torch.arange(8).float().view(4, 2)
    rule = adapters.Rule("gate_up", ("g", "u"))
    r1 = adapters.to_megatron(model, rule, [gate, up], 1, 2)
    assert torch.equal(r1, torch.cat([gate[2:], up[2:]]))
    full = adapters.to_hf(model, rule, [adapters.to_megatron(model, rule, [gate, up], r, 2) for r in range(2)])
    assert torch.equal(full[0], gate) and torch.equal(full[1], up)


def test_in_memory_and_checkpoint_names_load_alike():
    from vlmrl.models import adapters, names

    model = small_model(tied=False)
    net = parity.make_hf_model(model, seed=2)
    mem = net.state_dict()
    ckpt = {names.to_checkpoint_name(k): v for k, v in mem.items()}
    meg = adapters.megatron_names(model, num_layers=4, pre_process=True, post_process=True,
                                  vision_names=[k for k in ckpt if names.is_vision(k)])
    a = adapters.hf_to_megatron(model, mem, meg)
    b = adapters.hf_to_megatron(model, ckpt, meg)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "language_model.output_layer.weight" in a  # untied: lm_head has its own weight


def test_safetensors_directory_source(tmp_path):
    from vlmrl.models import adapters

    model = small_model(tied=True, layers=2)
    net = parity.make_hf_model(model, seed=3)
    net.save_pretrained(tmp_path)
    src = adapters.SafetensorsDir(tmp_path, "qwen2_5_vl")
    assert "model.layers.0.self_attn.q_proj.weight" in src and "visual.blocks.0.attn.qkv.weight" in src
    assert torch.equal(src["model.norm.weight"], net.model.language_model.norm.weight)


def test_model_config_round_trips_through_hf_config():
    from vlmrl.models.bridge import hf_config, model_config_from_hf

    model = small_model(tied=False)
    back = model_config_from_hf(hf_config(model), name=model.name)
    assert dataclasses.asdict(back.lm) == dataclasses.asdict(model.lm)
    assert dataclasses.asdict(back.vision) == dataclasses.asdict(model.vision)
