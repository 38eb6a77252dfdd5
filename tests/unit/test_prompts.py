"""Rows to prompts: image placeholders, instruction, bad rows, the prompt stream, encoding."""

from __future__ import annotations

import logging

import pytest
from PIL import Image

from vlmrl.config.schema import DataConfig
from vlmrl.data.images import encode_png
from vlmrl.data.prompts import (
    PromptDataset,
    RowError,
    SkipStats,
    build_prompt,
    encode_prompt,
    encode_prompt_response,
    prompt_length,
    row_fields,
    user_content,
)
from vlmrl.models.processor import load_processor

VISION = "<|vision_start|><|image_pad|><|vision_end|>"


def data_cfg(**overrides) -> DataConfig:
    base = dict(name="test", source="hf", min_pixels=3136, max_pixels=12544, max_prompt_length=256,
                image_cache_dir="", seed=3)
    return DataConfig(**{**base, **overrides})


def image(colour=(250, 20, 20), size=(112, 112)) -> Image.Image:
    return Image.new("RGB", size, colour)


def row(problem="<image>Find x.", answer="4", images=None) -> dict:
    return {"problem": problem, "answer": answer, "images": [image()] if images is None else images}


@pytest.fixture(scope="module")
def processor(tiny_checkpoint):
    return load_processor(tiny_checkpoint, min_pixels=3136, max_pixels=12544)


