"""Dataset rows to chat prompts, prompts to token ids, and the prompt stream of a split.

A row (`problem`, `answer`, `images`, key names from `DataConfig`) becomes a `Prompt`:
the user message is the problem split on `<image>` placeholders, each replaced in order
by the next image (a problem without placeholders gets its images before the text), with
`cfg.instruction` appended; the text the model sees is rendered by the checkpoint's own
chat template. A row that cannot make a valid prompt raises `RowError`; `PromptDataset`
skips it, counts it by reason in `SkipStats` and logs the first few row indices, so one
bad row never stops a run.

Image pixel bounds belong to the processor (loaded with `cfg.min_pixels` / `max_pixels`,
identical in rollout and training); `PromptDataset` checks they match the config.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from ..config.schema import DataConfig
from .images import ImageError, decode_image, fit_pixels
from .loading import load_split, raw_rows

logger = logging.getLogger(__name__)

IMAGE_PLACEHOLDER = "<image>"


class RowError(ValueError):
    """A row that cannot become a prompt. `reason` is one of: missing_field, empty_problem,
    empty_answer, placeholder_mismatch, unreadable_image, image_fetch_failed,
    image_too_large, prompt_too_long."""

    def __init__(self, reason: str, detail: str, *, index: int = -1, split: str = ""):
        self.reason, self.detail, self.index, self.split = reason, detail, index, split
        where = "" if index < 0 else f"{split} row {index}: " if split else f"row {index}: "
        super().__init__(f"{where}{detail} [{reason}]")


@dataclass
class SkipStats:
    """Skips counted by reason (a row whose images failed to fetch counts once per failed
    draw); the first `max_examples` row indices of each reason are
    kept (and logged as warnings) so the log names offending rows without flooding."""

    split: str = ""
    max_examples: int = 5
    counts: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[int]] = field(default_factory=dict)

    def add(self, error: RowError) -> None:
        self.counts[error.reason] += 1
        shown = self.examples.setdefault(error.reason, [])
        if len(shown) < self.max_examples:
            shown.append(error.index)
            logger.warning("skipping %s", error)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        """e.g. "3 train rows skipped: unreadable_image 2 (rows 4, 9), empty_answer 1 (rows 7)"."""
        rows_of = f"{self.split} rows" if self.split else "rows"
        if not self.total:
            return f"no {rows_of} skipped"
        parts = []
        for reason, n in self.counts.most_common():
            rows = ", ".join(map(str, self.examples[reason])) + (", ..." if n > len(self.examples[reason]) else "")
            parts.append(f"{reason} {n} (rows {rows})")
        return f"{self.total} {rows_of} skipped: " + ", ".join(parts)


@dataclass(frozen=True)
class Prompt:
    """One prompt: `messages` (user turn, image parts in place) rendered to `prompt_text` by
    the chat template; `images` in the order of the image parts."""

    index: int
    split: str
    problem: str
    answer: str
    images: list[Image.Image]
    messages: list[dict[str, Any]]
    prompt_text: str


# --------------------------------------------------------------------------- rows -> prompts
def user_content(problem: str, num_images: int, instruction: str = "") -> list[dict[str, Any]]:
    """The user message's content parts: `problem` (plus `instruction` after a newline) split on
    `<image>` placeholders, each replaced by an image part; with no placeholder, all images
    come first. Raises `RowError("placeholder_mismatch")` when the counts differ."""
    text = f"{problem.rstrip()}\n{instruction}" if instruction else problem
    pieces = text.split(IMAGE_PLACEHOLDER)
    placeholders = len(pieces) - 1
    if placeholders == 0:
        return [{"type": "image"} for _ in range(num_images)] + [{"type": "text", "text": text}]
    if placeholders != num_images:
        raise RowError("placeholder_mismatch", f"{placeholders} {IMAGE_PLACEHOLDER} placeholder(s) "
                                               f"but {num_images} image(s)")
    parts: list[dict[str, Any]] = []
    for i, piece in enumerate(pieces):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def user_messages(problem: str, num_images: int, instruction: str = "") -> list[dict[str, Any]]:
    """The chat of a prompt: one user message (see `user_content`)."""
    return [{"role": "user", "content": user_content(problem, num_images, instruction)}]


def row_fields(row: Mapping[str, Any], cfg: DataConfig) -> tuple[str, str, list[Any]]:
    """(problem, answer, raw images) of a row, validated: the problem and answer are present and
    non-empty (a numeric answer becomes its string); a missing image value means no images."""
    for key in (cfg.prompt_key, cfg.answer_key):
        if row.get(key) is None:
            raise RowError("missing_field", f"no value for {key!r}")
    problem, answer = row[cfg.prompt_key], str(row[cfg.answer_key]).strip()
    if not isinstance(problem, str) or not problem.strip():
        raise RowError("empty_problem", f"{cfg.prompt_key!r} is empty or not text")
    if not answer:
        raise RowError("empty_answer", f"{cfg.answer_key!r} is empty")
    images = row.get(cfg.image_key)
    if images is None:
        images = []
    elif not isinstance(images, list | tuple):
        images = [images]
    return problem, answer, list(images)


def load_images(raw: Sequence[Any], processor: Any, *, cache_dir: str | None = None, timeout_s: float = 10.0,
                max_megapixels: float | None = None, retries: int = 3) -> list[Image.Image]:
    """Decode a row's images and shrink any above the processor's max pixels (see `fit_pixels`).

    Raises `RowError` with the image's failure reason and position."""
    max_pixels = pixel_bounds(processor)[1]
    images = []
    for position, obj in enumerate(raw):
        try:
            img = decode_image(obj, cache_dir=cache_dir, timeout_s=timeout_s, max_megapixels=max_megapixels,
                               retries=retries)
        except ImageError as e:
            raise RowError(e.reason, f"image {position}: {e}") from e
        images.append(fit_pixels(img, max_pixels))
    return images


