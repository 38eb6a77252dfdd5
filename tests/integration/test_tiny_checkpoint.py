"""The tiny checkpoint is a real HF checkpoint: transformers loads it and generates."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from PIL import Image, ImageDraw


def test_loads_with_transformers_and_generates(tiny_checkpoint, tiny_config):
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLForConditionalGeneration

    from vlmrl.models.processor import load_processor

    d = tiny_config.data
    processor = load_processor(tiny_checkpoint, min_pixels=d.min_pixels, max_pixels=d.max_pixels)
    model = AutoModelForImageTextToText.from_pretrained(tiny_checkpoint).eval()
    assert isinstance(model, Qwen2_5_VLForConditionalGeneration)
    n = sum(p.numel() for p in model.parameters())
    assert 5e6 <= n <= 20e6, n

    image = Image.new("RGB", (112, 112), "white")
    ImageDraw.Draw(image).polygon([(20, 90), (56, 20), (92, 90)], fill="red")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many sides?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<|vision_start|><|image_pad|><|vision_end|>" in text and text.endswith("<|im_start|>assistant\n")
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    grid = inputs["image_grid_thw"][0]
    n_image_tokens = int(grid.prod()) // tiny_config.model.vision.spatial_merge_size**2
    assert int((inputs["input_ids"] == tiny_config.model.image_token_id).sum()) == n_image_tokens
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]
    assert isinstance(processor.batch_decode(out[:, inputs["input_ids"].shape[1]:])[0], str)


def test_tokenizer_has_qwen_special_tokens(tiny_checkpoint, tiny_config):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    m = tiny_config.model
    assert tok.convert_tokens_to_ids("<|image_pad|>") == m.image_token_id
    assert tok.convert_tokens_to_ids("<|vision_start|>") == m.vision_start_token_id
    assert tok.convert_tokens_to_ids("<|vision_end|>") == m.vision_end_token_id
    assert tok.eos_token == "<|im_end|>"
    assert len(tok) == m.lm.vocab_size
    ids = tok("Answer: \\boxed{42}")["input_ids"]
    assert tok.decode(ids) == "Answer: \\boxed{42}"


def test_checkpoint_is_cached_by_architecture(tiny_config, tiny_checkpoint):
    import dataclasses

    from vlmrl.models.tiny import ensure_tiny_checkpoint

    d = tiny_config.data
    again = ensure_tiny_checkpoint(tiny_config.model, min_pixels=d.min_pixels, max_pixels=d.max_pixels)
    assert again == tiny_checkpoint
    other = dataclasses.replace(tiny_config.model, lm=dataclasses.replace(tiny_config.model.lm, num_layers=2))
    path = ensure_tiny_checkpoint(other, min_pixels=d.min_pixels, max_pixels=d.max_pixels)
    assert path != tiny_checkpoint
    assert json.loads((Path(path) / "config.json").read_text())["text_config"]["num_hidden_layers"] == 2
