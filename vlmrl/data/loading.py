"""One split of a dataset in GEO3K's schema, loaded through HF `datasets`.

`load_split(cfg, split)` accepts, by `cfg.source` and `cfg.path`:
  - `source: synthetic`: the procedural task built in code (`synthetic.build_synthetic`);
  - a local file: `.parquet`, `.arrow`, `.jsonl` / `.json` (the whole file is the split);
  - a local directory: a `save_to_disk` dataset (or dataset dict), or files named
    `<split>.<ext>` / `<split>-*.<ext>` in it or in its `data/` folder;
  - anything else: a hub name for `datasets.load_dataset(path, split=split)`, which also
    serves a dataset already in the HF cache when offline (HF_DATASETS_OFFLINE=1).

The schema (cfg.prompt_key, cfg.answer_key, cfg.image_key columns) is checked here, at
load time, so a wrong dataset fails before any training process starts. `raw_rows` reads
rows as stored, images undecoded (`{"bytes", "path"}` dicts, or whatever the column holds:
paths, URLs, data URIs): `images.decode_image` decodes them one row at a time, bounding
their size, so a bad image skips its row instead of failing the read of the dataset.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..config.schema import DataConfig

# file extension -> `datasets` packaged builder
LOCAL_FORMATS = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json", ".json": "json"}


class DatasetSchemaError(ValueError):
    """The dataset lacks a column the config names."""


class DatasetLoadError(RuntimeError):
    """The dataset (or the split) cannot be found or read."""


def load_split(cfg: DataConfig, split: str, *, cell: int | None = None) -> Any:
    """The `split` of the dataset `cfg` names (a `datasets.Dataset`), schema-checked.
    `cell`: pixels per merged image token of the model (the synthetic task's grid)."""
    if cfg.source == "synthetic":
        from .synthetic import build_synthetic

        ds = build_synthetic(cfg.synthetic, {cfg.train_split: "train", cfg.test_split: "test"}.get(split, split),
                             cell=cell)
        origin = "the synthetic task"
    elif cfg.source == "hf":
        ds, origin = _load_hf(cfg.path, split)
    else:
        raise ValueError(f"data.source must be 'synthetic' or 'hf', not {cfg.source!r}")
    check_schema(ds.column_names, cfg, f"{origin} (split {split!r})")
    return ds


def check_schema(columns: list[str], cfg: DataConfig, origin: str) -> None:
    """Raise `DatasetSchemaError` naming every configured column missing from `columns`."""
    wanted = {"data.prompt_key": cfg.prompt_key, "data.answer_key": cfg.answer_key,
              "data.image_key": cfg.image_key}
    missing = [f"{name!r} ({key})" for key, name in wanted.items() if name not in columns]
    if missing:
        raise DatasetSchemaError(f"{origin} has no column {', '.join(missing)}; available columns: "
                                 f"{sorted(columns)}. Point the data.*_key options at the right columns.")


class RawRows(Sequence):
    """The rows of a `datasets.Dataset` as plain dicts, as stored: no feature is decoded."""

    def __init__(self, ds: Any):
        self._table = ds.with_format("arrow")

    def __len__(self) -> int:
        return len(self._table)

    def __getitem__(self, index: int) -> dict[str, Any]:  # type: ignore[override]
        return self._table[index].to_pylist()[0]


def raw_rows(rows: Any) -> Sequence[dict[str, Any]]:
    """`RawRows` of a `datasets.Dataset`; any other sequence of row dicts as it is."""
    import datasets

    return RawRows(rows) if isinstance(rows, datasets.Dataset) else rows


def _load_hf(path: str, split: str) -> tuple[Any, str]:
    import datasets

    if not path:
        raise DatasetLoadError("data.path is empty: give a hub name or a local parquet/arrow/jsonl path")
    local = Path(path).expanduser()
    if local.exists():
        return _load_local(local, split), str(local)
    if local.suffix in LOCAL_FORMATS or path.startswith(("/", ".", "~")):
        raise DatasetLoadError(f"no such file or directory: {path}")
    try:
        return datasets.load_dataset(path, split=split), f"dataset {path!r}"
    except Exception as e:  # the hub client raises many types; say what was tried
        raise DatasetLoadError(
            f"cannot load split {split!r} of dataset {path!r} from the hub or the HF cache: "
            f"{type(e).__name__}: {e}. Offline runs (HF_DATASETS_OFFLINE=1) need it cached; "
            "a local parquet/arrow/jsonl path works too.") from e


def _load_local(path: Path, split: str) -> Any:
    import datasets

    if path.is_file():
        return _load_files([path])
    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DatasetLoadError(f"{path} has splits {sorted(ds)}, not {split!r}")
            return ds[split]
        return ds
    for folder in (path, path / "data"):
        for ext in LOCAL_FORMATS:
            files = sorted(folder.glob(f"{split}{ext}")) + sorted(folder.glob(f"{split}-*{ext}"))
            if files:
                return _load_files(files)
    found = sorted(p.name for p in path.iterdir())[:20]
    raise DatasetLoadError(f"{path} holds no {split}.<ext> or {split}-*.<ext> file (ext: "
                           f"{', '.join(LOCAL_FORMATS)}), in itself or data/, and is no save_to_disk "
                           f"dataset; it holds: {found}")


def _load_files(files: list[Path]) -> Any:
    import datasets

    kinds = {LOCAL_FORMATS.get(f.suffix) for f in files}
    if None in kinds or len(kinds) != 1:
        raise DatasetLoadError(f"cannot read {[str(f) for f in files]}: expected files of one of the "
                               f"formats {', '.join(LOCAL_FORMATS)}")
    return datasets.load_dataset(kinds.pop(), data_files=[str(f) for f in files], split="train")