def build_prompt(row: Mapping[str, Any], cfg: DataConfig, processor: Any, *, index: int = -1,
                 split: str = "") -> Prompt:
    """The `Prompt` of a dataset row, or `RowError` naming the row and the reason."""
    try:
        problem, answer, raw_images = row_fields(row, cfg)
        messages = user_messages(problem, len(raw_images), cfg.instruction)
        images = load_images(raw_images, processor, cache_dir=cfg.image_cache_dir or None,
                             timeout_s=cfg.image_fetch_timeout_s, max_megapixels=cfg.max_image_megapixels,
                             retries=cfg.image_fetch_retries)
        text = render_prompt(processor, messages)
        length = prompt_length(processor, text, images)
        if length > cfg.max_prompt_length:
            raise RowError("prompt_too_long", f"{length} prompt tokens > data.max_prompt_length="
                                              f"{cfg.max_prompt_length}")
    except RowError as e:
        raise RowError(e.reason, e.detail, index=index, split=split) from e.__cause__
    return Prompt(index=index, split=split, problem=problem, answer=answer, images=images,
                  messages=messages, prompt_text=text)


# --------------------------------------------------------------------------- processor
def pixel_bounds(processor: Any) -> tuple[int, int]:
    """(min_pixels, max_pixels) of a Qwen-VL processor's image processor."""
    size = processor.image_processor.size
    return int(size["shortest_edge"]), int(size["longest_edge"])


