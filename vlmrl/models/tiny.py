"""Tiny checkpoints: real HF checkpoint directories of small random models of each family.

`python -m vlmrl.models.tiny [--family qwen2_5_vl|qwen3_5|qwen3_5_moe] --out DIR` writes
config.json, model.safetensors, a byte-level BPE tokenizer trained here (with Qwen's chat and
vision special tokens and a chat template that emits image placeholders), the image
processor config and the processor config, with the family's transformers classes
(Qwen2.5-VL, Qwen3.5, Qwen3.5-MoE). Everything downstream loads it with `from_pretrained`,
exactly like a downloaded model. `model=tiny` (Qwen2.5-VL), `model=tiny_qwen3_5` and
`model=tiny_qwen3_5_moe` with an empty `model.path` build theirs on first use under
`model.cache_dir`. A Qwen3.5 config.json also carries the keys published Qwen3.5 configs carry
beyond transformers' fields (`full_attention_interval`, `deepstack_visual_indexes: []`, ...),
which SGLang reads (`vlmrl.models.sglang_checkpoint`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..config.schema import ModelConfig, VlmrlConfig
from .processor import image_only, save_processor
from .sglang_checkpoint import (
    QWEN3_5_FAMILIES,
    QWEN3_5_TEXT_KEYS,
    QWEN3_5_VISION_KEYS,
    closest_interval,
    full_attention_interval,
    layer_types_override,
    sglang_layer_types,
)

# Special tokens take the first ids, in this order; model/tiny.yaml names three of them.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_pad|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
)

# Qwen-style chat template: images become <|vision_start|><|image_pad|><|vision_end|> in
# message order; the processor expands each <|image_pad|> to the image's token count.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|im_start|>{{ message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] }}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part['type'] == 'video' or 'video' in part -%}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in part -%}"
    "{{ part['text'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "<|im_end|>{{ '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>{{ 'assistant\\n' }}{%- endif -%}"
)

MAKER_VERSION = 1  # bump when the files written here change (Qwen2.5-VL's: cache keys)
# the Qwen3.5 families' own revision of their files (part of their cache keys only):
# 2 = config.json carries the keys published Qwen3.5 configs carry and SGLang reads
QWEN3_5_REVISION = 2


def _corpus(seed: int = 0, n: int = 4000) -> list[str]:
    """Text the tokenizer is trained on: geometry problems, numbers, LaTeX answers, chat words."""
    rng = random.Random(seed)
    shapes = ["triangle", "circle", "square", "rectangle", "polygon", "segment", "angle", "line",
              "arc", "chord", "radius", "diameter", "side", "vertex", "figure", "diagram", "shape"]
    colors = ["red", "green", "blue", "yellow", "black", "orange", "purple", "gray", "white"]
    verbs = ["Find", "How many", "What is", "Which", "Count the", "Compute", "Determine", "Give"]
    words = ["the", "of", "in", "is", "are", "a", "an", "to", "and", "measure", "length", "area",
             "perimeter", "number", "value", "x", "y", "m", "cm", "units", "degrees", "answer",
             "Answer:", "Therefore", "so", "The", "final", "image", "shown", "below", "there",
             "many", "color", "colored", "largest", "smallest", "left", "right", "top", "bottom"]
    latex = ["\\boxed{", "}", "\\frac{", "\\sqrt{", "\\pi", "^\\circ", "\\angle", "\\triangle",
             "\\text{", "\\cdot", "=", "+", "-", "(", ")", "{", "}", ".", ",", "?", ":"]
    out = []
    for _ in range(n):
        k = rng.randint(6, 20)
        pool = shapes + colors + verbs + words + latex
        toks = [rng.choice(pool) for _ in range(k)]
        toks.insert(rng.randint(0, k), str(rng.randint(0, 400)))
        if rng.random() < 0.5:
            toks.append(f"Answer: \\boxed{{{rng.randint(0, 99)}}}")
        out.append(" ".join(toks))
    out += [str(i) for i in range(1000)] + [f"{i / 10:.1f}" for i in range(1000)]
    out += ["system", "user", "assistant", "Please reason step by step, and put your final answer "
            "within \\boxed{}."]
    return out


def train_tokenizer(vocab_size: int, seed: int = 0, specials: Sequence[str] = SPECIAL_TOKENS) -> Any:
    """A byte-level BPE tokenizer (Qwen's pre-tokenization family) trained on `_corpus`, with
    `specials` at its first ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    for i, t in enumerate(specials):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


# the config option of each family's tiny model
TINY_OPTIONS = {"qwen2_5_vl": "tiny", "qwen3_5": "tiny_qwen3_5", "qwen3_5_moe": "tiny_qwen3_5_moe"}


def hf_config(model: ModelConfig) -> Any:
    """The transformers config of a tiny model: the family's, with the tokenizer's ids."""
    from .bridge import hf_config as family_hf_config

    config = family_hf_config(model)
    text = config.text_config
    text.bos_token_id = SPECIAL_TOKENS.index("<|endoftext|>")
    text.eos_token_id = SPECIAL_TOKENS.index("<|im_end|>")
    text.pad_token_id = SPECIAL_TOKENS.index("<|endoftext|>")
    config.video_token_id = SPECIAL_TOKENS.index("<|video_pad|>")
    if model.family in QWEN3_5_FAMILIES:
        add_published_qwen3_5_keys(model, config)
    return config


def add_published_qwen3_5_keys(model: ModelConfig, config: Any) -> None:
    """The keys published Qwen3.5 configs carry beyond transformers' fields, which SGLang reads
    (`vlmrl.models.sglang_checkpoint`): transformers' classes keep them as plain attributes,
    write them to config.json and build the same model with or without them."""
    text = config.text_config
    types = list(text.layer_types)
    interval = full_attention_interval(types)
    if interval is None:
        k = closest_interval(types)
        raise ValueError(
            f"model.lm.layer_types={types} (model={model.name}: conf/model/{model.name}.yaml or an override) "
            "follows no full_attention_interval, by which published Qwen3.5 configs and SGLang describe the "
            "layer kinds (layer l is full attention when (l + 1) % interval == 0); e.g. "
            f"{layer_types_override(sglang_layer_types(k, len(types)))} (interval {k})")
    text.full_attention_interval = interval
    for key, value in QWEN3_5_TEXT_KEYS.items():
        setattr(text, key, value)
    for key, value in QWEN3_5_VISION_KEYS.items():
        setattr(config.vision_config, key, list(value) if isinstance(value, list) else value)


# Gated DeltaNet decay rates of the tiny models: A = exp(A_log) ~ U(A_MIN, A_MAX). transformers
# draws A ~ U(0.01, 16), the range of a pretrained model's learned rates; with dt_bias = 1 most
# heads then forget all but ~1e-5 of their state at every token (exp(-A * softplus(1))), so a
# small model trained from scratch has almost no sequence mixing outside its attention layers.
A_MIN, A_MAX = 0.01, 1.0


def _init_for_training_from_scratch(net: Any) -> None:
    import torch

    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("linear_attn.A_log"):
                p.copy_(torch.empty_like(p).uniform_(A_MIN, A_MAX).log())


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike) -> Iterator[Path]:
    """A temp dir beside `out`, renamed to `out` (replacing it) when the block succeeds, removed
    otherwise: a reader never sees a half-written checkpoint."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def save_qwen_processor(model: ModelConfig, tokenizer: Any, specials: Sequence[str], out: Path, *,
                        min_pixels: int, max_pixels: int) -> None:
    """Write the family's processor for `tokenizer` (a `tokenizers.Tokenizer` holding Qwen's
    `specials`): the chat template, and the image processor at `model`'s patch sizes."""
    import transformers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from . import families

    tok = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token=None, additional_special_tokens=[t for t in specials if t != "<|endoftext|>"],
        padding_side="left", model_max_length=model.lm.max_position_embeddings)
    tok.chat_template = CHAT_TEMPLATE
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=min_pixels, max_pixels=max_pixels, patch_size=model.vision.patch_size,
        temporal_patch_size=model.vision.temporal_patch_size, merge_size=model.vision.spatial_merge_size)
    processor_class = families.get(model.family).PROCESSOR_CLASS
    processor = image_only(getattr(transformers, processor_class))(
        image_processor=image_processor, tokenizer=tok, chat_template=CHAT_TEMPLATE)
    save_processor(processor, out, processor_class)


