"""SFT rows: formatting, the messages column, and the assistant-only loss mask."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from vlmrl.config.schema import DataConfig
from vlmrl.data.images import encode_png
from vlmrl.data.prompts import RowError, build_prompt, encode_prompt
from vlmrl.data.sft import build_sft_example, format_sft_row, parse_messages, sft_features, sft_response
from vlmrl.models.processor import load_processor

INSTRUCTION = "Put the answer in \\boxed{}."


def data_cfg(**overrides) -> DataConfig:
    base = dict(name="test", source="hf", min_pixels=3136, max_pixels=12544, max_prompt_length=256,
                image_cache_dir="", instruction=INSTRUCTION)
    return DataConfig(**{**base, **overrides})


def diagram() -> Image.Image:
    img = Image.new("RGB", (112, 112), (240, 240, 255))
    img.putpixel((50, 50), (0, 0, 0))
    return img


@pytest.fixture(scope="module")
def processor(tiny_checkpoint):
    return load_processor(tiny_checkpoint, min_pixels=3136, max_pixels=12544)


@pytest.fixture
def geo_row():
    return {"problem": "<image>Find x.", "answer": "4", "images": [{"bytes": encode_png(diagram()), "path": None}]}


def test_sft_response_boxes_the_answer():
    assert sft_response("4") == "Answer: \\boxed{4}"
    assert sft_response("\\frac{3}{4}") == "Answer: \\boxed{\\frac{3}{4}}"


def test_format_sft_row(geo_row):
    out = format_sft_row(geo_row, data_cfg())
    assert list(out) == ["problem", "answer", "images", "messages"]
    assert (out["problem"], out["answer"]) == ("<image>Find x.", "4")
    assert out["images"] == geo_row["images"]  # the file bytes, unchanged
    assert parse_messages(out["messages"]) == [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Find x.\n{INSTRUCTION}"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Answer: \\boxed{4}"}]},
    ]


def test_format_sft_row_stores_pil_images_as_png_and_uses_column_names():
    cfg = data_cfg(prompt_key="question", answer_key="label", image_key="pics", instruction="")
    out = format_sft_row({"question": "Find y.", "label": 7, "pics": [diagram()]}, cfg)
    assert out["images"] == [{"bytes": encode_png(diagram()), "path": None}]
    assert out["answer"] == "7"
    assert parse_messages(out["messages"])[0]["content"] == [{"type": "image"}, {"type": "text", "text": "Find y."}]


def test_format_sft_row_rejects_bad_rows_by_name():
    bad = {"problem": "<image>x", "answer": "1", "images": [{"bytes": b"junk", "path": None}]}
    with pytest.raises(RowError, match=r"^train row 3: image 0") as info:
        format_sft_row(bad, data_cfg(), index=3, split="train")
    assert info.value.reason == "unreadable_image"


def test_messages_column_roundtrips_through_datasets(geo_row):
    import datasets

    out = format_sft_row(geo_row, data_cfg())
    ds = datasets.Dataset.from_list([out], features=sft_features())
    assert parse_messages(ds[0]["messages"]) == parse_messages(out["messages"])
    assert ds.features["messages"] == datasets.Value("string")


def test_loss_mask_covers_the_assistant_answer_and_im_end_only(processor, geo_row):
    sft_row = format_sft_row(geo_row, data_cfg())
    ex = build_sft_example(processor, sft_row)
    assert set(ex) == {"input_ids", "loss_mask", "pixel_values", "image_grid_thw"}
    assert len(ex["input_ids"]) == len(ex["loss_mask"])
    tok = processor.tokenizer
    masked = [t for t, m in zip(ex["input_ids"], ex["loss_mask"]) if m]
    assert tok.decode(masked) == "Answer: \\boxed{4}<|im_end|>"
    assert masked[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    first = ex["loss_mask"].index(1)
    assert all(ex["loss_mask"][first:]) and not any(ex["loss_mask"][:first])
    # the prompt part is exactly what RL feeds the model for the same row
    rl = encode_prompt(processor, build_prompt(geo_row, data_cfg(), processor))
    assert ex["input_ids"][:first] == rl["input_ids"]
    assert ex["image_grid_thw"].tolist() == rl["image_grid_thw"].tolist() == [[1, 8, 8]]
    assert ex["pixel_values"].equal(rl["pixel_values"])


def test_build_sft_example_accepts_decoded_messages(processor, geo_row):
    sft_row = format_sft_row(geo_row, data_cfg())
    as_list = {**sft_row, "messages": json.loads(sft_row["messages"])}
    assert build_sft_example(processor, as_list)["input_ids"] == build_sft_example(processor, sft_row)["input_ids"]


def test_build_sft_example_needs_a_final_assistant_turn(processor, geo_row):
    sft_row = format_sft_row(geo_row, data_cfg())
    user_only = json.dumps(parse_messages(sft_row["messages"])[:1])
    with pytest.raises(ValueError, match="assistant"):
        build_sft_example(processor, {**sft_row, "messages": user_only})
