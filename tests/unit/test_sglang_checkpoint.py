"""What SGLang builds from a checkpoint's config.json (vlmrl.models.sglang_checkpoint): layer
kinds from one full-attention interval, deepstack defaults, and the keys the tiny maker writes.

SGLang's config classes come in the shape of the `model_configs` section of vlmrl's SGLang
contract; `MODEL_CONFIGS` below is a small one in that shape (SGLang 0.5.17's Qwen3.5 classes:
the text config derives layer kinds from `full_attention_interval`, which no __init__ sets;
the vision config defaults `deepstack_visual_indexes` to [8, 16, 24])."""

from __future__ import annotations

import json

import pytest

from vlmrl.config import load
from vlmrl.models.sglang_checkpoint import (
    check_sglang_checkpoint,
    closest_interval,
    full_attention_interval,
    sglang_config_problems,
    sglang_layer_types,
)

F, L = "full_attention", "linear_attention"


def _entry(prefix: str) -> dict:
    return {"text": {"class": f"{prefix}TextConfig",
                     "defaults": {"layer_types": None, "output_gate_type": None, "num_hidden_layers": 48},
                     "required": ["full_attention_interval"]},
            "vision": {"class": f"{prefix}VisionConfig",
                       "defaults": {"deepstack_visual_indexes": [8, 16, 24], "depth": 27},
                       "required": []}}


MODEL_CONFIGS = {"qwen3_5": _entry("Qwen3_5"), "qwen3_5_moe": _entry("Qwen3_5Moe")}
FAMILIES = ["qwen3_5", "qwen3_5_moe"]


def _tiny(family: str):
    return load([f"model=tiny_{family}"], check_rules=False).model


def _tiny_config_json(family: str) -> dict:
    from vlmrl.models.tiny import hf_config

    return hf_config(_tiny(family)).to_dict()


def _transformers_config_json(family: str) -> dict:
    """config.json of the same model as transformers' classes alone write it."""
    from vlmrl.models.bridge import hf_config

    return hf_config(_tiny(family)).to_dict()


# --------------------------------------------------------------------------- layer kinds
def test_sglang_derives_layer_kinds_from_one_interval():
    assert sglang_layer_types(4, 8) == [L, L, L, F, L, L, L, F]
    assert sglang_layer_types(1, 3) == [F, F, F]
    assert sglang_layer_types(4, 3) == [L, L, L]


@pytest.mark.parametrize(("types", "interval"), [
    ([L, L, L, F] * 10, 4), ([F] * 4, 1), ([L, F, L, F], 2), ([L, L, L], 4), ([L, L, F, L], 3),
    ([F, L, L, L], None), ([L, L, L, F, L, F], None), ([L, F, F, F], None)])
def test_full_attention_interval(types, interval):
    assert full_attention_interval(types) == interval
    if interval is not None:
        assert sglang_layer_types(interval, len(types)) == types


def test_closest_interval_keeps_the_number_of_full_attention_layers():
    assert closest_interval([F, L, L, L] * 10) == 4
    assert closest_interval([L, F, F, L, L, L]) == 3
    assert closest_interval([F, F, L, L]) == 2


# --------------------------------------------------------------------------- the tiny maker
@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_config_carries_the_keys_of_published_qwen35_configs(family):
    cfg = _tiny_config_json(family)
    text, vision = cfg["text_config"], cfg["vision_config"]
    assert text["full_attention_interval"] == 4 and text["layer_types"] == [L, L, L, F]
    assert (text["attn_output_gate"], text["mamba_ssm_dtype"], text["output_gate_type"]) == (True, "float32", "swish")
    assert (text["mtp_num_hidden_layers"], text["mtp_use_dedicated_embeddings"]) == (0, False)
    assert vision["deepstack_visual_indexes"] == []
    assert sglang_config_problems(cfg, family, MODEL_CONFIGS) == []


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_maker_refuses_layer_kinds_no_interval_describes(family):
    from vlmrl.models.tiny import hf_config

    model = load([f"model=tiny_{family}", f"model.lm.layer_types=[{F},{L},{L},{L}]"], check_rules=False).model
    with pytest.raises(ValueError) as err:
        hf_config(model)
    msg = str(err.value)
    assert "model.lm.layer_types=" in msg and f"conf/model/tiny_{family}.yaml" in msg
    assert f"model.lm.layer_types=[{L},{L},{L},{F}] (interval 4)" in msg


def test_only_the_qwen35_cache_keys_change_with_the_qwen35_revision(monkeypatch):
    from vlmrl.models import tiny

    models = {o: load([f"model={o}"], check_rules=False).model for o in ("tiny", "tiny_qwen3_5", "tiny_qwen3_5_moe")}
    before = {o: tiny._fingerprint(m, 0, 3136, 12544) for o, m in models.items()}
    monkeypatch.setattr(tiny, "QWEN3_5_REVISION", tiny.QWEN3_5_REVISION + 1)
    after = {o: tiny._fingerprint(m, 0, 3136, 12544) for o, m in models.items()}
    assert after["tiny"] == before["tiny"]
    assert after["tiny_qwen3_5"] != before["tiny_qwen3_5"]
    assert after["tiny_qwen3_5_moe"] != before["tiny_qwen3_5_moe"]