def render_prompt(processor: Any, messages: list[dict[str, Any]]) -> str:
    """The prompt text of `messages` by the checkpoint's chat template, ending where the
    assistant's answer begins."""
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def prompt_length(processor: Any, prompt_text: str, images: Sequence[Image.Image]) -> int:
    """Tokens of the processed prompt (each image placeholder expanded to its image tokens),
    computed from image sizes without running the image processor."""
    ip = processor.image_processor
    text_tokens = len(processor.tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
    image_tokens = sum(ip.get_number_of_image_patches(img.height, img.width) // ip.merge_size**2 for img in images)
    return text_tokens - len(images) + image_tokens


def encode_prompt(processor: Any, prompt: Prompt) -> dict[str, Any]:
    """Model inputs of a prompt: `input_ids` (list[int], image placeholders expanded),
    `pixel_values` ([patches, C*T*P*P] float tensor) and `image_grid_thw` ([images, 3] long
    tensor); a prompt without images gets empty (0-row) tensors."""
    import torch

    ip = processor.image_processor
    batch = processor(text=[prompt.prompt_text], images=list(prompt.images) or None, return_tensors="pt")
    if prompt.images:
        pixel_values, grid = batch["pixel_values"], batch["image_grid_thw"]
    else:
        pixel_values = torch.zeros(0, 3 * ip.temporal_patch_size * ip.patch_size**2)
        grid = torch.zeros(0, 3, dtype=torch.long)
    return {"input_ids": batch["input_ids"][0].tolist(), "pixel_values": pixel_values, "image_grid_thw": grid}


def encode_prompt_response(processor: Any, prompt: Prompt, response: str) -> dict[str, Any]:
    """`encode_prompt` of `prompt` followed by the assistant turn `response`, with `loss_mask`
    (list[int], 1 per token) set on the response tokens and the chat template's end-of-turn
    token only. The response tokens are what the template renders after the prompt, up to
    and including the tokenizer's eos token (`<|im_end|>`), tokenized on their own exactly as
    a rollout would generate them after the prompt."""
    eos = processor.tokenizer.eos_token
    turn = {"role": "assistant", "content": [{"type": "text", "text": response}]}
    full = processor.apply_chat_template([*prompt.messages, turn], tokenize=False)
    if not full.startswith(prompt.prompt_text):
        raise ValueError("the chat template does not render the prompt as a prefix of the conversation")
    completion = full[len(prompt.prompt_text):]
    end = completion.rfind(eos)
    if end < 0:
        raise ValueError(f"the chat template ends no assistant turn with the eos token {eos!r}")
    completion_ids = processor.tokenizer(completion[: end + len(eos)], add_special_tokens=False)["input_ids"]
    encoded = encode_prompt(processor, prompt)
    prompt_ids = encoded["input_ids"]
    return {**encoded, "input_ids": prompt_ids + completion_ids,
            "loss_mask": [0] * len(prompt_ids) + [1] * len(completion_ids)}


# --------------------------------------------------------------------------- the stream
def token_cell(processor: Any) -> int | None:
    """Pixels per side of one merged image token of `processor` (patch size x merge size)."""
    ip = getattr(processor, "image_processor", None)
    patch, merge = getattr(ip, "patch_size", None), getattr(ip, "merge_size", None)
    return int(patch) * int(merge) if patch and merge else None


class PromptDataset:
    """The valid prompts of one split, in a deterministic order.

    Training draws with `sample_batch(n)`: an endless stream over epochs, each a permutation
    of the rows seeded by (cfg.seed, epoch) when cfg.shuffle, row order otherwise; the
    position in it is `state_dict()` / `load_state_dict()` for resume. Iterating yields
    every valid prompt once in epoch 0's order, the same on every call (evaluation).
    Invalid rows are skipped and counted in `skips` (each row once: known bad rows are
    remembered). A row whose image could not be fetched is skipped for that draw only and
    drawn again later (a network failure is not a property of the row), until it has failed
    `FETCH_FAILURES_BEFORE_SKIP` draws. A stream that finds no valid row in a whole pass
    raises instead of looping.
    """

    FETCH_FAILURES_BEFORE_SKIP = 3

    def __init__(self, cfg: DataConfig, split: str, processor: Any, *, rows: Any = None):
        """`rows`: a `datasets.Dataset` or a sequence of row dicts; default `load_split(cfg, split)`."""
        if pixel_bounds(processor) != (cfg.min_pixels, cfg.max_pixels):
            raise ValueError(f"processor pixel bounds {pixel_bounds(processor)} differ from data.min_pixels/"
                             f"max_pixels ({cfg.min_pixels}, {cfg.max_pixels}): image token counts would "
                             "differ between rollout and training")
        self.rows = raw_rows(load_split(cfg, split, cell=token_cell(processor)) if rows is None else rows)
        self.cfg, self.split, self.processor = cfg, split, processor
        self.skips = SkipStats(split)
        self.epoch, self.position = 0, 0
        self._bad: set[int] = set()
        self._fetch_failures: Counter[int] = Counter()
        self._order: tuple[int, list[int]] | None = None

    def __len__(self) -> int:
        """Rows in the split, valid or not."""
        return len(self.rows)

    def __iter__(self) -> Iterator[Prompt]:
        for index in self.order(0):
            prompt = self._prompt(index)
            if prompt is not None:
                yield prompt

    def order(self, epoch: int) -> list[int]:
        """Row indices of `epoch`, in the order they are drawn."""
        if self._order is None or self._order[0] != epoch:
            import numpy as np

            n = len(self.rows)
            perm = np.random.default_rng([self.cfg.seed, epoch]).permutation(n) if self.cfg.shuffle else range(n)
            self._order = (epoch, [int(i) for i in perm])
        return self._order[1]

    def sample_batch(self, n: int) -> list[Prompt]:
        """The next `n` valid prompts of the stream (crossing into the next epoch as needed)."""
        batch: list[Prompt] = []
        misses = 0  # draws in a row that gave no prompt
        while len(batch) < n:
            if len(self._bad) >= len(self.rows) or misses >= len(self.rows):
                raise RuntimeError(f"no valid row in split {self.split!r} ({len(self.rows)} rows): "
                                   f"{self.skips.summary()}")
            if self.position >= len(self.rows):
                self.epoch, self.position = self.epoch + 1, 0
            index = self.order(self.epoch)[self.position]
            self.position += 1
            prompt = self._prompt(index)
            if prompt is not None:
                batch.append(prompt)
                misses = 0
            else:
                misses += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def _prompt(self, index: int) -> Prompt | None:
        if index in self._bad:
            return None
        try:
            prompt = build_prompt(self.rows[index], self.cfg, self.processor, index=index, split=self.split)
        except RowError as e:
            self.skips.add(e)
            if e.reason == "image_fetch_failed":
                self._fetch_failures[index] += 1
                if self._fetch_failures[index] < self.FETCH_FAILURES_BEFORE_SKIP:
                    return None  # drawn again later
            self._bad.add(index)
            return None
        self._fetch_failures.pop(index, None)
        return prompt
