"""The tiny Qwen3.5 checkpoints carry what SGLang needs of a Qwen3.5 config.json (the keys
published Qwen3.5 configs carry), and transformers still builds the same model from them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from vlmrl.config import load
from vlmrl.models.sglang_checkpoint import check_sglang_checkpoint

# SGLang 0.5.17's Qwen3.5 config classes, in the shape of the SGLang contract's model_configs
_ENTRY = {"text": {"defaults": {"layer_types": None}, "required": ["full_attention_interval"]},
          "vision": {"defaults": {"deepstack_visual_indexes": [8, 16, 24]}, "required": []}}
MODEL_CONFIGS = {t: {s: {"class": f"{p}{s.title()}Config", **spec} for s, spec in _ENTRY.items()}
                 for t, p in (("qwen3_5", "Qwen3_5"), ("qwen3_5_moe", "Qwen3_5Moe"))}

ADDED_TEXT = ("full_attention_interval", "attn_output_gate", "mamba_ssm_dtype", "output_gate_type",
              "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings")


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def tiny_qwen35(request, cache_dir):
    """(model config, checkpoint dir) of each Qwen3.5 family's tiny model."""
    from vlmrl.models.tiny import ensure_tiny_checkpoint

    cfg = load([f"model=tiny_{request.param}", f"model.cache_dir={cache_dir}"])
    return cfg.model, ensure_tiny_checkpoint(cfg.model, min_pixels=cfg.data.min_pixels,
                                             max_pixels=cfg.data.max_pixels)


def test_tiny_checkpoint_passes_the_sglang_check(tiny_qwen35, tmp_path):
    model, path = tiny_qwen35
    config = json.loads((Path(path) / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    assert text["full_attention_interval"] == 4
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert (text["attn_output_gate"], text["mamba_ssm_dtype"], text["output_gate_type"],
            text["mtp_num_hidden_layers"], text["mtp_use_dedicated_embeddings"]) == (True, "float32", "swish", 0, False)
    assert vision["deepstack_visual_indexes"] == []
    check_sglang_checkpoint(model, path, MODEL_CONFIGS)
    check_sglang_checkpoint(model, path)  # SGLang's classes of the newest contract

    # the same checkpoint as transformers alone writes it: refused, naming each key
    bare = tmp_path / "bare"
    shutil.copytree(path, bare)
    for key in ADDED_TEXT:
        del text[key]
    del vision["deepstack_visual_indexes"]
    (bare / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        check_sglang_checkpoint(model, str(bare), MODEL_CONFIGS)
    msg = str(err.value)
    assert f"text_config.full_attention_interval is missing from {bare / 'config.json'}" in msg
    assert f"vision_config.deepstack_visual_indexes is missing from {bare / 'config.json'}" in msg
    assert "defaults it to [8, 16, 24]" in msg
    with pytest.raises(ValueError, match="full_attention_interval is missing"):
        check_sglang_checkpoint(model, str(bare))


def test_transformers_builds_the_same_model_with_the_added_keys(tiny_qwen35):
    """from_pretrained of the checkpoint equals transformers' model of the config without them."""
    from transformers import AutoModelForImageTextToText

    from vlmrl.models import bridge, tiny

    model, path = tiny_qwen35
    loaded = AutoModelForImageTextToText.from_pretrained(path).eval()
    assert type(loaded) is bridge.hf_model_class(model)
    assert loaded.config.text_config.full_attention_interval == 4
    assert loaded.config.vision_config.deepstack_visual_indexes == []

    plain = bridge.hf_config(model)  # transformers' fields only
    assert not hasattr(plain.text_config, "full_attention_interval")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(plain.text_config, key, getattr(tiny.hf_config(model).text_config, key))
    reference = bridge.hf_model_class(model)(plain).eval()
    assert [(n, p.shape) for n, p in reference.named_parameters()] == [
        (n, p.shape) for n, p in loaded.named_parameters()]
    reference.load_state_dict(loaded.state_dict())
    ids = torch.randint(16, model.lm.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, reference(input_ids=ids).logits)
