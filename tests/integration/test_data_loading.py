"""Datasets through HF `datasets` end to end: local files in the hub's schema, image forms,
schema errors, bad rows, and the SFT preparation command on a fixture written here."""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import datasets
import pytest
from _http import FileServer
from PIL import Image

from vlmrl.config.schema import DataConfig, SyntheticDataConfig
from vlmrl.data import (
    DatasetLoadError,
    DatasetSchemaError,
    PromptDataset,
    build_sft_example,
    load_split,
    parse_messages,
    raw_rows,
)
from vlmrl.data.images import encode_png
from vlmrl.data.prepare_sft import main as prepare_sft
from vlmrl.models.processor import load_processor

ROOT = Path(__file__).resolve().parents[2]
HUB_FEATURES = datasets.Features({
    "problem": datasets.Value("string"),
    "answer": datasets.Value("string"),
    "images": datasets.List(datasets.Image()),
})


def diagram(colour=(30, 30, 200)) -> Image.Image:
    img = Image.new("RGB", (112, 112), (250, 250, 250))
    for x in range(30, 80):
        img.putpixel((x, x), colour)
    return img


def png_claiming(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose header claims `width` x `height`."""
    data = bytearray(encode_png(Image.new("L", (1, 1))))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def hub_rows(n_good: int, *, with_bad: bool) -> list[dict]:
    rows = [{"problem": f"<image>Find x in the figure {i}.", "answer": str(i),
             "images": [{"bytes": encode_png(diagram((i * 20 % 256, 0, 0))), "path": None}]} for i in range(n_good)]
    if with_bad:
        good_image = rows[0]["images"]
        rows[1] = {**rows[1], "images": [{"bytes": b"\x89PNG broken", "path": None}]}
        rows[2] = {**rows[2], "answer": ""}
        rows[3] = {**rows[3], "images": [{"bytes": png_claiming(10_000, 10_000), "path": None}]}
        rows[4] = {**rows[4], "problem": "<image><image>Find x.", "images": good_image}
    return rows


def write_parquet(path: Path, rows: list[dict], features=HUB_FEATURES) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows, features=features).to_parquet(str(path))
    return path


def data_cfg(path, **overrides) -> DataConfig:
    base = dict(name="test", source="hf", path=str(path), min_pixels=3136, max_pixels=12544,
                max_prompt_length=256, image_cache_dir="", image_fetch_timeout_s=2.0)
    return DataConfig(**{**base, **overrides})


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    """`datasets` writes its arrow cache under the test's tmp dir, not the user's."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


@pytest.fixture(scope="module")
def geo3k_dir(tmp_path_factory) -> Path:
    """A local copy of a GEO3K-like dataset: <dir>/train.parquet (with bad rows), test.parquet."""
    root = tmp_path_factory.mktemp("geo3k")
    write_parquet(root / "train.parquet", hub_rows(10, with_bad=True))
    write_parquet(root / "test.parquet", hub_rows(4, with_bad=False))
    return root


@pytest.fixture(scope="module")
def processor(tiny_checkpoint):
    return load_processor(tiny_checkpoint, min_pixels=3136, max_pixels=12544)


# --------------------------------------------------------------------------- sources
def test_local_parquet_file_loads_through_datasets(geo3k_dir):
    ds = load_split(data_cfg(geo3k_dir / "test.parquet"), "test")
    assert isinstance(ds, datasets.Dataset)
    assert ds.features == HUB_FEATURES and ds.num_rows == 4
    row = raw_rows(ds)[0]
    assert row["images"][0]["path"] is None and row["images"][0]["bytes"].startswith(b"\x89PNG")


def test_directory_of_split_files(geo3k_dir):
    assert load_split(data_cfg(geo3k_dir), "train").num_rows == 10
    assert load_split(data_cfg(geo3k_dir), "test").num_rows == 4


def test_hub_snapshot_layout_with_sharded_files(tmp_path):
    write_parquet(tmp_path / "data" / "train-00000-of-00002.parquet", hub_rows(3, with_bad=False))
    write_parquet(tmp_path / "data" / "train-00001-of-00002.parquet", hub_rows(2, with_bad=False))
    write_parquet(tmp_path / "data" / "test-00000-of-00001.parquet", hub_rows(1, with_bad=False))
    assert load_split(data_cfg(tmp_path), "train").num_rows == 5
    assert load_split(data_cfg(tmp_path), "test").num_rows == 1


def test_save_to_disk_datasets(tmp_path):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(hub_rows(3, with_bad=False), features=HUB_FEATURES),
                               "test": datasets.Dataset.from_list(hub_rows(2, with_bad=False), features=HUB_FEATURES)})
    dd.save_to_disk(str(tmp_path / "dict"))
    dd["train"].save_to_disk(str(tmp_path / "single"))
    assert load_split(data_cfg(tmp_path / "dict"), "test").num_rows == 2
    assert load_split(data_cfg(tmp_path / "single"), "train").num_rows == 3
    with pytest.raises(DatasetLoadError, match=r"has splits \['test', 'train'\], not 'validation'"):
        load_split(data_cfg(tmp_path / "dict"), "validation")