def build_tiny_checkpoint(model: ModelConfig, out: str | os.PathLike, *, seed: int = 0,
                          min_pixels: int = 3136, max_pixels: int = 12544) -> Path:
    """Write the checkpoint directory `out` (atomically: a temp dir renamed at the end)."""
    import torch

    from .bridge import hf_model_class

    ids = {"image": model.image_token_id, "start": model.vision_start_token_id, "end": model.vision_end_token_id}
    expected = {"image": SPECIAL_TOKENS.index("<|image_pad|>"), "start": SPECIAL_TOKENS.index("<|vision_start|>"),
                "end": SPECIAL_TOKENS.index("<|vision_end|>")}
    if ids != expected:
        raise ValueError(f"tiny model token ids {ids} must match the trained tokenizer's {expected}")

    with atomic_dir(out) as tmp:
        save_qwen_processor(model, train_tokenizer(model.lm.vocab_size, seed), SPECIAL_TOKENS, tmp,
                            min_pixels=min_pixels, max_pixels=max_pixels)

        torch.manual_seed(seed)
        config = hf_config(model)
        net = hf_model_class(model)(config).eval()
        _init_for_training_from_scratch(net)
        net.generation_config.eos_token_id = [SPECIAL_TOKENS.index("<|im_end|>"),
                                              SPECIAL_TOKENS.index("<|endoftext|>")]
        net.generation_config.pad_token_id = SPECIAL_TOKENS.index("<|endoftext|>")
        net.save_pretrained(tmp, safe_serialization=True)
        meta = {"maker": "vlmrl.models.tiny", "version": MAKER_VERSION, "seed": seed,
                "num_parameters": sum(p.numel() for p in net.parameters())}
        (tmp / "vlmrl_tiny.json").write_text(json.dumps(meta, indent=2))
    return Path(out)


