#!/usr/bin/env bash
# The reference recipe: GRPO on GEO3K with Qwen3.5-35B-A3B, trainer and SGLang colocated.
#
#   VLMRL_NUM_GPUS=8 launch/geo3k_qwen35.sh [extra Hydra overrides...]
#
# Environment:
#   VLMRL_DATASET_NAME  dataset hub name or local path (default chenhegu/geo3k_imgurl)
#   VLMRL_NUM_GPUS      GPUs for the job (default 8)
#   VLMRL_EXTERNAL_RAY  1: join the Ray cluster at RAY_ADDRESS (started by you); 0: start one
#   WANDB_API_KEY       passed through; without it wandb logs offline
#
# The job stops only what it started: its own Ray cluster (local mode) and its own engines.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3

export VLMRL_DATASET_NAME="${VLMRL_DATASET_NAME:-chenhegu/geo3k_imgurl}"
NUM_GPUS="${VLMRL_NUM_GPUS:-8}"
EXTERNAL="${VLMRL_EXTERNAL_RAY:-0}"
[ -n "${WANDB_API_KEY:-}" ] && export WANDB_API_KEY

args=(experiment=geo3k_qwen35 "data.path=${VLMRL_DATASET_NAME}"
      "cluster.num_gpus=${NUM_GPUS}" "rollout.num_gpus=${NUM_GPUS}" "rollout.gpus_per_engine=${NUM_GPUS}")
if [ "$EXTERNAL" = "1" ]; then
  args+=(cluster=external "cluster.address=${RAY_ADDRESS:-auto}")
fi

exec "$PYTHON" -m vlmrl.train "${args[@]}" "$@"