# --------------------------------------------------------------------------- the check
@pytest.mark.parametrize("family", FAMILIES)
def test_a_config_without_the_keys_is_refused_naming_each(family):
    cfg = _transformers_config_json(family)
    assert "full_attention_interval" not in cfg["text_config"]
    problems = sglang_config_problems(cfg, family, MODEL_CONFIGS, file="/ckpt/config.json")
    assert len(problems) == 2, problems
    interval, deepstack = problems
    prefix = "Qwen3_5Moe" if family == "qwen3_5_moe" else "Qwen3_5"
    assert interval.startswith("text_config.full_attention_interval is missing from /ckpt/config.json")
    assert f"{prefix}TextConfig has no default for it and cannot build the model" in interval
    assert '"full_attention_interval": 4' in interval
    assert deepstack.startswith("vision_config.deepstack_visual_indexes is missing from /ckpt/config.json")
    assert f"{prefix}VisionConfig defaults it to [8, 16, 24]" in deepstack
    assert "3 vision layer(s)" in deepstack and "kills SGLang's scheduler" in deepstack


def test_an_interval_that_disagrees_with_layer_types_is_refused():
    cfg = _tiny_config_json("qwen3_5_moe")
    cfg["text_config"]["full_attention_interval"] = 2
    (problem,) = sglang_config_problems(cfg, "qwen3_5_moe", MODEL_CONFIGS)
    assert problem.startswith("text_config.full_attention_interval=2 in config.json disagrees with "
                              "text_config.layer_types")
    assert "layer 1: full_attention where the weights are linear_attention" in problem
    assert problem.endswith("set it to 4")
    cfg["text_config"]["layer_types"] = [F, L, L, L]
    (problem,) = sglang_config_problems(cfg, "qwen3_5_moe", MODEL_CONFIGS)
    assert "follow no interval, so SGLang cannot serve this checkpoint" in problem


def test_deepstack_layers_the_qwen35_tower_lacks_are_refused():
    cfg = _tiny_config_json("qwen3_5")
    cfg["vision_config"]["deepstack_visual_indexes"] = [0]
    (problem,) = sglang_config_problems(cfg, "qwen3_5", MODEL_CONFIGS)
    assert problem.startswith("vision_config.deepstack_visual_indexes=[0] in config.json")
    assert 'set "deepstack_visual_indexes": [] in vision_config' in problem


def test_defaults_given_as_source_text_and_other_required_attributes():
    cfg = _transformers_config_json("qwen3_5")
    configs = json.loads(json.dumps(MODEL_CONFIGS))
    configs["qwen3_5"]["vision"]["defaults"]["deepstack_visual_indexes"] = {"source": "[8, 16, 24]"}
    configs["qwen3_5"]["text"]["required"].append("some_attribute")
    problems = sglang_config_problems(cfg, "qwen3_5", configs)
    assert any("text_config.some_attribute is missing from config.json" in p for p in problems), problems
    assert any("defaults it to [8, 16, 24]" in p for p in problems), problems
    configs["qwen3_5"]["vision"]["defaults"]["deepstack_visual_indexes"] = {"source": "DEEPSTACK_LAYERS"}
    assert any("defaults it to DEEPSTACK_LAYERS" in p for p in sglang_config_problems(cfg, "qwen3_5", configs))


def test_families_sglang_reads_with_transformers_are_not_checked():
    from vlmrl.models.bridge import hf_config

    cfg = hf_config(load([], check_rules=False).model).to_dict()
    assert cfg["model_type"] == "qwen2_5_vl"
    assert sglang_config_problems(cfg, "qwen2_5_vl", MODEL_CONFIGS) == []
    # a Qwen3.5 checkpoint SGLang's contract has no class for cannot be vouched for
    qwen = _tiny_config_json("qwen3_5")
    (problem,) = sglang_config_problems(qwen, "qwen3_5", {"qwen3_5_moe": MODEL_CONFIGS["qwen3_5_moe"]})
    assert "model_type='qwen3_5' has no config class in vlmrl's SGLang contract" in problem


def test_check_sglang_checkpoint_raises_listing_every_problem(tmp_path):
    from vlmrl.models.bridge import hf_config

    model = _tiny("qwen3_5_moe")
    hf_config(model).save_pretrained(tmp_path)
    with pytest.raises(ValueError) as err:
        check_sglang_checkpoint(model, str(tmp_path), MODEL_CONFIGS)
    msg = str(err.value)
    assert f"fix {tmp_path / 'config.json'}" in msg and "rollout=sglang" in msg
    assert "text_config.full_attention_interval is missing" in msg
    assert "vision_config.deepstack_visual_indexes is missing" in msg


# --------------------------------------------------------------------------- SGLang's own classes
def _known_versions() -> tuple[str, ...]:
    from vlmrl.contracts.sglang_flags import known_versions

    return known_versions()


@pytest.mark.parametrize("version", _known_versions())
@pytest.mark.parametrize("family", FAMILIES)
def test_against_the_contract_of_every_known_sglang(version, family):
    """SGLang's Qwen3.5 classes as read from each release's source: the tiny config passes,
    transformers' config alone fails on both keys."""
    from vlmrl.models.sglang_checkpoint import contract_model_configs

    configs = contract_model_configs(version)
    assert sglang_config_problems(_tiny_config_json(family), family, configs) == []
    problems = sglang_config_problems(_transformers_config_json(family), family, configs)
    assert [p.split(" ", 1)[0] for p in problems] == ["text_config.full_attention_interval",
                                                      "vision_config.deepstack_visual_indexes"], problems
    assert "cannot build the model" in problems[0] and "defaults it to [8, 16, 24]" in problems[1]