# --------------------------------------------------------------------------- placeholders
def test_no_placeholder_puts_images_before_the_text():
    assert user_content("Find x.", 2) == [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Find x."}]
    assert user_content("Find x.", 0) == [{"type": "text", "text": "Find x."}]


def test_one_placeholder_is_replaced_in_place():
    assert user_content("<image>Find x.", 1) == [{"type": "image"}, {"type": "text", "text": "Find x."}]
    assert user_content("In <image> find x.", 1) == [
        {"type": "text", "text": "In "}, {"type": "image"}, {"type": "text", "text": " find x."}]


def test_two_placeholders_take_the_images_in_order():
    assert user_content("A <image> and B <image>", 2) == [
        {"type": "text", "text": "A "}, {"type": "image"}, {"type": "text", "text": " and B "}, {"type": "image"}]


@pytest.mark.parametrize("problem, n", [("<image><image>Find x.", 1), ("<image>Find x.", 0), ("<image>x", 3)])
def test_placeholder_image_count_mismatch_is_a_row_error(problem, n):
    with pytest.raises(RowError, match="placeholder") as info:
        user_content(problem, n)
    assert info.value.reason == "placeholder_mismatch"


def test_instruction_is_appended_to_the_user_text():
    parts = user_content("<image>Find x.  ", 1, "Put the answer in \\boxed{}.")
    assert parts[-1] == {"type": "text", "text": "Find x.\nPut the answer in \\boxed{}."}
    # a problem ending with its image still ends with the instruction
    assert user_content("Look: <image>", 1, "Answer.")[-1] == {"type": "text", "text": "\nAnswer."}


# --------------------------------------------------------------------------- row fields
@pytest.mark.parametrize("bad, reason", [
    ({"answer": "4", "images": []}, "missing_field"),
    ({"problem": "Find x.", "answer": None, "images": []}, "missing_field"),
    ({"problem": "  ", "answer": "4", "images": []}, "empty_problem"),
    ({"problem": "Find x.", "answer": " ", "images": []}, "empty_answer"),
])
def test_row_fields_reject_missing_and_empty_values(bad, reason):
    with pytest.raises(RowError) as info:
        row_fields(bad, data_cfg())
    assert info.value.reason == reason


def test_row_fields_normalise_answers_and_single_images():
    img = image()
    assert row_fields({"problem": "p", "answer": 4, "images": img}, data_cfg()) == ("p", "4", [img])
    assert row_fields({"problem": "p", "answer": "4 "}, data_cfg()) == ("p", "4", [])


def test_custom_column_names_are_used():
    cfg = data_cfg(prompt_key="question", answer_key="label", image_key="pics")
    assert row_fields({"question": "q", "label": "2", "pics": []}, cfg) == ("q", "2", [])


# --------------------------------------------------------------------------- prompts
def test_build_prompt_renders_the_chat_template(processor):
    cfg = data_cfg(instruction="Answer in \\boxed{}.")
    prompt = build_prompt(row("A <image> B <image>", images=[image(), image((0, 0, 255))]), cfg, processor,
                          index=5, split="train")
    assert prompt.prompt_text == (f"<|im_start|>user\nA {VISION} B {VISION}\nAnswer in \\boxed{{}}.<|im_end|>\n"
                                  "<|im_start|>assistant\n")
    assert (prompt.index, prompt.split, prompt.answer) == (5, "train", "4")
    assert [im.getpixel((0, 0)) for im in prompt.images] == [(250, 20, 20), (0, 0, 255)]
    assert prompt.messages == [{"role": "user", "content": user_content("A <image> B <image>", 2,
                                                                       "Answer in \\boxed{}.")}]


def test_build_prompt_errors_name_the_row(processor):
    bad = row(images=[{"bytes": b"garbage", "path": None}])
    with pytest.raises(RowError, match=r"^train row 7: image 0: cannot decode image") as info:
        build_prompt(bad, data_cfg(), processor, index=7, split="train")
    assert info.value.reason == "unreadable_image"


def test_prompt_longer_than_max_prompt_length_is_a_row_error(processor):
    with pytest.raises(RowError, match="prompt tokens > data.max_prompt_length=20") as info:
        build_prompt(row(), data_cfg(max_prompt_length=20), processor)
    assert info.value.reason == "prompt_too_long"


def test_large_images_are_shrunk_to_max_pixels(processor):
    prompt = build_prompt(row(images=[image(size=(800, 400))]), data_cfg(), processor)
    (img,) = prompt.images
    assert img.width * img.height <= 12544 and img.width == 2 * img.height


def test_encode_prompt_expands_image_tokens(processor):
    prompt = build_prompt(row(), data_cfg(), processor)
    enc = encode_prompt(processor, prompt)
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert enc["image_grid_thw"].tolist() == [[1, 8, 8]]  # 112 px, 14 px patches
    assert enc["input_ids"].count(pad) == 16  # 8x8 patches after the 2x2 merge
    assert tuple(enc["pixel_values"].shape) == (64, 3 * 2 * 14 * 14)


@pytest.mark.parametrize("sizes", [[(112, 112)], [(300, 200), (40, 90)], []])
def test_prompt_length_matches_the_processor(processor, sizes):
    problem = "Compare " + " and ".join("<image>" for _ in sizes) + " then find x." if sizes else "Find x."
    prompt = build_prompt(row(problem, images=[image(size=s) for s in sizes]), data_cfg(), processor)
    assert prompt_length(processor, prompt.prompt_text, prompt.images) == len(encode_prompt(processor, prompt)["input_ids"])


def test_encode_prompt_without_images_gives_empty_tensors(processor):
    enc = encode_prompt(processor, build_prompt(row("Find x.", images=[]), data_cfg(), processor))
    assert tuple(enc["pixel_values"].shape) == (0, 1176) and tuple(enc["image_grid_thw"].shape) == (0, 3)


def test_encode_prompt_response_masks_only_the_response(processor):
    prompt = build_prompt(row(), data_cfg(), processor)
    enc = encode_prompt_response(processor, prompt, "Answer: \\boxed{4}")
    prompt_ids = encode_prompt(processor, prompt)["input_ids"]
    assert enc["input_ids"][: len(prompt_ids)] == prompt_ids
    assert enc["loss_mask"] == [0] * len(prompt_ids) + [1] * (len(enc["input_ids"]) - len(prompt_ids))
    answer_ids = [t for t, m in zip(enc["input_ids"], enc["loss_mask"]) if m]
    assert processor.tokenizer.decode(answer_ids) == "Answer: \\boxed{4}<|im_end|>"


# --------------------------------------------------------------------------- the stream
def stream_rows(n=12, bad=()) -> list[dict]:
    rows = [row(answer=str(i)) for i in range(n)]
    for i in bad:
        rows[i] = {"problem": "<image>x", "answer": "", "images": [image()]}
    return rows


def test_bad_rows_are_skipped_counted_by_reason_and_named(processor, caplog):
    rows = stream_rows(8)
    rows[1] = {"problem": "<image>x", "answer": "3", "images": [{"bytes": encode_png(image())[:40], "path": None}]}
    rows[2] = {"problem": "<image><image>x", "answer": "3", "images": [image()]}
    rows[4] = {"problem": "<image>x", "answer": "", "images": [image()]}
    rows[6] = {"answer": "3", "images": [image()]}
    ds = PromptDataset(data_cfg(), "train", processor, rows=rows)
    with caplog.at_level(logging.WARNING, logger="vlmrl.data.prompts"):
        prompts = list(ds)
    assert sorted(p.index for p in prompts) == [0, 3, 5, 7]
    assert ds.skips.counts == {"unreadable_image": 1, "placeholder_mismatch": 1, "empty_answer": 1,
                               "missing_field": 1}
    assert ds.skips.examples["empty_answer"] == [4]
    assert "train row 4" in caplog.text and "[empty_answer]" in caplog.text
    assert "4 train rows skipped" in ds.skips.summary() and "empty_answer 1 (rows 4)" in ds.skips.summary()
    list(ds)
    assert ds.skips.total == 4  # a bad row is counted once


def test_sample_batch_is_deterministic_and_reshuffles_each_epoch(processor):
    rows = stream_rows(10, bad=[3])
    a = PromptDataset(data_cfg(), "train", processor, rows=rows)
    b = PromptDataset(data_cfg(), "train", processor, rows=rows)
    first = [p.index for p in a.sample_batch(9)]  # exactly the valid rows of epoch 0
    assert first == [p.index for p in b.sample_batch(9)]
    assert sorted(first) == [0, 1, 2, 4, 5, 6, 7, 8, 9]
    assert a.state_dict()["epoch"] == 0
    second = [p.index for p in a.sample_batch(9)]
    assert sorted(second) == sorted(first) and second != first
    assert a.state_dict()["epoch"] == 1
    other_seed = PromptDataset(data_cfg(seed=4), "train", processor, rows=rows)
    assert [p.index for p in other_seed.sample_batch(9)] != first


def test_resume_from_state_dict_continues_the_stream(processor):
    rows = stream_rows(7)
    a = PromptDataset(data_cfg(), "train", processor, rows=rows)
    a.sample_batch(5)
    state = a.state_dict()
    expected = [p.index for p in a.sample_batch(6)]
    b = PromptDataset(data_cfg(), "train", processor, rows=rows)
    b.load_state_dict(state)
    assert [p.index for p in b.sample_batch(6)] == expected


def test_without_shuffle_rows_come_in_order_and_iteration_repeats(processor):
    ds = PromptDataset(data_cfg(shuffle=False), "test", processor, rows=stream_rows(5))
    assert [p.index for p in ds.sample_batch(7)] == [0, 1, 2, 3, 4, 0, 1]
    assert [p.index for p in ds] == [p.index for p in ds] == [0, 1, 2, 3, 4]


def test_a_failed_image_fetch_skips_the_row_for_that_draw_only(processor):
    """A network failure is not a property of the row: the row is skipped for the draw,
    drawn again later, and only dropped for good after failing three draws."""
    from _http import FileServer

    srv = FileServer({"/ok.png": encode_png(image()), "/later.png": encode_png(image((0, 200, 0)))})
    try:
        rows = stream_rows(4)
        rows[1] = row(images=[f"{srv.url}/later.png"])
        rows[2] = row(images=[f"{srv.url}/gone.png"])  # 404 on every draw
        srv.fail["/later.png"] = 2  # the first draw fails (1 try + 1 retry), later ones work
        ds = PromptDataset(data_cfg(shuffle=False, image_fetch_retries=1), "train", processor, rows=rows)
        assert [p.index for p in ds.sample_batch(2)] == [0, 3]  # rows 1 and 2 failed this draw
        assert [p.index for p in ds.sample_batch(3)] == [0, 1, 3]  # row 1 is back; row 2 fails again
        assert [p.index for p in ds.sample_batch(2)] == [0, 1]
        assert srv.requests.count("/gone.png") == 2
        # row 2 fails its third draw and is gone for good: not fetched again
        assert [p.index for p in ds.sample_batch(6)] == [3, 0, 1, 3, 0, 1]
        assert srv.requests.count("/gone.png") == 3
        assert ds.skips.counts["image_fetch_failed"] == 4  # row 1 once, row 2 three times
    finally:
        srv.close()


def test_a_split_without_valid_rows_raises_instead_of_looping(processor):
    ds = PromptDataset(data_cfg(), "train", processor, rows=stream_rows(3, bad=[0, 1, 2]))
    with pytest.raises(RuntimeError, match="no valid row in split 'train'.*empty_answer 3"):
        ds.sample_batch(1)


def test_processor_pixel_bounds_must_match_the_config(processor):
    with pytest.raises(ValueError, match="pixel bounds"):
        PromptDataset(data_cfg(max_pixels=50176), "train", processor, rows=[])


def test_skip_stats_keep_the_first_examples_only():
    stats = SkipStats("train", max_examples=2)
    for i in range(5):
        stats.add(RowError("empty_answer", "x", index=i, split="train"))
    assert stats.counts["empty_answer"] == 5 and stats.examples["empty_answer"] == [0, 1]
    assert stats.summary() == "5 train rows skipped: empty_answer 5 (rows 0, 1, ...)"
    assert SkipStats().summary() == "no rows skipped"
    assert str(RowError("empty_answer", "'answer' is empty")) == "'answer' is empty [empty_answer]"
