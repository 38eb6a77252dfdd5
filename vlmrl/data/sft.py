"""Supervised fine-tuning rows: the prompt of a row plus its answer as the assistant turn.

`format_sft_row` turns a dataset row into the SFT schema, which is GEO3K's plus a chat:

    problem   str
    answer    str
    images    list of {"bytes": <the image file's bytes>, "path": None} (HF Image feature)
    messages  str: JSON of [user message (image parts + text + instruction),
                           assistant message ("Answer: \\boxed{<answer>}")]

`messages` is a JSON string rather than a list of structs: user content mixes image and
text parts, which Arrow would store as one struct type with null-filled keys (an image
part reading back with "text": None); the string round-trips through parquet and
`datasets` unchanged. `parse_messages` reads it back (and passes a list through).

`build_sft_example` turns such a row into token ids with a loss mask on the assistant
tokens only, through the same prompt path as RL (`prompts.encode_prompt_response`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..config.schema import DataConfig
from .images import ImageError, decode_image, image_bytes
from .prompts import (
    Prompt,
    RowError,
    encode_prompt_response,
    load_images,
    render_prompt,
    row_fields,
    user_messages,
)


def sft_response(answer: str) -> str:
    """The assistant turn of an SFT row: `Answer: \\boxed{<answer>}`."""
    return f"Answer: \\boxed{{{answer}}}"


def sft_features() -> Any:
    """The `datasets.Features` of SFT rows (see the module docstring)."""
    import datasets

    return datasets.Features({
        "problem": datasets.Value("string"),
        "answer": datasets.Value("string"),
        "images": datasets.List(datasets.Image()),
        "messages": datasets.Value("string"),
    })


def format_sft_row(row: Mapping[str, Any], cfg: DataConfig, *, index: int = -1, split: str = "") -> dict[str, Any]:
    """The SFT row of a dataset row (column names from `cfg`; the user turn gets `cfg.instruction`
    exactly as RL prompts do). Images of any form are fetched, checked to decode within
    `cfg.max_image_megapixels`, and stored as their file bytes. Raises `RowError`."""
    try:
        problem, answer, raw_images = row_fields(row, cfg)
        messages = user_messages(problem, len(raw_images), cfg.instruction)
        images = []
        for position, obj in enumerate(raw_images):
            try:
                data = image_bytes(obj, cache_dir=cfg.image_cache_dir or None, timeout_s=cfg.image_fetch_timeout_s)
                decode_image(data, max_megapixels=cfg.max_image_megapixels)
            except ImageError as e:
                raise RowError(e.reason, f"image {position}: {e}") from e
            images.append({"bytes": data, "path": None})
    except RowError as e:
        raise RowError(e.reason, e.detail, index=index, split=split) from e.__cause__
    messages.append({"role": "assistant", "content": [{"type": "text", "text": sft_response(answer)}]})
    return {"problem": problem, "answer": answer, "images": images, "messages": json.dumps(messages)}


def parse_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat of an SFT row's `messages` value (a JSON string, or an already decoded list)."""
    return json.loads(value) if isinstance(value, str) else list(value)


def message_text(message: Mapping[str, Any]) -> str:
    """The text of a message whose content is a string or a list of parts."""
    content = message["content"]
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part.get("type") == "text")


def build_sft_example(processor: Any, row: Mapping[str, Any]) -> dict[str, Any]:
    """Training inputs of an SFT row: `input_ids` (list[int]), `loss_mask` (list[int], 1 on the
    assistant answer tokens and the closing `<|im_end|>`, 0 on every prompt token),
    `pixel_values` and `image_grid_thw` (tensors, as `prompts.encode_prompt`)."""
    *chat, reply = parse_messages(row["messages"])
    if reply.get("role") != "assistant" or not chat:
        raise ValueError("an SFT row's messages must be the prompt turns followed by one assistant turn")
    images = load_images(row.get("images") or [], processor)
    parts = sum(1 for m in chat if not isinstance(m["content"], str) for p in m["content"] if p.get("type") == "image")
    if parts != len(images):
        raise RowError("placeholder_mismatch", f"{parts} image part(s) in messages but {len(images)} image(s)")
    prompt = Prompt(index=-1, split="", problem=str(row.get("problem", "")), answer=str(row.get("answer", "")),
                    images=images, messages=chat, prompt_text=render_prompt(processor, chat))
    return encode_prompt_response(processor, prompt, message_text(reply))
