"""Qwen3.5 weight layouts between HF and Megatron as pure functions: the gated q/k/v grouping,
the Gated DeltaNet regrouping per key head, routed experts (per-expert checkpoint tensors vs
transformers' fused ones), checkpoint names, and configs through transformers and back."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from vlmrl.config import load
from vlmrl.models import adapters, families
from vlmrl.models.rules import Rule


@pytest.fixture(scope="module")
def moe():
    return load(["model=tiny_qwen3_5_moe"], check_rules=False).model


def test_gated_qkv_rows_are_grouped_as_megatron_splits_them(moe):
    lm = moe.lm
    g, hd, per = lm.num_query_groups, lm.head_dim, lm.num_attention_heads // lm.num_query_groups
    # each row holds its own identity: (kind, head, channel)
    q_gate = torch.tensor([[1000 * h + 100 * half + c] for h in range(lm.num_attention_heads)
                           for half in range(2) for c in range(hd)], dtype=torch.float64)
    k = torch.tensor([[-(1000 * j + c)] for j in range(g) for c in range(hd)], dtype=torch.float64)
    v = k - 0.5
    rule = Rule("qkv_gated", ("q", "k", "v"))
    fused = adapters.to_megatron(moe, rule, [q_gate, k, v], 0, 1).view(g, (2 * per + 2) * hd)
    for j in range(g):
        heads = range(j * per, (j + 1) * per)
        want = torch.cat([torch.tensor([1000 * h + c for h in heads for c in range(hd)]),          # queries
                          torch.tensor([1000 * h + 100 + c for h in heads for c in range(hd)]),    # gates
                          -torch.tensor([1000 * j + c for c in range(hd)]),                        # k_j
                          -torch.tensor([1000 * j + c for c in range(hd)]) - 0.5]).double()        # v_j
        assert torch.equal(fused[j], want)
    for tp in (1, 2):
        shards = [adapters.to_megatron(moe, rule, [q_gate, k, v], r, tp) for r in range(tp)]
        back = adapters.to_hf(moe, rule, shards)
        assert all(torch.equal(a, b) for a, b in zip(back, [q_gate, k, v]))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gdn_rows_are_grouped_by_key_head_and_cut_by_heads(moe, tp):
    lm = moe.lm
    hk, dk, hv, dv = lm.linear_num_key_heads, lm.linear_key_head_dim, lm.linear_num_value_heads, lm.linear_value_head_dim
    r = hv // hk
    flat = torch.arange((2 * hk * dk + hv * dv) * 3, dtype=torch.float64).view(-1, 3)
    conv = torch.arange(flat.shape[0] * 4, dtype=torch.float64).view(-1, 1, 4)
    rule = Rule("gdn_qkv", ("w",))
    for hf in (flat, conv):
        shards = [adapters.to_megatron(moe, rule, [hf], rank, tp) for rank in range(tp)]
        assert torch.equal(adapters.to_hf(moe, rule, shards)[0], hf)
        grouped = torch.cat(shards).view(hk, 2 * dk + r * dv, *hf.shape[1:])
        q, k, v = hf.split([hk * dk, hk * dk, hv * dv])
        for h in range(hk):
            assert torch.equal(grouped[h, :dk], q[h * dk:(h + 1) * dk])
            assert torch.equal(grouped[h, dk:2 * dk], k[h * dk:(h + 1) * dk])
            assert torch.equal(grouped[h, 2 * dk:], v[h * r * dv:(h + 1) * r * dv])  # its value heads
        # a TP rank holds whole key heads and exactly their value heads
        assert all(s.shape[0] == hk // tp * (2 * dk + r * dv) for s in shards)


def test_experts_stack_per_expert_tensors_into_the_fused_layout(moe):
    from vlmrl.models.bridge import hf_config, hf_model_class

    torch.manual_seed(0)
    net = hf_model_class(moe)(hf_config(moe))
    mem = {k: v.detach() for k, v in net.state_dict().items()}
    ckpt = families.get("qwen3_5_moe").to_checkpoint(mem)
    base = "model.language_model.layers.1.mlp.experts"
    assert f"{base}.gate_up_proj" not in ckpt and f"{base}.7.up_proj.weight" in ckpt
    experts = range(moe.lm.num_experts)
    gate_up = Rule("experts_gate_up", tuple(f"{base}.{e}.{w}_proj.weight" for e in experts for w in ("gate", "up")))
    down = Rule("experts_down", tuple(f"{base}.{e}.down_proj.weight" for e in experts))
    fused = adapters.to_megatron(moe, gate_up, [ckpt[n] for n in gate_up.hf], 0, 1)
    assert torch.equal(fused, mem[f"{base}.gate_up_proj"])  # transformers' own fused tensor
    assert torch.equal(adapters.to_megatron(moe, down, [ckpt[n] for n in down.hf], 0, 1), mem[f"{base}.down_proj"])
    # two expert-parallel shards back to per-expert tensors
    halves = [fused[:4], fused[4:]]
    back = dict(zip(gate_up.hf, adapters.to_hf(moe, gate_up, halves)))
    assert all(torch.equal(back[n], ckpt[n]) for n in gate_up.hf)


def test_rules_name_the_local_experts_of_an_expert_parallel_rank(moe):
    rule = adapters.rule_for(moe, "language_model.decoder.layers.2.mlp.experts.down_proj", layer_offset=1,
                             experts=range(4, 8))
    assert rule.expert and rule.hf[0] == "model.language_model.layers.3.mlp.experts.4.down_proj.weight"
    assert len(rule.hf) == 4
    gdn = adapters.rule_for(moe, "language_model.decoder.layers.0.self_attention.A_log", layer_offset=0)
    assert gdn == Rule("rows", ("model.language_model.layers.0.linear_attn.A_log",))
    assert adapters.rule_for(moe, "visual.blocks.0.attn.qkv.weight", layer_offset=0).hf == \
        ("model.visual.blocks.0.attn.qkv.weight",)
    with pytest.raises(KeyError, match="no HF mapping"):
        adapters.rule_for(moe, "language_model.decoder.layers.0.self_attention.bogus", layer_offset=0)


def test_module_slots_address_the_fused_expert_tensors():
    fam = families.get("qwen3_5_moe")
    base = "model.language_model.layers.0.mlp.experts"
    assert fam.module_slot(f"{base}.3.up_proj.weight") == (f"{base}.gate_up_proj", (3, 1))
    assert fam.module_slot(f"{base}.3.gate_proj.weight") == (f"{base}.gate_up_proj", (3, 0))
    assert fam.module_slot(f"{base}.2.down_proj.weight") == (f"{base}.down_proj", (2, None))
    assert fam.module_slot("model.language_model.norm.weight") == ("model.language_model.norm.weight", None)
    fused = torch.arange(2 * 6 * 3).view(2, 6, 3)
    assert torch.equal(fam.take(fused, (1, 1)), fused[1, 3:])


def test_safetensors_directory_reads_per_expert_and_fused_checkpoints(tmp_path, moe):
    from vlmrl.models.bridge import hf_config, hf_model_class

    torch.manual_seed(1)
    net = hf_model_class(moe)(hf_config(moe))
    net.save_pretrained(tmp_path / "saved")  # transformers writes one tensor per expert
    src = adapters.SafetensorsDir(tmp_path / "saved", "qwen3_5_moe")
    mem = net.state_dict()
    base = "model.language_model.layers.0.mlp.experts"
    assert torch.equal(src[f"{base}.5.up_proj.weight"], mem[f"{base}.gate_up_proj"][5, moe.lm.moe_ffn_hidden_size:])
    # a checkpoint storing the fused tensors is read as the same per-expert tensors
    (tmp_path / "fused").mkdir()
    save_file({k: v.contiguous() for k, v in mem.items()}, str(tmp_path / "fused" / "model.safetensors"))
    fused = adapters.SafetensorsDir(tmp_path / "fused", "qwen3_5_moe")
    assert set(fused) == set(src)
    assert all(torch.equal(fused[k], src[k]) for k in src)


@pytest.mark.parametrize("option", ["tiny_qwen3_5", "tiny_qwen3_5_moe", "qwen3_5_35b_a3b"])
def test_model_config_round_trips_through_hf_config(option):
    from vlmrl.models.bridge import hf_config, model_config_from_hf

    model = load([f"model={option}"], check_rules=False).model
    back = model_config_from_hf(hf_config(model), name=model.name)
    assert back.family == model.family

    def plain(cfg):  # sealed configs hold tuples where fresh ones hold lists
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()}

    assert plain(back.lm) == plain(model.lm)
    for key in ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size", "spatial_merge_size",
                "out_hidden_size", "num_position_embeddings"):
        assert getattr(back.vision, key) == getattr(model.vision, key), key
    assert (back.image_token_id, back.vision_start_token_id) == (model.image_token_id, model.vision_start_token_id)


def test_a_config_that_does_not_describe_the_checkpoint_is_refused(tmp_path):
    from vlmrl.models.bridge import check_checkpoint, hf_config

    model = load(["model=tiny_qwen3_5_moe"], check_rules=False).model
    hf_config(model).save_pretrained(tmp_path)
    check_checkpoint(model, str(tmp_path))  # agrees
    other = load(["model=tiny_qwen3_5_moe", "model.lm.num_experts=4", "model.image_token_id=7"],
                 check_rules=False).model
    with pytest.raises(ValueError) as err:
        check_checkpoint(other, str(tmp_path))
    assert "model.lm.num_experts: config 4, checkpoint 8" in str(err.value)
    assert "model.image_token_id: config 7, checkpoint 5" in str(err.value)
