"""Metric names: the keys of `metrics.jsonl`, wandb and the plots (pure, standard library).

Metric keys written by the loop (values are floats):

rollout
  rollout/raw_reward            mean verifier reward over the step's samples, before
                                advantage normalisation
  rollout/accuracy              fraction of the step's samples with reward 1 (differs from
                                raw_reward under reward.format_score)
  rollout/dropped_groups        groups lost after every retry (never scored)
  rollout/retries               requests sent again after a failure
  rollout/engine_restarts       engines restarted after their process died (and re-synced)
  rollout/stale_samples         samples whose engine weight_version is not the last synced
                                one (async mode: all; else a sync that did not land)
  rollout/prompt_mismatch_samples
                                samples left out because the engine tokenised the prompt
                                differently (image pixel bounds, chat template)
  rollout/bad_routed_experts_samples
                                samples left out because the engine's routed experts did not
                                decode to [tokens - 1, layers, top-k], or (routing replay) it
                                reported none
  rollout/reward_timeouts       verifier calls that hit reward.timeout_s (worker replaced)
  rollout/reward_retries        samples scored again after their reward worker overran or died
  rollout/reward_errors         verifier calls that raised, or failed twice (scored 0)
  data/skipped_rows             dataset rows skipped so far (data.skips, by reason in the log)
  rollout/response_len/mean     mean response length in tokens
  rollout/truncated_ratio       fraction of responses cut at the max new tokens
  (raw_reward, accuracy, response_len and truncated_ratio cover every scored group, those a
  filter dropped too: what the policy sampled)
dynamic sampling (with algo.filter_groups; vlmrl.rollout.dynamic)
  rollout/kept_groups           groups the step trains on (rollout.batch_size when it filled)
  rollout/filtered_groups       complete groups the filter dropped
  rollout/sampling_rounds       rounds of drawing prompts
  rollout/prompts_drawn         prompts drawn in the step, used or not
  rollout/surplus_groups        groups no longer needed once the step had its kept groups
  rollout/aborted_requests      their requests (and timed-out ones) stopped on the engines
  rollout/sampling_bound_hit    1 when rollout.max_rounds / max_prompts left the step short
eval (every `eval_interval` steps, one pair per eval dataset)
  eval/<dataset>                accuracy: fraction of samples the verifier accepts
  eval/<dataset>/mean_reward    mean verifier reward (differs from accuracy for
                                non-binary verifiers)
train (averaged over the step's optimizer updates)
  train/loss                    total loss that was backpropagated
  train/pg_loss                 policy-gradient (clipped surrogate) loss
  train/pg_clipfrac             fraction of tokens where the ratio clip was active
  train/entropy                 mean token entropy of the policy
  train/grad_norm               gradient norm before clipping
  train/ppo_kl                  mean (old logprob - new logprob) over response tokens;
                                old: the trainer's weights before the step's first update
  train/train_rollout_logprob_abs_diff
                                mean |logp_old - logp_rollout|: the train/rollout
                                mismatch (a growing gap has preceded collapses); engine
                                numerics, plus one update of staleness in async mode
  train/tis_mean                mean truncated importance weight min(exp(old - rollout), cap)
                                (algo.tis)
  train/kl                      the KL term (algo.kl_type, before algo.kl_coef) to the reference
                                policy (algo.kl_reference), aggregated as the loss; kl_coef > 0
  train/mis_masked_frac         share of loss tokens masked out because exp(old - rollout), per
                                token or per sequence, left [mis_low, mis_high] (algo.mis)
perf (seconds unless stated)
  perf/rollout_time             generation and reward scoring
  perf/train_time               logprob recomputation and optimizer steps
  perf/update_weights_time      weight sync trainer -> rollout engines
  perf/experience_time          the trainer's samples from a rollout, between the two stages
                                (advantages, assembly; each group's prompt encoding and routed
                                experts are read inside generation as it completes)
  perf/update_weights_<phase>_s that sync's host seconds on rank 0 by phase: gather_convert
                                (the trainer's gather to HF tensors), serialize, engines (the
                                engines' loading), barrier; perf/update_weights_buckets
  perf/step_time                the whole step, wall clock
  perf/tokens_per_gpu_per_sec   trained tokens (prompt + response) / step_time / GPUs
  perf/fwd_<kind>_s             forward time of the step's Gated DeltaNet ("gdn"), attention
                                and MoE blocks (training forwards; backward not split)
  perf/micro_batches            micro-batches of the step's optimizer updates (trainer rank 0)
  perf/pad_tokens               padding tokens in them (CP / SP per-sample padding, CUDA-graph
                                token buckets); with perf/micro_batches, what the packing costs
  perf/filler_micro_batches     micro-batches with nothing to train on, run so that every rank
                                runs as many under expert parallelism (an uneven split of the
                                step's samples over data-parallel ranks)
  perf/shared_prompt_tokens     prompt tokens the trainer did not run again: a prompt's replies
                                in one micro-batch share its one copy (trainer.share_prompts)
  perf/offload_time, perf/onload_time, perf/engine_release_time, perf/engine_resume_time,
  perf/trim_time                colocated: the memory moves between trainer and engines made
                                during the step, by kind
  perf/move_to_<phase>_time     the same moves by the phase they entered: generate (inside
                                perf/rollout_time), train (inside perf/train_time) and sync
                                (between training and perf/update_weights_time); the step's
                                split into generation, training and the rest:
                                `python -m vlmrl.bench step-phases RUN_DIR`
  perf/offload_stage_time       starting the copy out of the trainer's state before the sync
                                (trainer.offload_overlap)
  perf/onload_overlapped_copy_time, perf/onload_overlap_wait_time
                                the optimizer state's copy back during the forward and backward:
                                its length, and what the optimizer step waited for it
moe (MoE models; means over the step's optimizer updates)
  moe/imbalance/layer_<n>       largest expert load / mean expert load of layer n (1 = even)
  moe/imbalance_max, moe/imbalance_mean
  moe/dropped_frac              routed token slots dropped by a capacity limit
  moe/route_mismatch/layer_<n>  share of layer n's tokens whose top-k experts in the trainer
                                differ from the rollout engine's (before any replay; when the
                                engines report experts: rollout.return_routed_experts)
  moe/route_mismatch_mean, moe/route_mismatch_max

Eval dataset names must not contain "/" (`eval_key` replaces it with "_"): a key
`eval/<name>` with no further "/" is an accuracy, anything deeper is a sub-metric.
"""

