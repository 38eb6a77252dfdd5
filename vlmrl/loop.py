"""The RL loop. One rollout step, top to bottom:

    sample prompts -> rollout (n per prompt) -> rewards -> advantages -> train
    (optimizer steps per rollout as configured) -> weight sync -> eval every N steps
    -> checkpoint every M steps

`algo=sft` (and the SFT warm-up of `algo.sft_steps` before RL) runs through the same
entry: supervised steps on `Answer: \\boxed{<answer>}` targets, then a weight sync.
Everything here orchestrates; the maths lives in vlmrl.algo and vlmrl.rewards, the model
work in the trainer ranks and the rollout engines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from .algo import compute_advantages
from .algo.advantages import keeps_group
from .cluster.colocation import Colocation
from .cluster.engine_group import EngineGroup
from .cluster.placement import create_placement
from .cluster.ray_cluster import ray_cluster
from .cluster.trainer_group import TrainerGroup
from .config import config_notes
from .config.layout import compute_layout, returns_routed_experts
from .config.memory import (
    GIB,
    measured_phase_split,
    phase_estimate_split,
    phase_memory_metrics,
    trainer_offload,
)
from .config.schema import RewardConfig, VlmrlConfig
from .data.prompts import PromptDataset
from .experience import rollout_metrics, rollout_prompt, sample_rows, sft_samples, train_samples
from .logging import MetricsLogger
from .logging import keys as mk
from .logging.console import library_log, quiet_libraries
from .logging.keys import eval_key, eval_mean_reward_key
from .logging.progress import Progress
from .models import families
from .models.bridge import check_checkpoint
from .models.processor import load_processor, save_processor
from .models.sglang_checkpoint import check_sglang_checkpoint
from .models.tiny import ensure_tiny_checkpoint
from .rewards import build_verifier
from .rewards.pool import RewardPool
from .rollout.dynamic import SamplingPlan, run_step
from .rollout.manager import RolloutManager
from .training.checkpoint import checkpoint_dir, find_latest, read_loop_state, write_loop_state

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"


@dataclasses.dataclass
class LoopState:
    step: int = 0  # RL steps done (SFT: optimizer steps done)
    sft_steps_done: int = 0
    train_seconds: float = 0.0  # wall time of SFT and RL steps (rollout, train, sync); evals excluded
    eval_accuracy_start: float | None = None
    data: dict[str, int] = dataclasses.field(default_factory=dict)


def model_path(cfg: VlmrlConfig) -> str:
    """The HF checkpoint to start from (the tiny model is built on first use)."""
    if cfg.model.path:
        return cfg.model.path

    return ensure_tiny_checkpoint(cfg.model, min_pixels=cfg.data.min_pixels, max_pixels=cfg.data.max_pixels)


def observed(train_metrics: list[dict[str, float]]) -> dict[str, float]:
    """The MoE routing metrics of a step's optimizer steps (means), the forward time per mixer
    kind (the trainer's StepObserver), and its micro-batches and their padding tokens (sums)."""
    out: dict[str, float] = {}
    keys = {k for m in train_metrics for k in m if k.startswith(("moe/", "perf/"))}
    for key in sorted(keys):
        values = [m[key] for m in train_metrics if key in m]
        out[key] = sum(values) if key.startswith("perf/") else sum(values) / len(values)
    return out


def scheduled_steps(cfg: VlmrlConfig) -> int:
    """The optimizer steps the learning-rate schedule spans: `num_steps` supervised steps with
    `algo=sft` (its `sft_steps` is the warm-up of an RL run, which it does not run), else the
    SFT warm-up and then `num_steps` RL steps; with `trainer.optim.rl_lr` the warm-up alone (RL
    then starts a schedule of its own, `Loop.run`)."""
    if cfg.algo.name == "sft":
        return cfg.num_steps
    if cfg.trainer.optim.rl_lr is not None:
        return max(cfg.algo.sft_steps, 1)
    return cfg.num_steps + cfg.algo.sft_steps


def dataset_name(cfg: VlmrlConfig) -> str:
    return cfg.data.name


def verifier_params(reward: Any) -> dict[str, Any]:
    """The `reward` section as keyword arguments of its `_target_` class.

    The schema carries every verifier's parameters; a key the target does not take must
    keep its schema default (e.g. `tolerance` with the math verifier), else it is an error.
    """


    params = dataclasses.asdict(reward)
    params.pop("eval_target")  # a loop setting, not a verifier parameter
    module, _, name = reward._target_.rpartition(".")
    accepted = {f.name for f in dataclasses.fields(getattr(importlib.import_module(module), name))}
    defaults = RewardConfig()
    out = {"_target_": params.pop("_target_")}
    for key, value in params.items():
        if key in accepted:
            out[key] = value
        elif value != getattr(defaults, key):
            raise ValueError(f"reward.{key}={value!r} is not a parameter of {reward._target_}")
    return out


# --------------------------------------------------------------------------- the loop
class Loop:
    def __init__(self, cfg: VlmrlConfig) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.state = LoopState()
        self._next: tuple[list[Any], Any, float] | None = None  # async: the overlapped rollout
        self._data_before_next: dict[str, int] | None = None
        self.engine_version: str | None = None  # the weight_version last synced to the engines
        self._trained_since_sync = False
        self.engine_key: str | None = None  # the run's engine key (HTTP engines; vlmrl.rollout.auth)
        self.engine_group: Any = None  # vlmrl.cluster.engine_group.EngineGroup, once started
        self.model_path: str | None = None
        # colocated: who holds the GPUs' memory in each phase (None when nothing is shared)
        self.colo: Any = None
        self.last_sync_bytes = 0  # bytes the last weight sync sent each engine
        self.last_sync_phases: dict[str, float] = {}  # rank 0's transport phases of the last sync
        self._measured: dict[str, dict[str, float]] = {}  # this step's phase peaks (bytes: total, trainer, others)
        self.memory_problems: list[str] = []  # the first differences from the plan's estimate
        self.logger: MetricsLogger | None = None  # opened by `run`
        # the driver's components (`_setup`, `_start_engines`, `run`); the models, the engines
        # and the reward workers live in processes of their own
        self.processor: Any = None
        self.train_data: PromptDataset | None = None
        self.test_data: PromptDataset | None = None
        self.pool: RewardPool | None = None  # scores training rollouts
        self.eval_pool: RewardPool | None = None  # scores evaluations (correctness, no format rule)
        self.progress: Progress | None = None
        self.placement: Any = None  # vlmrl.cluster.placement.Placement
        self.trainer: TrainerGroup | None = None
        self.rollout: RolloutManager | None = None  # n samples a prompt
        self.evaluator: RolloutManager | None = None  # one greedy reply a prompt
        self._routing: tuple[int, int] | None = None  # (layers, top-k) of the experts engines report
        self._executor: ThreadPoolExecutor | None = None  # async: the overlapped rollout's thread
        self._bound_noted = False  # a dynamic-sampling bound was reported once

    # ------------------------------------------------------------ components
    def _resolve_model(self) -> None:
        """The checkpoint every process loads, checked against the config before any starts."""

        self.model_path = model_path(self.cfg)
        check_checkpoint(self.cfg.model, self.model_path)
        if self.cfg.rollout.name == "sglang":  # what SGLang builds from its config.json, too

            check_sglang_checkpoint(self.cfg.model, self.model_path, sglang_version=self.cfg.rollout.sglang.version)

    def _setup(self) -> None:
        """The driver's own components: processor, prompt data, reward workers."""

        cfg, d = self.cfg, self.cfg.data
        random.seed(cfg.seed)
        if self.model_path is None:
            self._resolve_model()
        self.processor = load_processor(self.model_path, min_pixels=d.min_pixels, max_pixels=d.max_pixels)
        self.train_data = PromptDataset(d, d.train_split, self.processor)
        self.test_data = PromptDataset(d, d.test_split, self.processor)
        verifier = build_verifier(verifier_params(cfg.reward))
        self.pool = RewardPool(verifier, num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s)
        # evaluations score correctness: the training reward's verifier without its format
        # requirement, or the one named
        if cfg.reward.eval_target:
            verifier = build_verifier({"_target_": cfg.reward.eval_target, "name": "eval"})
        elif verifier.format_pattern is not None:
            verifier = dataclasses.replace(verifier, format_pattern=None)
        else:
            verifier = None
        self.eval_pool = self.pool if verifier is None else RewardPool(
            verifier, num_workers=0, timeout_s=cfg.reward.timeout_s)
        self.progress = Progress(cfg.logger.progress)

    def _start_engines(self) -> None:
        cfg = self.cfg
        self.engine_group = group = EngineGroup(cfg, self.placement, self.model_path, self.run_dir)
        group.start()
        self.engine_key = group.key
        engines = group.generation
        progress = cfg.logger.progress
        restart = self._restart_engine if group.can_restart else None
        # (layers, top-k) of the experts the engines report with each sample, or None
        self._routing = ((cfg.model.lm.num_layers, cfg.model.lm.moe_router_topk)
                         if returns_routed_experts(cfg) else None)
        self.rollout = RolloutManager.from_config(engines, cfg.rollout, n_samples=cfg.algo.n_samples_per_prompt,
                                                  seed=cfg.seed, progress=progress, restart_engine=restart,
                                                  return_routed_experts=self._routing is not None)
        self.evaluator = RolloutManager.from_config(engines, cfg.rollout, n_samples=1, seed=cfg.seed,
                                                    progress=progress, eval_mode=True, restart_engine=restart)

    async def _restart_engine(self, i: int) -> None:
        await self.engine_group.restart(i, after=self._resync_restarted)

    def _resync_restarted(self, i: int) -> None:
        """Give a restarted engine the trainer's current weights, so the retried requests are
        sampled from the policy being trained."""
        group, cfg = self.engine_group, self.cfg
        if self.engine_version is None:
            return  # nothing synced yet: the checkpoint it loaded is the trainer's starting point
        version = self.engine_version + ("+" if self._trained_since_sync else "")
        bucket = max(int(cfg.rollout.weight_update_bucket_mb), 1) << 20
        targets = group.sync_targets if group.http else [group.sync_targets[i]]
        offloaded = self.colo is not None and not self.colo.now.trainer
        if offloaded:
            # the new server holds all its memory: it gives back its KV cache and graphs while
            # the trainer comes back on the GPU to send it the current weights (the other engines
            # keep theirs: with several colocated engines the onload needs room beside them)
            group.call("release_memory_occupation", ["kv_cache", "cuda_graph"], only=i)
            self.trainer.onload()
        self.trainer.sync_weights(targets, bucket_bytes=bucket, weight_version=version, reset_links=group.http,
                                  api_key=group.key)
        if offloaded:
            self.trainer.offload()
            group.call("resume_memory_occupation", ["cuda_graph", "kv_cache"], only=i)

    # ------------------------------------------------------------ checkpoints
    def _resume_from(self) -> Path | None:
        r = self.cfg.resume
        if r == "never":
            return None
        if r == "auto":
            return find_latest(self.run_dir / CHECKPOINT_DIR)
        path = Path(r)
        if not (path / "loop.json").exists():
            raise FileNotFoundError(f"resume={r}: no complete checkpoint there (no loop.json)")
        return path

    def _restore(self, path: Path) -> None:
        self._need_trainer()
        self.trainer.load(str(path))
        state = read_loop_state(path)
        self.state = LoopState(**state)
        self.train_data.load_state_dict(self.state.data)
        print(f"resumed from {path}: RL step {self.state.step}, SFT steps {self.state.sft_steps_done}")

    def save_checkpoint(self) -> Path:
        path = checkpoint_dir(self.run_dir / CHECKPOINT_DIR, self.state.sft_steps_done + self.state.step)
        # an overlapped rollout already drew its prompts: a resumed run draws them again
        self.state.data = self._data_before_next if self._next is not None else self.train_data.state_dict()
        self._need_trainer()
        saved = self.trainer.save(str(path), {"rl_step": self.state.step})
        write_loop_state(path, dataclasses.asdict(self.state))
        taken = saved["host_rss_peak_bytes"] - saved["host_rss_before_bytes"]
        dropped = saved["host_copy_dropped_bytes"]
        print(f"checkpoint {path.name}: {saved['seconds']:.1f} s; host memory taken by the save {taken / GIB:.1f} GiB "
              f"(plan {saved['host_need_bytes'] / GIB:.1f}; {saved['host_available_bytes'] / GIB:.1f} available)"
              + (f"; pinned offload copy of {dropped / GIB:.1f} GiB freed first" if dropped else ""))
        if self.logger is not None:
            self.logger.log(self.state.sft_steps_done + self.state.step, {
                mk.PERF_CHECKPOINT_TIME: saved["seconds"], mk.MEMORY_CHECKPOINT_HOST_GIB: taken / GIB,
                mk.MEMORY_CHECKPOINT_HOST_PLAN_GIB: saved["host_need_bytes"] / GIB,
                mk.MEMORY_CHECKPOINT_HOST_COPY_DROPPED_GIB: dropped / GIB})
        return path

    def _stop_engines(self) -> None:
        if self.engine_group is not None:
            self.engine_group.stop()

    # ------------------------------------------------------------ colocation
    def _phase_memory(self, phase: str) -> None:
        """On GPUs: the peak device memory of the phase that just ended on the most loaded
        trainer GPU (every process on it, the colocated engine too), kept for the step's
        metrics and compared with the plan's estimate (`vlmrl.config.memory`)."""
        if self.cfg.hardware.device != "cuda":
            return

        self._measured[phase] = max((measured_phase_split(m) for m in self.trainer.memory_stats()),
                                    key=lambda m: m["total"])

    def _check_phase_memory(self) -> dict[str, float]:
        """The step's measured phase peaks (GiB) beside the plan's, and the plan's problems
        (printed the first time they appear, kept for summary.json)."""

        measured, self._measured = self._measured, {}
        if not measured:
            return {}
        plan = phase_estimate_split(self.cfg)
        out, problems = phase_memory_metrics(plan, measured)
        if problems and not self.memory_problems:
            split = "; ".join(f"{k}: trainer {m['trainer'] / GIB:.1f} GiB (plan {plan[k]['trainer'] / GIB:.1f}), "
                              f"others {m['others'] / GIB:.1f} GiB (plan {plan[k]['others'] / GIB:.1f})"
                              for k, m in measured.items() if k in plan)
            print("note: measured memory differs from the plan (python -m vlmrl.plan) by more than 10%: "
                  + "; ".join(problems) + f" [{split}]")
        self.memory_problems = self.memory_problems or problems
        return out

    def _phase(self, name: str) -> None:
        """Colocated: move device memory to phase `name` (see vlmrl.cluster.colocation). Before
        generating, engines that came back from a restart in a memory move get the trainer's
        weights."""
        if self.colo is not None:
            if name == "generate" and self.colo.weights_stale and self.engine_version is not None:
                self._sync_weights(self.engine_version + "+", reset_links=self.engine_group.http)
            self.colo.to(name)

    def _need_trainer(self) -> None:
        """The trainer's state on the GPU (checkpoints, exports), unless it is there already: as
        for a sync, so the engines keep their weights (released ones would need a sync again)."""
        if self.colo is not None and not self.colo.now.trainer:
            self.colo.to("sync")

    def _sync_weights(self, version: str, *, reset_links: bool = False) -> float:
        """The trainer's weights to every engine (`reset_links`: an engine behind a URL was
        restarted, so the transport's links to it are new)."""
        self._phase("sync")
        t0 = time.perf_counter()
        bucket = max(int(self.cfg.rollout.weight_update_bucket_mb), 1) << 20
        self.last_sync_bytes = int(self.trainer.sync_weights(self.engine_group.sync_targets, bucket_bytes=bucket,
                                                             weight_version=version, reset_links=reset_links,
                                                             api_key=self.engine_key) or 0)
        seconds = time.perf_counter() - t0
        self.last_sync_phases = self.trainer.sync_phases()  # read after the clock: not part of the sync
        self.engine_version = version  # every sample generated from now on should report it
        self._trained_since_sync = False
        if self.colo is not None:
            self.colo.synced()
        return seconds

    # ------------------------------------------------------------ phases
    def evaluate(self) -> dict[str, float]:
        self._phase("generate")
        prompts = list(self.test_data)
        if self.cfg.rollout.eval.max_prompts:
            prompts = prompts[: self.cfg.rollout.eval.max_prompts]
        batch = self.evaluator.run([rollout_prompt(p) for p in prompts], step=self.state.step, description="eval")
        answers = {p.index: p.answer for p in prompts}
        rewards = self.eval_pool.score([r.text for r in batch.records],
                                       [answers[r.prompt_index] for r in batch.records])
        self._log_samples(self.state.sft_steps_done + self.state.step,
                          sample_rows(batch.records, rewards, groups=self.cfg.logger.eval_samples,
                                      prompts={p.index: p for p in prompts}, kind="eval"))
        n = max(len(rewards), 1)
        acc = sum(1.0 for r in rewards if r >= 1.0) / n
        name = dataset_name(self.cfg)
        return {eval_key(name): acc, eval_mean_reward_key(name): sum(rewards) / n}

    def _log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        if self.logger is not None:  # a loop driven without `run` (tests) logs nothing
            self.logger.log_samples(step, rows)

    def sft(self, steps: int) -> None:
        bs = self.cfg.algo.sft_batch_size
        while self.state.sft_steps_done < steps:
            t0 = time.perf_counter()
            samples = sft_samples(self.processor, self.train_data.sample_batch(bs))
            self._phase("train")
            self._trained_since_sync = True
            m = self.trainer.sft_step(samples)
            self.state.sft_steps_done += 1
            dt = time.perf_counter() - t0
            self.state.train_seconds += dt
            row = {"sft/loss": m["loss"], mk.TRAIN_GRAD_NORM: m["grad_norm"], mk.PERF_TRAIN_TIME: dt,
                   **observed([m])}
            done = self.state.sft_steps_done
            if self.cfg.eval_interval and done % self.cfg.eval_interval == 0 and done < steps:
                self._sync_weights(f"sft-{done}")
                row.update(self.evaluate())
            self.logger.log(done, row, refresh_plots=mk.eval_key(dataset_name(self.cfg)) in row)
            self.progress.print_sft_step(done, steps, row)

    def _rollout(self, step: int) -> tuple[list[Any], Any, float]:
        """Draw the step's prompts, generate and score their groups, keep the ones
        `algo.filter_groups` keeps and draw more while too few are (`vlmrl.rollout.dynamic`; a
        worker thread runs this while the trainer trains in async mode)."""
        t0 = time.perf_counter()
        self._phase("generate")
        cfg, drawn = self.cfg, []

        def draw(n: int) -> list[Any]:
            batch = self.train_data.sample_batch(n)
            drawn.extend(batch)
            return [rollout_prompt(p) for p in batch]

        def score(records: list[Any]) -> list[float]:
            return self.pool.score([r.text for r in records], [r.answer for r in records])

        out = run_step(self.rollout, draw, score, lambda rewards: keeps_group(rewards, cfg.algo.filter_groups),
                       SamplingPlan.from_config(cfg.rollout, cfg.algo.filter_groups), step=step)
        if out.bound_hit and not self._bound_noted:
            self._bound_noted = True
            print(f"note: step {step + 1} kept {out.kept_groups} of rollout.batch_size={cfg.rollout.batch_size} "
                  f"groups after {out.rounds} round(s) and {len(out.prompts)} prompts (rollout.max_rounds / "
                  "max_prompts): it trains on those (rollout/sampling_bound_hit counts such steps)")
        return drawn, out, time.perf_counter() - t0

    def rl_step(self) -> dict[str, float]:
        cfg, state = self.cfg, self.state
        n = cfg.algo.n_samples_per_prompt
        t_step = time.perf_counter()
        if self._next is not None:  # async: generated while the previous step trained
            prompts, batch, t_rollout = self._next
            self._next = None
        else:
            prompts, batch, t_rollout = self._rollout(state.step)
        self._phase_memory("rollout")
        pending = None
        if cfg.cluster.async_rollout and state.step + 1 < cfg.num_steps:
            # the next rollout overlaps this step's training, with the weights the engines
            # have now: its samples are one step off-policy
            self._data_before_next = self.train_data.state_dict()
            pending = self._executor.submit(self._rollout, state.step + 1)
        # samples from weights other than the trainer's current ones (async: all of them; a
        # sync that did not reach an engine shows here too)
        stale = sum(r.weight_version != self.engine_version for r in batch.records) if self.engine_version else 0
        by_index = {p.index: p for p in prompts}
        records, rewards = batch.records, batch.rewards  # kept groups, scored as they completed
        advantages = compute_advantages(cfg.algo.advantage_estimator, rewards, n,
                                        reward_dtype=cfg.algo.reward_dtype).tolist() if records else []
        samples, skipped = train_samples(self.processor, by_index, records, advantages, routing=self._routing,
                                         replay=cfg.algo.routing_replay != "none")
        self._log_samples(state.sft_steps_done + state.step + 1,  # the step this one is logged at
                          sample_rows(records, rewards, groups=cfg.logger.sample_groups, advantages=advantages,
                                      prompts=by_index))

        t_train = time.perf_counter()
        self._phase("train")  # colocated: the engines give their GPU memory to the trainer
        gbs = cfg.trainer.global_batch_size
        steps = max(len(samples) // gbs, 1) if samples else 0
        per = -(-len(samples) // steps) if steps else 0
        order = list(range(len(samples)))
        random.Random(cfg.seed + state.step).shuffle(order)
        t_logprob = time.perf_counter()
        if cfg.cluster.async_rollout or steps > 1:
            # PPO's old policy: the trainer's weights before this step's first update. In async
            # mode the samples came from the weights of one sync earlier: the engine's logprobs
            # stay the rollout's, so TIS (algo.tis) weighs old / rollout and
            # train/train_rollout_logprob_abs_diff measures that gap.
            for s, lp in zip(samples, self.trainer.logprobs(samples)):
                s.old_logprobs = lp.tolist()
        logprob_time = time.perf_counter() - t_logprob
        if cfg.cluster.async_rollout or steps > 1:
            self._phase_memory("logprob")
        train_metrics: list[dict[str, float]] = []
        for k in range(steps):
            chunk = [samples[i] for i in order[k * per:(k + 1) * per]]
            self._trained_since_sync = True
            train_metrics.append(self.trainer.train_step(chunk))
        train_time = time.perf_counter() - t_train
        self._phase_memory("train")
        if pending is not None:  # engines finish the overlapped rollout before taking new weights
            self._next = pending.result()
        # colocated: the engines take their weights back to receive the new ones; KV cache and
        # graphs return (and the trainer leaves) when the next rollout or eval needs them
        sync_time = self._sync_weights(f"step-{state.step + 1}")
        self._phase_memory("sync")
        state.train_seconds += time.perf_counter() - t_step  # the whole step: rollout, train, sync

        # what the policy sampled: every scored group, the ones a filter dropped too
        metrics = rollout_metrics(records + batch.rejected, rewards + batch.rejected_rewards)
        if cfg.algo.filter_groups != "none":
            metrics.update(batch.metrics())
        last = train_metrics[-1] if train_metrics else {}
        for key in ("loss", "pg_loss", "pg_clipfrac", "entropy", "grad_norm", "ppo_kl", "kl", "tis_mean",
                    "mis_masked_frac", "train_rollout_logprob_abs_diff"):
            if key in last:
                metrics[f"train/{key}"] = sum(m[key] for m in train_metrics) / len(train_metrics)
        metrics.update(observed(train_metrics))
        tokens = sum(s.num_tokens for s in samples)
        step_time = time.perf_counter() - t_step
        devices = max(cfg.cluster.num_gpus, cfg.cluster.num_cpu_ranks, 1)
        metrics.update({
            mk.PERF_ROLLOUT_TIME: t_rollout, mk.PERF_TRAIN_TIME: train_time, mk.PERF_UPDATE_WEIGHTS_TIME: sync_time,
            mk.PERF_STEP_TIME: step_time, mk.PERF_TOKENS_PER_GPU_PER_SEC: tokens / max(step_time, 1e-9) / devices,
            mk.PERF_LOGPROB_TIME: logprob_time,
            mk.PERF_UPDATE_WEIGHTS_GB_PER_S: self.last_sync_bytes / max(sync_time, 1e-9) / 1e9,
            **mk.sync_phase_metrics(self.last_sync_phases),
            "rollout/dropped_groups": batch.stats.dropped_groups,
            "rollout/retries": batch.stats.retries,
            "rollout/engine_restarts": batch.stats.engine_restarts + (self.colo.take_restarts() if self.colo else 0),
            "rollout/stale_samples": stale,
            "rollout/prompt_mismatch_samples": skipped["prompt_mismatch"],
            "rollout/bad_routed_experts_samples": skipped["bad_routed_experts"] + skipped["no_routed_experts"],
            "rollout/reward_timeouts": self.pool.stats.timeouts,
            "rollout/reward_retries": self.pool.stats.retries,
            "rollout/reward_errors": self.pool.stats.errors,
            "data/skipped_rows": self.train_data.skips.total,
        })
        metrics.update(self._check_phase_memory())
        if self.colo is not None:  # this step's moves of device memory (the next rollout's included)
            moved = self.colo.take_seconds()
            metrics.update({mk.PERF_OFFLOAD_TIME: moved.get("offload", 0.0),
                            mk.PERF_ONLOAD_TIME: moved.get("onload", 0.0),
                            mk.PERF_ENGINE_RELEASE_TIME: moved.get("release", 0.0),
                            mk.PERF_ENGINE_RESUME_TIME: moved.get("resume", 0.0)})
        return metrics

    # ------------------------------------------------------------ driver
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        quiet_libraries(library_log(self.run_dir))  # notices to the run dir's log, not the screen
        for note in config_notes(cfg):
            print(f"note: {note}")
        self._resolve_model()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")
        total = scheduled_steps(cfg)
        resume = self._resume_from()
        resume_step = -1
        if resume is not None:

            saved = read_loop_state(resume)
            resume_step = saved["sft_steps_done"] + saved["step"]
        key = f"eval/{dataset_name(cfg)}"
        with contextlib.ExitStack() as stack:
            stack.enter_context(ray_cluster(cfg, self.run_dir))
            self.placement = create_placement(cfg, compute_layout(cfg))
            # The trainer ranks start up (processes, imports, Megatron, the model) while the
            # engines launch and the driver loads its processor, data, reward workers and
            # logger. Colocated engines start first (SGLang sizes its KV cache from the free
            # memory it finds), then give all of it back while the trainer builds its model
            # and optimizer.
            if cfg.cluster.colocate:
                self._start_engines()

                self.colo = Colocation(release=self.engine_group.release, resume=self.engine_group.resume,
                                       offload=trainer_offload(cfg))
                self.colo.to("train")
            self.trainer = TrainerGroup(cfg, self.model_path, total_steps=total, placement=self.placement,
                                        wait=False)  # returns once the ranks are requested
            if self.colo is not None:
                self.colo.trainer = self.trainer
            if not cfg.cluster.colocate:
                self._start_engines()
            self._setup()
            stack.enter_context(self.pool)
            self.logger = logger = stack.enter_context(MetricsLogger(
                self.run_dir, cfg.logger, dataclasses.asdict(cfg), self.run_dir.name, resume_step=resume_step))
            self.trainer.wait_ready()
            if self.colo is not None:
                self.colo.trainer_started()
            if resume is not None:
                self._restore(resume)
                self._sync_weights(f"resume-{resume_step}")
            elif self.colo is not None:  # the engines gave their weights up while the trainer built
                self._sync_weights("init")
            if cfg.algo.name == "sft":
                self.sft(cfg.num_steps)
                self._sync_weights("sft")
                ev = self.evaluate()
                logger.log(cfg.num_steps, ev, refresh_plots=True)
                self.save_checkpoint()
                return self._finish(ev, ev)
            if self.state.sft_steps_done < cfg.algo.sft_steps:
                self.sft(cfg.algo.sft_steps)
                if cfg.algo.uses_reference and cfg.algo.kl_reference == "warmup":
                    self.trainer.set_reference_to_policy()  # checkpoints keep it from here on
                    print("KL reference: the policy after the SFT warm-up")
                self._sync_weights("sft-warmup")
            if cfg.trainer.optim.rl_lr is not None and self.state.step == 0:
                # RL's own schedule; a run resumed within RL restored it from its checkpoint
                lr = self.trainer.start_rl_schedule(cfg.num_steps)
                print(f"RL learning rate: {lr:.3g} ({cfg.trainer.optim.lr_decay_style} over {cfg.num_steps} steps)")
            offset = self.state.sft_steps_done  # logged step = SFT warm-up steps + RL steps
            if self.state.eval_accuracy_start is None:
                start = self.evaluate()
                self.state.eval_accuracy_start = start[key]
                logger.log(offset, start, refresh_plots=True)
            start = {key: self.state.eval_accuracy_start}
            ev = start
            while self.state.step < cfg.num_steps:
                if cfg.max_train_seconds and self.state.train_seconds >= cfg.max_train_seconds:
                    print(f"stopping: training time {self.state.train_seconds:.0f}s reached max_train_seconds")
                    break
                metrics = self.rl_step()
                self.state.step += 1
                if cfg.eval_interval and self.state.step % cfg.eval_interval == 0:
                    ev = self.evaluate()
                    metrics.update(ev)
                metrics["rl_step"] = self.state.step
                logger.log(offset + self.state.step, metrics,
                           refresh_plots=bool(cfg.eval_interval and self.state.step % cfg.eval_interval == 0))
                self.progress.print_step_summary(self.state.step, metrics)
                if cfg.save_interval and self.state.step % cfg.save_interval == 0:
                    self.save_checkpoint()
            if not cfg.eval_interval or self.state.step % cfg.eval_interval:
                ev = self.evaluate()
                logger.log(offset + self.state.step, ev, refresh_plots=True)
            if not cfg.save_interval or self.state.step % cfg.save_interval:
                self.save_checkpoint()
            self._executor.shutdown(wait=True)
            self._stop_engines()
            return self._finish(start, ev)

    def _finish(self, start: dict[str, float], end: dict[str, float]) -> dict[str, Any]:
        key = f"eval/{dataset_name(self.cfg)}"
        if self.cfg.save_hf:
            self._save_hf()
        summary = {
            "eval_accuracy_start": start[key],
            "eval_accuracy_end": end[key],
            "train_seconds": round(self.state.train_seconds, 2),
            "rl_steps": self.state.step,
            "sft_steps": self.state.sft_steps_done,
            "run_dir": str(self.run_dir),
            "plots": str(self.run_dir / "plots"),
        }
        if self.memory_problems:
            summary["memory_plan_problems"] = self.memory_problems
        if self.trainer is not None:  # where the trainer's start went (kernel compiles are in the checks)
            summary["trainer_start_s"] = {k: round(v, 2) for k, v in self.trainer.start_phases_s.items()}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"run dir: {self.run_dir}\nplots: {self.run_dir / 'plots'}\n"
              f"eval accuracy {summary['eval_accuracy_start']:.3f} -> {summary['eval_accuracy_end']:.3f} "
              f"in {summary['train_seconds']:.0f}s of training")
        return summary

    def _save_hf(self) -> None:
        out = self.run_dir / "hf"
        out.mkdir(parents=True, exist_ok=True)
        self._need_trainer()
        state = {k: v.contiguous() for k, v in self.trainer.export_hf().items()}
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

        for name in ("config.json", "generation_config.json"):
            src = Path(self.model_path) / name
            if src.exists():
                shutil.copy(src, out / name)
        save_processor(self.processor, out, families.get(self.cfg.model.family).PROCESSOR_CLASS)


def train(cfg: VlmrlConfig) -> dict[str, Any]:
    return Loop(cfg).run()
