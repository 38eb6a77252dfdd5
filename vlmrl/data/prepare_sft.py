"""Write one split of a dataset in the SFT schema (problem, answer, images, messages) to parquet.

    python -m vlmrl.data.prepare_sft --dataset chenhegu/geo3k_imgurl --split train \\
        --out data/geo3k_sft/train_formatted.parquet [data.instruction='...' ...]

`--dataset` is a hub name, a local parquet/arrow/jsonl file or directory, or `synthetic`
(the procedural task). Trailing arguments are config overrides (the data group is
`geo3k` for a dataset path, `synthetic` otherwise), e.g. `data.instruction=...` or
`model.cache_dir=...` (where fetched images are cached). Bad rows are skipped and
summarised; the file is written atomically and read back by `datasets` with its Image
features (see `vlmrl.data.sft`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from ..config.schema import DataConfig
from .loading import load_split, raw_rows
from .prompts import RowError, SkipStats
from .sft import format_sft_row, sft_features

BATCH_ROWS = 256


def data_config(dataset: str, overrides: list[str] | tuple[str, ...] = ()) -> DataConfig:
    """The data config of `dataset` ('synthetic' or a hub name / local path) with `overrides`."""
    from ..config import load

    if dataset == "synthetic":
        return load(["data=synthetic", *overrides], check_rules=False).data
    data = load(["data=geo3k", *overrides], check_rules=False).data
    return dataclasses.replace(data, source="hf", path=dataset)


def write_sft_parquet(cfg: DataConfig, split: str, out: str | os.PathLike) -> tuple[int, SkipStats]:
    """Format every row of `split` and write the valid ones to `out`; (rows written, skips)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ds = raw_rows(load_split(cfg, split))
    features = sft_features()
    skips = SkipStats(split)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    written, batch = 0, []
    try:
        with pq.ParquetWriter(tmp, features.arrow_schema) as writer:
            for index in range(len(ds)):
                try:
                    batch.append(features.encode_example(format_sft_row(ds[index], cfg, index=index, split=split)))
                except RowError as e:
                    skips.add(e)
                if batch and (len(batch) == BATCH_ROWS or index == len(ds) - 1):
                    writer.write_table(pa.Table.from_pylist(batch, schema=features.arrow_schema))
                    written, batch = written + len(batch), []
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return written, skips


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlmrl.data.prepare_sft", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", required=True, help="hub name, local parquet/arrow/jsonl path, or 'synthetic'")
    parser.add_argument("--split", default="train")
    parser.add_argument("--out", required=True, help="parquet file to write")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. data.instruction='...'")
    args = parser.parse_args(argv)

    cfg = data_config(args.dataset, args.overrides)
    written, skips = write_sft_parquet(cfg, args.split, args.out)
    print(f"{args.out}: {written} rows ({args.dataset}, split {args.split}); {skips.summary()}")
    if not written:
        print(f"error: no valid row in split {args.split!r} of {args.dataset}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
