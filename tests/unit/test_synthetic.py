"""The procedural task: GEO3K's schema, determinism, disjoint splits, and an answer that only
the image tells (text alone stays at chance; reading the picture gets every row right)."""

from __future__ import annotations

import io
import math
from collections import Counter, defaultdict

import numpy as np
import pytest
from PIL import Image

from vlmrl.config.schema import SyntheticDataConfig
from vlmrl.data.loading import raw_rows
from vlmrl.data.synthetic import TEMPLATES, build_synthetic, chance_accuracy, generate_rows

CFG = SyntheticDataConfig(num_train=360, num_test=120, seed=7, image_size=112)


@pytest.fixture(scope="module")
def splits():
    return {split: list(raw_rows(build_synthetic(CFG, split))) for split in ("train", "test")}


def pixels(row) -> Image.Image:
    return Image.open(io.BytesIO(row["images"][0]["bytes"]))


def count_dots(img: Image.Image) -> int:
    """Connected blobs of near-black pixels: the only thing in a diagram that dark."""
    dark = np.asarray(img.convert("RGB")).max(axis=2) < 80
    todo = set(zip(*np.nonzero(dark)))
    blobs = 0
    while todo:
        blobs += 1
        stack = [todo.pop()]
        while stack:
            y, x = stack.pop()
            for nb in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if nb in todo:
                    todo.remove(nb)
                    stack.append(nb)
    return blobs


def test_rows_have_geo3k_schema(splits):
    ds = build_synthetic(CFG, "test")
    assert ds.column_names == ["problem", "answer", "images"]
    assert str(ds.features["images"]) == "List(Image(mode=None, decode=True))"
    assert len(splits["train"]) == CFG.num_train and len(splits["test"]) == CFG.num_test
    for row in splits["test"]:
        assert row["problem"].count("<image>") == 1
        assert row["answer"].isdigit()
        (image,) = row["images"]
        assert image["path"] is None
        img = pixels(row)
        assert img.format == "PNG" and img.size == (CFG.image_size, CFG.image_size)
    assert isinstance(ds[0]["images"][0], Image.Image)  # decodes like any HF Image column


def test_same_seed_gives_identical_bytes_and_another_seed_does_not():
    a = generate_rows(48, seed=3, split="train", image_size=112)
    b = generate_rows(48, seed=3, split="train", image_size=112)
    c = generate_rows(48, seed=4, split="train", image_size=112)
    assert a == b
    assert [r["images"] for r in a] != [r["images"] for r in c]


def test_splits_are_disjoint(splits):
    def keys(rows):
        return {(r["problem"], r["images"][0]["bytes"]) for r in rows}

    train, test = keys(splits["train"]), keys(splits["test"])
    assert len(train) == CFG.num_train and len(test) == CFG.num_test  # no repeats inside a split either
    assert not train & test


def test_unknown_split_is_refused():
    with pytest.raises(ValueError, match="splits"):
        build_synthetic(CFG, "validation")


def test_templates_and_answers_are_balanced(splits):
    for rows in splits.values():
        per_template = Counter(r["problem"] for r in rows)
        assert len(per_template) == len(TEMPLATES)
        assert max(per_template.values()) - min(per_template.values()) <= 1
        answers = defaultdict(Counter)
        for r in rows:
            answers[r["problem"]][r["answer"]] += 1
        for counts in answers.values():
            assert len(counts) == 4
            assert max(counts.values()) - min(counts.values()) <= 1


def conditional_entropy_bits(rows) -> float:
    """H(answer | problem text), plug-in estimate."""
    by_text = defaultdict(Counter)
    for r in rows:
        by_text[r["problem"]][r["answer"]] += 1
    h = 0.0
    for counts in by_text.values():
        n = sum(counts.values())
        h += n / len(rows) * -sum(c / n * math.log2(c / n) for c in counts.values())
    return h


def test_text_carries_no_information_about_the_answer_within_a_template(splits):
    # Each template's text is fixed and its answers uniform over four values: given the text,
    # two full bits of uncertainty remain (mutual information with the answer is zero).
    assert conditional_entropy_bits(splits["train"]) == pytest.approx(2.0, abs=0.01)
    assert chance_accuracy() == 0.25


def test_text_only_baseline_learned_on_train_is_at_chance_on_test(splits):
    # The best text-only classifier: the majority answer of each problem text on train.
    majority = {}
    by_text = defaultdict(Counter)
    for r in splits["train"]:
        by_text[r["problem"]][r["answer"]] += 1
    for text, counts in by_text.items():
        majority[text] = counts.most_common(1)[0][0]
    test = splits["test"]
    accuracy = sum(majority[r["problem"]] == r["answer"] for r in test) / len(test)
    assert abs(accuracy - chance_accuracy()) <= 0.05


def test_the_image_determines_the_answer(splits):
    # A trivial image reader (count the dark dots) answers every row: the information is
    # in the picture, and legible.
    by_text = {t.problem: t for t in TEMPLATES}
    for r in splits["test"]:
        template = by_text[r["problem"]]
        assert str(template.answer(count_dots(pixels(r)))) == r["answer"]


def test_a_cached_split_is_the_built_split_byte_for_byte(tmp_path):
    """With `cache_dir`, the first call saves the split and the next loads it: the same rows,
    bytes included, as a build without the cache; other settings make another entry, and no
    temporary entry is left behind."""
    from dataclasses import replace

    cfg = replace(CFG, num_train=40, cache_dir=str(tmp_path))
    built = list(raw_rows(build_synthetic(replace(cfg, cache_dir=""), "train")))
    first = list(raw_rows(build_synthetic(cfg, "train")))
    (entry,) = tmp_path.iterdir()
    stamp = entry.stat().st_mtime_ns
    again = list(raw_rows(build_synthetic(cfg, "train")))
    assert first == built and again == built
    assert entry.stat().st_mtime_ns == stamp  # loaded, not written again
    other = list(raw_rows(build_synthetic(replace(cfg, seed=CFG.seed + 1), "train")))
    assert other != built
    assert sorted(p.name.startswith("train-40-") for p in tmp_path.iterdir()) == [True, True]
