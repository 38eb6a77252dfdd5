"""Data: loading splits through HF `datasets`, images, prompts, the procedural task, SFT rows.

    load_split(cfg, split)            one split (hub, local parquet/arrow/jsonl, HF cache, synthetic)
    decode_image / encode_data_uri    images in every form a row carries them
    PromptDataset(cfg, split, proc)   the valid prompts of a split: sample_batch, resume state, skips
    encode_prompt / encode_prompt_response   token ids (and loss mask) for training
    build_synthetic(cfg, split)       the procedural task (answer only in the picture)
    format_sft_row / build_sft_example   SFT rows and their masked token ids

torch and `datasets` are imported inside the functions that need them.
"""

from .images import (
    ImageError,
    ImageFetchError,
    ImageTooLargeError,
    decode_image,
    encode_data_uri,
    image_bytes,
)
from .loading import DatasetLoadError, DatasetSchemaError, load_split, raw_rows
from .prompts import (
    Prompt,
    PromptDataset,
    RowError,
    SkipStats,
    build_prompt,
    encode_prompt,
    encode_prompt_response,
    user_messages,
)
from .sft import build_sft_example, format_sft_row, parse_messages, sft_response
from .synthetic import TEMPLATES, build_synthetic, chance_accuracy

__all__ = [
    "TEMPLATES",
    "DatasetLoadError",
    "DatasetSchemaError",
    "ImageError",
    "ImageFetchError",
    "ImageTooLargeError",
    "Prompt",
    "PromptDataset",
    "RowError",
    "SkipStats",
    "build_prompt",
    "build_sft_example",
    "build_synthetic",
    "chance_accuracy",
    "decode_image",
    "encode_data_uri",
    "encode_prompt",
    "encode_prompt_response",
    "format_sft_row",
    "image_bytes",
    "load_split",
    "parse_messages",
    "raw_rows",
    "sft_response",
    "user_messages",
]