from __future__ import annotations

import math
from typing import Any

ROLLOUT_RAW_REWARD = "rollout/raw_reward"
ROLLOUT_ACCURACY = "rollout/accuracy"
ROLLOUT_RESPONSE_LEN_MEAN = "rollout/response_len/mean"
ROLLOUT_TRUNCATED_RATIO = "rollout/truncated_ratio"

EVAL_PREFIX = "eval/"
EVAL_MEAN_REWARD_SUFFIX = "/mean_reward"

TRAIN_LOSS = "train/loss"
TRAIN_PG_LOSS = "train/pg_loss"
TRAIN_PG_CLIPFRAC = "train/pg_clipfrac"
TRAIN_ENTROPY = "train/entropy"
TRAIN_GRAD_NORM = "train/grad_norm"
TRAIN_PPO_KL = "train/ppo_kl"
TRAIN_ROLLOUT_LOGPROB_ABS_DIFF = "train/train_rollout_logprob_abs_diff"
TRAIN_TIS_MEAN = "train/tis_mean"
TRAIN_MIS_MASKED_FRAC = "train/mis_masked_frac"
TRAIN_KL = "train/kl"

PERF_ROLLOUT_TIME = "perf/rollout_time"
PERF_TRAIN_TIME = "perf/train_time"
PERF_UPDATE_WEIGHTS_TIME = "perf/update_weights_time"
PERF_STEP_TIME = "perf/step_time"
PERF_TOKENS_PER_GPU_PER_SEC = "perf/tokens_per_gpu_per_sec"
PERF_UPDATE_WEIGHTS_GB_PER_S = "perf/update_weights_gb_per_s"  # bytes sent to each engine / sync time
PERF_EXPERIENCE_TIME = "perf/experience_time"
PERF_LOGPROB_TIME = "perf/logprob_time"  # the trainer's old-policy logprob pass (part of train_time)
# the trainer's micro-batches and their padding (vlmrl.training.trainer.micro_batch_metrics)
PERF_MICRO_BATCHES = "perf/micro_batches"
PERF_PAD_TOKENS = "perf/pad_tokens"
PERF_FILLER_MICRO_BATCHES = "perf/filler_micro_batches"
PERF_SHARED_PROMPT_TOKENS = "perf/shared_prompt_tokens"
# colocated moves of device memory between trainer and engines (vlmrl.cluster.colocation)
PERF_OFFLOAD_TIME = "perf/offload_time"
PERF_ONLOAD_TIME = "perf/onload_time"
PERF_ENGINE_RELEASE_TIME = "perf/engine_release_time"
PERF_ENGINE_RESUME_TIME = "perf/engine_resume_time"
PERF_TRIM_TIME = "perf/trim_time"
# the same moves by the phase they entered (vlmrl.bench.step_phases splits a step with them)
MOVE_PHASES = ("generate", "train", "sync")


