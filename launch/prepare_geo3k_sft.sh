#!/usr/bin/env bash
# Format GEO3K for SFT: writes <out_dir>/train_formatted.parquet and <out_dir>/test_formatted.parquet
# (columns problem, answer, images, messages; see vlmrl/data/sft.py).
#
#   launch/prepare_geo3k_sft.sh [out_dir] [config overrides...]
#
# out_dir defaults to data/geo3k_sft. VLMRL_DATASET_NAME picks the dataset (a hub name or a
# local parquet/arrow/jsonl path; default chenhegu/geo3k_imgurl); PYTHON the interpreter
# (default: the repository's .venv when present, else python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${1:-data/geo3k_sft}"
shift $(( $# > 0 ? 1 : 0 ))
DATASET="${VLMRL_DATASET_NAME:-chenhegu/geo3k_imgurl}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

mkdir -p "$OUT_DIR"
for split in train test; do
  "$PYTHON" -m vlmrl.data.prepare_sft --dataset "$DATASET" --split "$split" \
    --out "$OUT_DIR/${split}_formatted.parquet" "$@"
done