def test_arrow_file(tmp_path):
    datasets.Dataset.from_list(hub_rows(3, with_bad=False), features=HUB_FEATURES).save_to_disk(str(tmp_path / "d"))
    (arrow,) = (tmp_path / "d").glob("*.arrow")
    assert load_split(data_cfg(arrow), "train").num_rows == 3


def test_directory_without_the_split_lists_what_it_holds(geo3k_dir):
    with pytest.raises(DatasetLoadError, match=r"no validation\.<ext>.*holds: \['test.parquet', 'train.parquet'\]"):
        load_split(data_cfg(geo3k_dir), "validation")


def test_missing_local_path_is_not_sent_to_the_hub(tmp_path):
    with pytest.raises(DatasetLoadError, match="no such file or directory"):
        load_split(data_cfg(tmp_path / "nope.parquet"), "train")


def test_hub_name_uses_load_dataset(monkeypatch):
    calls = []

    def fake_load_dataset(path, split=None):
        calls.append((path, split))
        return datasets.Dataset.from_list(hub_rows(2, with_bad=False), features=HUB_FEATURES)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_split(data_cfg("chenhegu/geo3k_imgurl"), "test").num_rows == 2
    assert calls == [("chenhegu/geo3k_imgurl", "test")]


def test_uncached_hub_dataset_offline_fails_clearly(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DatasetLoadError, match=r"cannot load split 'train' of dataset 'nobody-vlmrl/absent'.*"
                                               r"HF_DATASETS_OFFLINE=1"):
        load_split(data_cfg("nobody-vlmrl/absent"), "train")


def test_synthetic_source_maps_configured_split_names():
    cfg = data_cfg("", source="synthetic", train_split="training", test_split="eval",
                   synthetic=SyntheticDataConfig(num_train=12, num_test=6))
    assert load_split(cfg, "training").num_rows == 12 and load_split(cfg, "eval").num_rows == 6


def test_wrong_schema_names_the_column_the_file_and_the_columns(tmp_path):
    rows = [{"question": "<image>Find x.", "answer": "3", "images": []}]
    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    with pytest.raises(DatasetSchemaError) as info:
        load_split(data_cfg(path), "train")
    message = str(info.value)
    assert "'problem' (data.prompt_key)" in message and str(path) in message
    assert "available columns: ['answer', 'images', 'question']" in message


# --------------------------------------------------------------------------- rows to prompts
def test_bad_rows_of_a_parquet_split_are_skipped_and_named(geo3k_dir, processor):
    ds = PromptDataset(data_cfg(geo3k_dir), "train", processor)
    prompts = ds.sample_batch(6)
    assert sorted(p.index for p in prompts) == [0, 5, 6, 7, 8, 9]
    assert dict(ds.skips.counts) == {"unreadable_image": 1, "empty_answer": 1, "image_too_large": 1,
                                     "placeholder_mismatch": 1}
    assert ds.skips.examples == {"unreadable_image": [1], "empty_answer": [2], "image_too_large": [3],
                                 "placeholder_mismatch": [4]}
    assert all(p.images[0].size == (112, 112) for p in prompts)


