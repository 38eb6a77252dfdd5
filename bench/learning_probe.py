"""Probe an HF checkpoint of a run (`save_hf=true`, the run dir's hf/) on the synthetic test split.

For every test prompt it scores the four well-formed replies `Answer: \\boxed{c}` (c: the
template's four possible answers) by their full sequence probability under the model, with the
real image and with the image blanked (a plain white picture of the same size). It prints:

- `argmax_acc`: how often the correct reply is the most probable of the four (close to greedy
  accuracy when the greedy reply is well formed);
- `p_correct`: the mean probability of the exact correct reply, i.e. the expected reward of a
  T=1 sample that takes the reference format (a lower bound of the sampled reward);
- `p_formed`: the mean probability mass of the four well-formed replies together;
- `p_correct_given_formed`: p(correct) / p(four replies), averaged;
- `argmax_answers_per_template`: how often each of a template's four answers (in the order of
  its counts 3, 4, 5, 6) is the most probable reply (a policy collapsed onto one answer puts all its prompts in one column);
- the same with blanked images: a model that reads the image loses its accuracy there.

    python bench/learning_probe.py RUN_DIR/hf [--overrides model=tiny_qwen3_5_moe ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

import torch


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("hf_dir")
    ap.add_argument("--overrides", nargs="*", default=[])
    ap.add_argument("--max-prompts", type=int, default=128)
    args = ap.parse_args(argv)

    import transformers
    from PIL import Image

    from vlmrl.config import load
    from vlmrl.data.prompts import PromptDataset, encode_prompt_response
    from vlmrl.data.sft import sft_response
    from vlmrl.data.synthetic import TEMPLATES
    from vlmrl.models.processor import load_processor

    cfg = load(args.overrides, check_rules=False)
    processor = load_processor(args.hf_dir, min_pixels=cfg.data.min_pixels, max_pixels=cfg.data.max_pixels)
    model = transformers.AutoModelForImageTextToText.from_pretrained(args.hf_dir, dtype=torch.float32).eval()
    ds = PromptDataset(cfg.data, cfg.data.test_split, processor)
    candidates = {t.problem: [str(t.answer(c)) for c in t.counts] for t in TEMPLATES}
    names = {t.problem: t.name for t in TEMPLATES}

    def seq_logprob(prompt, response: str) -> float:
        enc = encode_prompt_response(processor, prompt, response)
        ids = torch.tensor([enc["input_ids"]])
        mask = torch.tensor(enc["loss_mask"][1:], dtype=torch.bool)
        kwargs = {}
        if enc["pixel_values"].numel():
            kwargs = {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]}
            if cfg.model.family != "qwen2_5_vl":
                kwargs["mm_token_type_ids"] = (ids == model.config.image_token_id).long()
        with torch.no_grad():
            logits = model(input_ids=ids, **kwargs).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
        return float(lp[mask].sum())

    stats = {k: {"argmax": 0.0, "p_correct": 0.0, "p_formed": 0.0, "p_cond": 0.0} for k in ("image", "blank")}
    n = 0
    picked = {k: {} for k in stats}  # argmax reply per template: how often each answer is picked
    for prompt in ds:
        if n >= args.max_prompts:
            break
        n += 1
        blank = [Image.new("RGB", im.size, (255, 255, 255)) for im in prompt.images]
        for key, p in (("image", prompt), ("blank", dataclasses.replace(prompt, images=blank))):
            cands = candidates[prompt.problem]
            lps = [seq_logprob(p, sft_response(c)) for c in cands]
            probs = [math.exp(x) for x in lps]
            right = cands.index(prompt.answer)
            s = stats[key]
            best = max(range(4), key=lambda i: lps[i])
            s["argmax"] += float(best == right)
            hist = picked[key].setdefault(names[prompt.problem], [0] * 4)
            hist[best] += 1
            s["p_correct"] += probs[right]
            s["p_formed"] += sum(probs)
            s["p_cond"] += probs[right] / max(sum(probs), 1e-30)
    out = {key: {"argmax_acc": s["argmax"] / n, "p_correct": s["p_correct"] / n, "p_formed": s["p_formed"] / n,
                 "p_correct_given_formed": s["p_cond"] / n} for key, s in stats.items()}
    out["argmax_answers_per_template"] = picked
    out["prompts"] = n
    json.dump(out, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