def perf_move_to(phase: str) -> str:
    return f"perf/move_to_{phase}_time"


# the copy out of the trainer's state started before the sync (trainer.offload_overlap), and
# the overlapped copy in of its optimizer state: its own length and what the optimizer step
# waited for it after the backward (vlmrl.training.offload, CUDA events of trainer rank 0)
PERF_OFFLOAD_STAGE_TIME = "perf/offload_stage_time"
PERF_ONLOAD_OVERLAPPED_COPY_TIME = "perf/onload_overlapped_copy_time"
PERF_ONLOAD_OVERLAP_WAIT_TIME = "perf/onload_overlap_wait_time"
# a checkpoint's save, logged at the step it saves (vlmrl.training.checkpoint.save_checkpoint):
# the host memory the save took on the most loaded rank, the plan's figure for it, and the
# pinned offload copy freed first where the host could not hold both
PERF_CHECKPOINT_TIME = "perf/checkpoint_time"
MEMORY_CHECKPOINT_HOST_GIB = "memory/checkpoint_host_gib"
MEMORY_CHECKPOINT_HOST_PLAN_GIB = "memory/checkpoint_host_plan_gib"
MEMORY_CHECKPOINT_HOST_COPY_DROPPED_GIB = "memory/checkpoint_host_copy_dropped_gib"
MEMORY_CHECKPOINT_HOST_KEPT_GIB = "memory/checkpoint_host_kept_gib"  # resident after the save, beyond before it

# Every fixed key (eval keys depend on the dataset names: see eval_key).
ROLLOUT_KEYS = (ROLLOUT_RAW_REWARD, ROLLOUT_ACCURACY, ROLLOUT_RESPONSE_LEN_MEAN, ROLLOUT_TRUNCATED_RATIO)
TRAIN_KEYS = (
    TRAIN_LOSS,
    TRAIN_PG_LOSS,
    TRAIN_PG_CLIPFRAC,
    TRAIN_ENTROPY,
    TRAIN_GRAD_NORM,
    TRAIN_PPO_KL,
    TRAIN_ROLLOUT_LOGPROB_ABS_DIFF,
    TRAIN_TIS_MEAN,
    TRAIN_MIS_MASKED_FRAC,
    TRAIN_KL,
)
PERF_KEYS = (
    PERF_ROLLOUT_TIME,
    PERF_TRAIN_TIME,
    PERF_UPDATE_WEIGHTS_TIME,
    PERF_STEP_TIME,
    PERF_TOKENS_PER_GPU_PER_SEC,
    PERF_UPDATE_WEIGHTS_GB_PER_S,
    PERF_LOGPROB_TIME,
    PERF_MICRO_BATCHES,
    PERF_PAD_TOKENS,
    PERF_FILLER_MICRO_BATCHES,
    PERF_OFFLOAD_TIME,
    PERF_ONLOAD_TIME,
    PERF_ENGINE_RELEASE_TIME,
    PERF_ENGINE_RESUME_TIME,
    PERF_OFFLOAD_STAGE_TIME,
    PERF_ONLOAD_OVERLAPPED_COPY_TIME,
    PERF_ONLOAD_OVERLAP_WAIT_TIME,
    PERF_CHECKPOINT_TIME,
)
RESERVED_KEYS = ("step", "time")


def sync_phase_metrics(phases: dict[str, float]) -> dict[str, float]:
    """`perf/update_weights_<phase>` for each phase a weight transport timed
    (`TrainerGroup.sync_phases`: `gather_convert_s`, ..., `buckets`)."""
    return {f"{PERF_UPDATE_WEIGHTS_TIME.removesuffix('time')}{k}": float(v) for k, v in phases.items()}


def eval_key(dataset: str) -> str:
    """`eval/<dataset>`: the eval accuracy of one dataset."""
    return EVAL_PREFIX + dataset.replace("/", "_")


def eval_mean_reward_key(dataset: str) -> str:
    """`eval/<dataset>/mean_reward`: the mean eval reward of one dataset."""
    return eval_key(dataset) + EVAL_MEAN_REWARD_SUFFIX


def is_eval_accuracy_key(key: str, prefix: str = EVAL_PREFIX) -> bool:
    """True for `eval/<name>`, False for sub-metrics such as `eval/<name>/mean_reward`."""
    return key.startswith(prefix) and len(key) > len(prefix) and "/" not in key[len(prefix) :]


def finite(value: Any) -> bool:
    """True for a real, finite number (plots and summaries skip everything else)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
