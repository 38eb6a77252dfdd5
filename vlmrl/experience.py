"""Experience: what the rollout engines produced, turned into what the trainer trains on.

A step's rollout records (prompt, generated tokens, their logprobs and, with an MoE, the
experts each token went through) become packed-ready `TrainSample`s with the processor's
prompt tokens in front, exactly as the engine saw them; SFT prompts become supervised samples;
a rollout's records give its metrics and the rows samples.jsonl keeps. Samples that cannot be
trained on are left out and counted by reason. No engine, trainer or Ray here: data in, data out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .data.images import encode_data_uri
from .data.prompts import Prompt, encode_prompt, encode_prompt_response
from .data.sft import sft_response
from .logging import keys as mk
from .rollout.manager import RolloutPrompt, SampleRecord
from .rollout.protocol import decode_routed_experts, routed_experts_bytes
from .training.batch import TrainSample

log = logging.getLogger(__name__)


def rollout_prompt(prompt: Prompt) -> RolloutPrompt:
    """A dataset prompt as the rollout engines take it: images as data URIs."""
    return RolloutPrompt(index=prompt.index, prompt_text=prompt.prompt_text,
                         images=tuple(encode_data_uri(im) for im in prompt.images), answer=prompt.answer)


def routed_experts_tensor(data: str, *, tokens: int, layers: int, topk: int) -> torch.Tensor:
    """The engine's routed experts of one sample as an int16 [tokens - 1, layers, topk] tensor,
    read from the wire bytes without a Python list (a step holds millions of ids)."""
    import sys

    raw = routed_experts_bytes(data, tokens=tokens, layers=layers, topk=topk)
    if sys.byteorder != "little":  # pragma: no cover
        return torch.tensor(decode_routed_experts(data, tokens=tokens, layers=layers, topk=topk),
                            dtype=torch.int16).view(-1, layers, topk)
    return torch.frombuffer(bytearray(raw), dtype=torch.int32).view(-1, layers, topk).to(torch.int16)


@dataclass
class GroupInputs:
    """What a complete group's samples need besides its records: the trainer's encoding of its
    prompt (`encode_prompt`) and each sample's routed experts (by `sample_index`: a tensor, the
    ValueError that its engine's bytes raised, or None where the engine sent none). Built as the
    group completes (`prepare_for`), while the engines still generate the others."""

    prompt: dict[str, Any]
    experts: dict[int, torch.Tensor | ValueError | None] = field(default_factory=dict)


def group_inputs(processor: Any, prompt: Prompt, records: Sequence[SampleRecord],
                 routing: tuple[int, int] | None = None) -> GroupInputs:
    """`GroupInputs` of one group's `records`, all of `prompt`; with `routing` (layers, top-k)
    each sample's routed experts are read from the engine's bytes."""
    enc = encode_prompt(processor, prompt)
    out = GroupInputs(prompt=enc)
    for rec in records:
        experts = None
        if routing is not None and rec.routed_experts is not None:
            try:
                experts = routed_experts_tensor(rec.routed_experts, tokens=len(enc["input_ids"]) + len(rec.response_ids),
                                                layers=routing[0], topk=routing[1])
            except ValueError as e:
                experts = e
        out.experts[rec.sample_index] = experts
    return out


def prepare_for(processor: Any, drawn: Sequence[Prompt],
                routing: tuple[int, int] | None = None) -> Callable[[list[SampleRecord]], GroupInputs]:
    """`group_inputs` of a complete group of a step's rollout, its prompt found among `drawn`
    (the step's prompts, a list that grows as the step's rounds draw more)."""
    def prepare(records: list[SampleRecord]) -> GroupInputs:
        index = records[0].prompt_index
        return group_inputs(processor, next(p for p in reversed(drawn) if p.index == index), records, routing)

    return prepare


def train_samples(processor: Any, prompts: Mapping[int, Prompt], records: Sequence[SampleRecord],
                  advantages: Sequence[float], *, routing: tuple[int, int] | None = None,
                  replay: bool = False, prepared: Mapping[int, GroupInputs] | None = None
                  ) -> tuple[list[TrainSample], dict[str, int]]:
    """TrainSamples of rollout records: the processor's prompt tokens (image placeholders
    expanded exactly as in rollout) followed by the generated tokens. A generated token is
    text to the trainer as it was to the engine, the image token's id included
    (`TrainSample.prompt_len`).

    With `routing` (layers, top-k: the engines report each token's experts) a sample carries
    them (`TrainSample.routed_experts`, [tokens - 1, layers, top-k]). `prepared` holds the
    groups' `GroupInputs` already built, by group position (the rollout builds each as the
    group completes); the others are built here.

    Samples that cannot be trained on are left out and counted by reason (second return
    value): `prompt_mismatch` (the engine tokenised the prompt differently from the trainer:
    other image pixel bounds or chat template; its logprobs belong to another sequence);
    `bad_routed_experts` (the engine's experts do not decode to [tokens - 1, layers, top-k]);
    with `replay`, `no_routed_experts` (the engine reported none: replay could not hold)."""
    groups: dict[int, list[SampleRecord]] = {}
    for rec in records:
        groups.setdefault(rec.group_index, []).append(rec)
    built = dict(prepared or {})
    out = []
    skipped = {"prompt_mismatch": 0, "bad_routed_experts": 0, "no_routed_experts": 0}
    for rec, adv in zip(records, advantages):
        if rec.group_index not in built:
            built[rec.group_index] = group_inputs(processor, prompts[rec.prompt_index], groups[rec.group_index], routing)
        inputs = built[rec.group_index]
        enc = inputs.prompt
        ids, resp = enc["input_ids"], list(rec.response_ids)
        if rec.prompt_ids is not None and list(rec.prompt_ids) != ids:
            if not skipped["prompt_mismatch"]:
                log.warning("row %s: the engine tokenised the prompt into %d tokens, the trainer into %d (check "
                            "data.min_pixels/max_pixels and the chat template); skipping such samples",
                            rec.prompt_index, len(rec.prompt_ids), len(ids))
            skipped["prompt_mismatch"] += 1
            continue
        if not resp:
            continue
        experts = inputs.experts.get(rec.sample_index) if routing is not None else None
        if isinstance(experts, ValueError):
            if not skipped["bad_routed_experts"]:
                log.warning("row %s: %s; skipping such samples", rec.prompt_index, experts)
            skipped["bad_routed_experts"] += 1
            continue
        if experts is None and replay:
            if not skipped["no_routed_experts"]:
                log.warning("row %s: the engine reported no routed experts (algo.routing_replay needs them; "
                            "SGLang: --enable-return-routed-experts); skipping such samples", rec.prompt_index)
            skipped["no_routed_experts"] += 1
            continue
        out.append(TrainSample(
            input_ids=ids + resp, loss_mask=[0.0] * len(ids) + [1.0] * len(resp),
            pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"], advantage=float(adv),
            rollout_logprobs=list(rec.logprobs) if rec.logprobs is not None else None, routed_experts=experts))
    return out, skipped


def sft_samples(processor: Any, prompts: Sequence[Prompt]) -> list[TrainSample]:
    """Supervised samples: each prompt followed by its `Answer: \\boxed{<answer>}` target."""
    out = []
    for p in prompts:
        enc = encode_prompt_response(processor, p, sft_response(p.answer))
        out.append(TrainSample(input_ids=enc["input_ids"], loss_mask=[float(m) for m in enc["loss_mask"]],
                               pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"]))
    return out


def rollout_metrics(records: Sequence[SampleRecord], rewards: Sequence[float]) -> dict[str, float]:
    """A rollout's reward, accuracy, response length and truncation."""
    n = max(len(records), 1)
    return {
        mk.ROLLOUT_RAW_REWARD: sum(rewards) / max(len(rewards), 1),
        mk.ROLLOUT_ACCURACY: sum(1.0 for r in rewards if r >= 1.0) / max(len(rewards), 1),
        mk.ROLLOUT_RESPONSE_LEN_MEAN: sum(len(r.response_ids) for r in records) / n,
        mk.ROLLOUT_TRUNCATED_RATIO: sum(r.truncated for r in records) / n,
    }


def sample_rows(records: Sequence[SampleRecord], rewards: Sequence[float], *, groups: int,
                advantages: Sequence[float] | None = None, prompts: Mapping[int, Prompt] | None = None,
                kind: str = "rollout") -> list[dict[str, Any]]:
    """What `samples.jsonl` keeps of a rollout: every sample of its first `groups` prompt groups
    (in the order they were drawn), each with its reply, reward and, for a training rollout, its
    advantage; the prompt's text (from `prompts`) rides on the group's first sample. An evaluation
    (one greedy reply a prompt) passes each reply as a group of one."""
    keep = set(sorted({r.group_index for r in records})[:max(groups, 0)])
    rows = []
    for i, rec in enumerate(records):
        if rec.group_index not in keep:
            continue
        row: dict[str, Any] = {
            "kind": kind, "prompt_index": rec.prompt_index, "group": rec.group_index, "sample": rec.sample_index,
            "answer": rec.answer, "response": rec.text, "response_tokens": len(rec.response_ids),
            "finish_reason": rec.finish_reason, "reward": float(rewards[i])}
        if advantages is not None:
            row["advantage"] = float(advantages[i])
        if rec.weight_version is not None:
            row["weight_version"] = rec.weight_version
        if prompts is not None and rec.sample_index == 0 and rec.prompt_index in prompts:
            row["prompt"] = prompts[rec.prompt_index].prompt_text
        rows.append(row)
    return rows
