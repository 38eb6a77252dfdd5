"""Random-init checkpoints at a model config's own width, in the published HF layout.

    python -m vlmrl.models.random_init --out DIR [--device cuda] model=qwen3_5_35b_a3b model.lm.num_layers=4

writes what a downloaded Qwen3.5 checkpoint holds: config.json (the family's transformers
config with the keys published Qwen3.5 configs carry, which SGLang reads), model.safetensors
shards in `model.dtype` under transformers' names, generation_config.json, and the processor
(tokenizer, chat template, image processor at the config's patch sizes). Every dimension is the
config's: for the reference model's first four layers that is hidden 2,048, 256 experts top-8
with the shared expert, a vocabulary of 248,320 and the 27-block vision tower (4.7B parameters).
Drawing that many on a CPU is slow; `--device cuda` draws them on the GPU.

The tokenizer puts Qwen's special tokens at the published ids: `<|endoftext|>` at
`model.vision_start_token_id - 9`, then `<|im_start|>`, `<|im_end|>`, ..., `<|image_pad|>` at
`model.image_token_id` (the published order; a config whose ids disagree with it is refused).
Below them sits a small byte-level BPE trained here and placeholder entries `<|reserved_i|>`
that no text encodes to, so that the ids and the embedding's rows are the published ones
without the published vocabulary. Text therefore tokenizes differently from the real model's,
which a random model does not notice.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from ..config.schema import ModelConfig
from .sglang_checkpoint import QWEN3_5_FAMILIES
from .tiny import add_published_qwen3_5_keys, atomic_dir, save_qwen_processor, train_tokenizer

# Qwen's special tokens in their published order, from the first special id on
PUBLISHED_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                      "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                      "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
BASE_VOCAB = 2048  # the byte-level BPE under the placeholders
MAKER_VERSION = 1


def special_ids(model: ModelConfig) -> dict[str, int]:
    """token -> id of PUBLISHED_SPECIALS for `model`, checked against the ids its config names."""
    first = model.vision_start_token_id - PUBLISHED_SPECIALS.index("<|vision_start|>")
    ids = {t: first + i for i, t in enumerate(PUBLISHED_SPECIALS)}
    named = {"model.image_token_id": (model.image_token_id, "<|image_pad|>"),
             "model.vision_end_token_id": (model.vision_end_token_id, "<|vision_end|>")}
    bad = [f"{key}={value} (the published order puts {tok} at {ids[tok]})" for key, (value, tok) in named.items()
           if value != ids[tok]]
    if bad or first <= BASE_VOCAB or ids["<|video_pad|>"] >= model.lm.vocab_size:
        raise ValueError(f"model={model.name}: special token ids do not follow Qwen's published layout below "
                         f"model.lm.vocab_size={model.lm.vocab_size} above a {BASE_VOCAB}-token BPE: "
                         + ("; ".join(bad) or f"<|endoftext|> would be {first}"))
    return ids


def build_tokenizer(model: ModelConfig, seed: int = 0) -> Any:
    """A `tokenizers.Tokenizer` with the published special ids of `model` (module docstring)."""
    from tokenizers import Tokenizer

    ids = special_ids(model)
    first = min(ids.values())
    tok = train_tokenizer(BASE_VOCAB, seed, specials=())
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    vocab.update({f"<|reserved_{i}|>": i for i in range(len(vocab), first)})
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.add_special_tokens(list(PUBLISHED_SPECIALS))
    got = {t: tok.token_to_id(t) for t in PUBLISHED_SPECIALS}
    assert got == ids, (got, ids)
    return tok


def hf_config(model: ModelConfig) -> Any:
    """The transformers config of `model` with the published token ids and config keys."""
    from .bridge import hf_config as family_hf_config

    ids = special_ids(model)
    config = family_hf_config(model)
    text = config.text_config
    text.bos_token_id = text.pad_token_id = ids["<|endoftext|>"]
    text.eos_token_id = ids["<|im_end|>"]
    config.video_token_id = ids["<|video_pad|>"]
    if model.family in QWEN3_5_FAMILIES:
        add_published_qwen3_5_keys(model, config)
    return config


def build_checkpoint(model: ModelConfig, out: str | os.PathLike, *, device: str = "cpu", seed: int = 0,
                     min_pixels: int = 3136, max_pixels: int = 12544, max_shard_size: str = "4GB") -> Path:
    """Write the checkpoint directory `out` (atomically: a temp dir renamed at the end), the
    weights drawn on `device` in `model.dtype`."""
    import torch

    from .bridge import hf_model_class

    ids = special_ids(model)
    with atomic_dir(out) as tmp:
        save_qwen_processor(model, build_tokenizer(model, seed), PUBLISHED_SPECIALS, tmp,
                            min_pixels=min_pixels, max_pixels=max_pixels)

        torch.manual_seed(seed)
        dtype = getattr(torch, model.dtype)
        before = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # drawn in the checkpoint's dtype: no fp32 copy of 4.7B parameters
        try:
            with torch.device(device):
                net = hf_model_class(model)(hf_config(model)).eval()
        finally:
            torch.set_default_dtype(before)
        net.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
        net.generation_config.pad_token_id = ids["<|endoftext|>"]
        net.save_pretrained(tmp, safe_serialization=True, max_shard_size=max_shard_size)
        meta = {"maker": "vlmrl.models.random_init", "version": MAKER_VERSION, "seed": seed, "device": device,
                "num_parameters": sum(p.numel() for p in net.parameters())}
        (tmp / "vlmrl_random_init.json").write_text(json.dumps(meta, indent=2))
        del net
    return Path(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--device", default="cpu", help="where the weights are drawn (cpu, cuda)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. model=qwen3_5_35b_a3b model.lm.num_layers=4")
    args = parser.parse_args(argv)

    from ..config import load

    cfg = load(list(args.overrides), check_rules=False)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser.error(f"--device {args.device}: this machine has no CUDA device (--device cpu draws on the host)")
    out = build_checkpoint(cfg.model, args.out, device=args.device, seed=args.seed,
                           min_pixels=cfg.data.min_pixels, max_pixels=cfg.data.max_pixels)
    meta = json.loads((out / "vlmrl_random_init.json").read_text())
    print(f"wrote {out} ({cfg.model.name}, {cfg.model.family}, {meta['num_parameters'] / 1e9:.3f}B parameters)")


if __name__ == "__main__":
    main()