def _fingerprint(model: ModelConfig, seed: int, min_pixels: int, max_pixels: int) -> str:
    arch = {"lm": asdict(model.lm), "vision": asdict(model.vision), "seed": seed, "version": MAKER_VERSION,
            "pixels": [min_pixels, max_pixels]}
    if model.family != "qwen2_5_vl":  # (keeps the cache keys of existing Qwen2.5-VL tiny models)
        arch["family"] = model.family
        arch["gdn_decay"] = [A_MIN, A_MAX]
        arch["revision"] = QWEN3_5_REVISION
    return hashlib.sha256(json.dumps(arch, sort_keys=True, default=list).encode()).hexdigest()[:10]


def model_path(cfg: VlmrlConfig) -> str:
    """The HF checkpoint a run starts from: `model.path`, or the tiny model built on first use."""
    if cfg.model.path:
        return cfg.model.path
    return ensure_tiny_checkpoint(cfg.model, min_pixels=cfg.data.min_pixels, max_pixels=cfg.data.max_pixels)


def ensure_tiny_checkpoint(model: ModelConfig, *, seed: int = 0, min_pixels: int = 3136,
                           max_pixels: int = 12544) -> str:
    """The checkpoint dir for `model` (model.path when set), building it once if missing.

    The cache entry is keyed by the architecture, so changing `model.lm.*` builds anew.
    A file lock keeps concurrent first uses (test workers, Ray actors) from racing.
    """
    if model.path:
        return model.path
    import fcntl

    root = Path(model.cache_dir) / "models"
    prefix = "tiny" if model.family == "qwen2_5_vl" else f"tiny-{model.family}"
    out = root / f"{prefix}-{_fingerprint(model, seed, min_pixels, max_pixels)}"
    if (out / "config.json").exists():
        return str(out)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".tiny.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").exists():
            build_tiny_checkpoint(model, out, seed=seed, min_pixels=min_pixels, max_pixels=max_pixels)
    return str(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--family", default="qwen2_5_vl", choices=sorted(TINY_OPTIONS),
                        help="model family (config option model={})".format("|".join(TINY_OPTIONS.values())))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. model.lm.num_layers=2")
    args = parser.parse_args(argv)

    from ..config import load

    cfg = load([f"model={TINY_OPTIONS[args.family]}", *args.overrides])
    out = build_tiny_checkpoint(cfg.model, args.out, seed=args.seed, min_pixels=cfg.data.min_pixels,
                                max_pixels=cfg.data.max_pixels)
    meta = json.loads((out / "vlmrl_tiny.json").read_text())
    print(f"wrote {out} ({cfg.model.family}, {meta['num_parameters'] / 1e6:.2f}M parameters)")


if __name__ == "__main__":
    main()
