"""The procedural task (`data=synthetic`): geometry diagrams whose answer is in the picture.

Every row has GEO3K's schema: `problem` ("<image>" + a question), `answer` (a string such
as "4") and `images` (one PNG stored as `{"bytes": ..., "path": None}`, the storage form of
HF `datasets`' Image feature, so rows round-trip through parquet exactly like GEO3K's).

Each template asks one fixed question, so the text carries no information about the
answer: within a template the answer is drawn uniformly from four values and only the
diagram tells which. A model that ignores the image is at `chance_accuracy()` (1/4).
The diagrams are made to be learnable by a tiny ViT (a 4 x 4 grid of merged image tokens:
112 px for 14 px patches, 128 px for 16 px ones): the quantity to read is a count of big
near-black dots (the vertices of a polygon, or points
on a circle) on a light background, one dot per merged image token (see `render`), while
which positions are used, jitter, fill, colours and line widths vary from row to row so
that no picture repeats.

Splits are deterministic by (seed, split) and disjoint: a rendered image belongs to the
train split only if the first byte of its SHA-256 is even, to the test split only if odd,
so no image can occur in both.
"""

from __future__ import annotations

import colorsys
import hashlib
import math
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from ..config.schema import SyntheticDataConfig
from .images import encode_png

SPLITS = ("train", "test")
COUNTS = (3, 4, 5, 6)


@dataclass(frozen=True)
class Template:
    """One question; `scene` draws `count` marked points; `answer(count)` is the label."""

    name: str
    problem: str
    scene: str  # "polygon" | "circle"
    answer: Callable[[int], int]
    counts: tuple[int, ...] = COUNTS


TEMPLATES: tuple[Template, ...] = (
    Template("polygon_sides", "<image>How many sides are there in the polygon in the figure?",
             "polygon", lambda n: n),
    Template("circle_points", "<image>How many points are on the circle in the figure?",
             "circle", lambda n: n),
    Template("polygon_angle_sum",
             "<image>What is the sum of the interior angles of the polygon in the figure, in degrees?",
             "polygon", lambda n: 180 * (n - 2)),
)


def chance_accuracy(templates: tuple[Template, ...] = TEMPLATES) -> float:
    """Expected accuracy of the best predictor that sees only the text: templates are used
    equally often and each one's answers are uniform, so it is the mean of 1/len(counts)."""
    return sum(1.0 / len(t.counts) for t in templates) / len(templates)


CELLS = 4  # merged image tokens per side of a diagram (at its default size)


def image_size_for(cfg: SyntheticDataConfig, cell: int | None) -> int:
    """`cfg.image_size`, or CELLS merged-token cells of `cell` pixels (28 when unknown)."""
    if cfg.image_size:
        return int(cfg.image_size)
    return CELLS * (cell or 28)


def build_synthetic(cfg: SyntheticDataConfig, split: str, *, cell: int | None = None) -> Any:
    """The `split` ("train" or "test") of the procedural task as a `datasets.Dataset` with
    columns problem, answer, images; identical bytes for identical (cfg, split, cell).
    `cell`: pixels per merged image token of the model (patch size x merge size).

    With `cfg.cache_dir` set, a split built once is saved there (`Dataset.save_to_disk`) and
    loaded by later calls: drawing and PNG-encoding the default 2,048 training rows takes
    seconds at every run's start. The entry's name is a hash of everything the rows depend
    on (`cache_key`), so a changed setting or generator builds a new one."""
    import datasets

    num_rows = {"train": cfg.num_train, "test": cfg.num_test}.get(split)
    if num_rows is None:
        raise ValueError(f"the synthetic task has splits {SPLITS}, not {split!r}")
    image_size = image_size_for(cfg, cell)
    if not cfg.cache_dir:
        return _build(num_rows, cfg.seed, split, image_size)
    path = Path(cfg.cache_dir) / f"{split}-{num_rows}-{cache_key(cfg.seed, split, num_rows, image_size)}"
    if path.is_dir():
        return datasets.load_from_disk(str(path))
    ds = _build(num_rows, cfg.seed, split, image_size)
    _save_atomically(ds, path)
    return datasets.load_from_disk(str(path))


def cache_key(seed: int, split: str, num_rows: int, image_size: int) -> str:
    """What a split's bytes depend on: its settings, the code of this module (the templates and
    the renderer) and of `images` (the PNG encoder), and the versions of Pillow (PNG encoding)
    and datasets (the storage format)."""
    import datasets
    import PIL

    from . import images

    code = hashlib.sha256(Path(__file__).read_bytes() + Path(images.__file__).read_bytes()).hexdigest()
    text = repr((seed, split, num_rows, image_size, code, PIL.__version__, datasets.__version__))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _save_atomically(ds: Any, path: Path) -> None:
    """Write `ds` under a temporary name beside `path`, then rename it into place: a reader
    sees a whole entry or none, and of two runs building the same entry one rename wins."""
    import datasets

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    shown = not datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        ds.save_to_disk(str(tmp))
        os.rename(tmp, path)
    except OSError:
        if not path.is_dir():  # not a lost race with another run: a real failure
            raise
    finally:
        if shown:
            datasets.enable_progress_bars()
        shutil.rmtree(tmp, ignore_errors=True)