def test_jsonl_with_paths_data_uris_and_urls(tmp_path, processor):
    png = encode_png(diagram())
    (tmp_path / "d.png").write_bytes(png)
    server = FileServer({"/d.png": png})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/d.png"
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    rows = [
        {"problem": "<image>Find x.", "answer": "1", "images": [str(tmp_path / "d.png")]},
        {"problem": "<image>Find x.", "answer": "2", "images": [uri]},
        {"problem": "<image>Find x.", "answer": "3", "images": [f"{server.url}/d.png"]},
        {"problem": "<image>Find x.", "answer": "4", "images": [dead]},
        {"problem": "Compare <image> with <image>.", "answer": "5", "images": [uri, f"{server.url}/d.png"]},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    try:
        ds = PromptDataset(data_cfg(path, image_cache_dir=str(tmp_path / "cache"), shuffle=False), "train", processor)
        prompts = list(ds)
    finally:
        server.close()
    assert [p.answer for p in prompts] == ["1", "2", "3", "5"]
    assert all(img.tobytes() == diagram().tobytes() for p in prompts for img in p.images)
    assert ds.skips.counts == {"image_fetch_failed": 1}
    assert ds.skips.examples["image_fetch_failed"] == [3]
    assert len(list((tmp_path / "cache").iterdir())) == 1  # one URL, fetched once, cached


# --------------------------------------------------------------------------- SFT preparation
def test_prepare_sft_cli_on_the_local_fixture(geo3k_dir, tmp_path, cache_dir, processor, capsys):
    out = tmp_path / "sft" / "train_formatted.parquet"
    assert prepare_sft(["--dataset", str(geo3k_dir), "--split", "train", "--out", str(out),
                        "data.instruction='Answer in \\boxed{}.'"]) == 0
    printed = capsys.readouterr().out
    assert "6 rows" in printed and "4 train rows skipped" in printed and "image_too_large 1 (rows 3)" in printed
    ds = datasets.load_dataset("parquet", data_files=str(out), split="train")
    assert ds.column_names == ["problem", "answer", "images", "messages"]
    assert ds.features["images"] == datasets.List(datasets.Image())
    assert ds["answer"] == ["0", "5", "6", "7", "8", "9"]
    assert isinstance(ds[0]["images"][0], Image.Image)
    chat = parse_messages(ds[1]["messages"])
    assert chat[0]["content"][-1]["text"] == "Find x in the figure 5.\nAnswer in \\boxed{}."
    assert chat[1] == {"role": "assistant", "content": [{"type": "text", "text": "Answer: \\boxed{5}"}]}
    ex = build_sft_example(processor, raw_rows(ds)[1])
    masked = [t for t, m in zip(ex["input_ids"], ex["loss_mask"]) if m]
    assert processor.tokenizer.decode(masked) == "Answer: \\boxed{5}<|im_end|>"
    assert build_sft_example(processor, ds[1])["input_ids"] == ex["input_ids"]  # decoded PIL images work too


def test_prepare_sft_cli_on_the_synthetic_task(tmp_path, cache_dir):
    out = tmp_path / "train.parquet"
    assert prepare_sft(["--dataset", "synthetic", "--out", str(out), "data.synthetic.num_train=9"]) == 0
    ds = datasets.load_dataset("parquet", data_files=str(out), split="train")
    assert ds.num_rows == 9
    assert parse_messages(ds[0]["messages"])[1]["content"][0]["text"] == f"Answer: \\boxed{{{ds[0]['answer']}}}"


def test_launch_script_writes_train_and_test(geo3k_dir, tmp_path, cache_dir):
    env = {**os.environ, "VLMRL_DATASET_NAME": str(geo3k_dir), "HF_DATASETS_CACHE": str(tmp_path / "hf"),
           "VLMRL_CACHE": cache_dir, "PYTHON": sys.executable}
    out = tmp_path / "geo3k_sft"
    subprocess.run(["bash", str(ROOT / "launch" / "prepare_geo3k_sft.sh"), str(out)], env=env, check=True,
                   capture_output=True, text=True, timeout=120)
    sizes = {split: datasets.load_dataset("parquet", data_files=str(out / f"{split}_formatted.parquet"),
                                          split="train").num_rows for split in ("train", "test")}
    assert sizes == {"train": 6, "test": 4}
