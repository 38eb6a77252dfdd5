"""Random-init checkpoints at a config's own width (vlmrl.models.random_init): the published
layout's special ids and config keys, loadable by transformers and checked as SGLang would
build it, shown on a small vocabulary; the reference model's first four layers counted on the
meta device (no memory), with the ids published Qwen3.5 checkpoints use."""

from __future__ import annotations

import json

import pytest
import torch

SMALL = ["model=tiny_qwen3_5_moe", "model.lm.vocab_size=4096", "model.vision_start_token_id=4009",
         "model.vision_end_token_id=4010", "model.image_token_id=4012"]


def test_a_small_vocabulary_checkpoint_in_the_published_layout_loads_and_runs(tmp_path):
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from vlmrl.config import load
    from vlmrl.models.processor import load_processor
    from vlmrl.models.random_init import PUBLISHED_SPECIALS, main
    from vlmrl.models.sglang_checkpoint import check_sglang_checkpoint

    cfg = load(SMALL, check_rules=False)
    out = tmp_path / "ckpt"
    main(["--out", str(out), "--device", "cpu", *SMALL])  # the command line, as the README gives it
    config = json.loads((out / "config.json").read_text())
    text = config["text_config"]
    assert text["vocab_size"] == 4096 and text["eos_token_id"] == 4002 and text["full_attention_interval"] >= 1
    assert config["image_token_id"] == 4012 and config["video_token_id"] == 4013
    check_sglang_checkpoint(cfg.model, str(out), sglang_version=cfg.rollout.sglang.version)

    processor = load_processor(str(out))
    tok = processor.tokenizer
    assert [tok.convert_tokens_to_ids(t) for t in PUBLISHED_SPECIALS] == list(range(4000, 4014))
    text_in = "Find the area of the triangle. Answer: \\boxed{12}"
    ids = tok(text_in)["input_ids"]
    assert max(ids) < 2048 and tok.decode(ids) == text_in  # the BPE below the placeholders encodes text
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many sides?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    batch = processor(text=[prompt], images=[Image.new("RGB", (56, 56), "red")], return_tensors="pt")
    row = batch["input_ids"][0].tolist()
    assert row.count(4009) == 1 and row.count(4010) == 1 and row.count(4012) > 1 and 4001 in row

    net = AutoModelForImageTextToText.from_pretrained(out).eval()
    with torch.no_grad():
        logits = net(**batch).logits
    assert logits.shape[-1] == 4096 and torch.isfinite(logits).all()


def test_wrong_special_ids_and_a_missing_gpu_are_refused_naming_them(tmp_path, capsys):
    from vlmrl.config import load
    from vlmrl.models.random_init import main, special_ids

    with pytest.raises(ValueError, match="model.image_token_id=4011"):
        special_ids(load([*SMALL, "model.image_token_id=4011"], check_rules=False).model)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            main(["--out", str(tmp_path / "x"), "--device", "cuda", *SMALL])
        assert "--device cuda: this machine has no CUDA device" in capsys.readouterr().err
        assert not (tmp_path / "x").exists()


def test_the_reference_models_first_four_layers_at_full_width():
    """`model=qwen3_5_35b_a3b model.lm.num_layers=4`: 4 x 805M routed-expert parameters, a
    248,320-row embedding and output layer, the 27-block tower: 4.7B parameters, with
    <|endoftext|> at 248,044 and <|image_pad|> at 248,056 as published."""
    from vlmrl.config import load
    from vlmrl.models.bridge import hf_model_class
    from vlmrl.models.random_init import hf_config, special_ids

    model = load(["model=qwen3_5_35b_a3b", "model.lm.num_layers=4"], check_rules=False).model
    ids = special_ids(model)
    assert ids["<|endoftext|>"] == 248044 and ids["<|im_end|>"] == 248046 and ids["<|image_pad|>"] == 248056
    with torch.device("meta"):
        net = hf_model_class(model)(hf_config(model))
    sizes = {n: p.numel() for n, p in net.named_parameters()}
    experts = sum(v for n, v in sizes.items() if ".mlp.experts." in n)
    assert experts == 4 * 256 * 3 * 512 * 2048
    assert sizes["lm_head.weight"] == 248320 * 2048
    assert sum(1 for n in sizes if n.endswith("blocks.26.attn.proj.weight")) == 1
    assert 4.6e9 < sum(sizes.values()) < 4.9e9, sum(sizes.values())