def _build(num_rows: int, seed: int, split: str, image_size: int) -> Any:
    import datasets

    rows = generate_rows(num_rows, seed=seed, split=split, image_size=image_size)
    features = datasets.Features({
        "problem": datasets.Value("string"),
        "answer": datasets.Value("string"),
        "images": datasets.List(datasets.Image()),
    })
    columns = {key: [row[key] for row in rows] for key in features}
    return datasets.Dataset.from_dict(columns, features=features, split=datasets.NamedSplit(split))


def generate_rows(num_rows: int, *, seed: int, split: str, image_size: int,
                  templates: tuple[Template, ...] = TEMPLATES) -> list[dict[str, Any]]:
    """`num_rows` rows as plain dicts (problem, answer, images=[{"bytes", "path": None}])."""
    rng = random.Random(f"vlmrl-synthetic/{seed}/{split}")
    parity = SPLITS.index(split)
    rows = []
    for template, count in balanced_plan(num_rows, templates, rng):
        while True:  # rejection keeps the two splits' images disjoint by construction
            png = encode_png(render(template.scene, count, image_size, rng))
            if hashlib.sha256(png).digest()[0] % 2 == parity:
                break
        rows.append({"problem": template.problem, "answer": str(template.answer(count)),
                     "images": [{"bytes": png, "path": None}]})
    return rows


def balanced_plan(num_rows: int, templates: tuple[Template, ...],
                  rng: random.Random) -> list[tuple[Template, int]]:
    """(template, count) per row, shuffled: templates used equally often (within one) and,
    within a template, every count equally often (within one)."""
    plan = []
    for t_index, template in enumerate(templates):
        n = num_rows // len(templates) + (t_index < num_rows % len(templates))
        counts: list[int] = []
        while len(counts) < n:
            block = list(template.counts)
            rng.shuffle(block)
            counts += block
        plan += [(template, c) for c in counts[:n]]
    rng.shuffle(plan)
    return plan


# --------------------------------------------------------------------------- drawing
SLOTS = 8  # dot positions: evenly spaced on a circle, each inside its own cell of a 4 x 4 grid


def render(scene: str, count: int, size: int, rng: random.Random) -> Image.Image:
    """A `size` x `size` diagram with `count` dots; layout and style drawn from `rng`.

    The dots sit on `count` of `SLOTS` fixed positions around the centre (jittered by 2% of
    the size), so each dot falls inside one cell of a 4 x 4 grid, i.e. one merged image
    token of the tiny model's ViT: big, dark, one per token, which a tiny model learns to
    count within a few hundred optimizer steps (smaller dots spread over patch borders are
    not learned in that budget)."""
    img = Image.new("RGB", (size, size), _light(rng))
    draw = ImageDraw.Draw(img)
    dot = max(3, round(size / 12))  # dot radius
    centre, radius = size / 2, 0.357 * size
    jitter = 0.02 * size
    slots = sorted(rng.sample(range(SLOTS), count))
    angles = [math.pi / SLOTS + s * 2 * math.pi / SLOTS for s in slots]
    points = [(centre + radius * math.cos(a) + rng.uniform(-jitter, jitter),
               centre + radius * math.sin(a) + rng.uniform(-jitter, jitter)) for a in angles]
    line = rng.randint(1, max(2, size // 56))
    fill = _colour(rng, 0.1, 0.4, 0.85, 1.0) if rng.random() < 0.5 else None
    outline = _colour(rng, 0.4, 0.8, 0.55, 0.8)
    if scene == "polygon":
        draw.polygon(points, fill=fill, outline=outline, width=line)
    elif scene == "circle":
        draw.ellipse((centre - radius, centre - radius, centre + radius, centre + radius),
                     fill=fill, outline=outline, width=line)
    else:
        raise ValueError(f"unknown scene {scene!r}")
    ink = tuple(rng.randint(0, 40) for _ in range(3))
    for x, y in points:
        draw.ellipse((x - dot, y - dot, x + dot, y + dot), fill=ink)
    return img


def _light(rng: random.Random) -> tuple[int, int, int]:
    return tuple(rng.randint(235, 255) for _ in range(3))  # type: ignore[return-value]


def _colour(rng: random.Random, s_lo: float, s_hi: float, v_lo: float, v_hi: float) -> tuple[int, int, int]:
    r, g, b = colorsys.hsv_to_rgb(rng.random(), rng.uniform(s_lo, s_hi), rng.uniform(v_lo, v_hi))
    return round(r * 255), round(g * 255), round(b * 255)
