"""The RL loop. One step (`Loop.rl_step`) in stages: generate (each group scored, and kept or
dropped by dynamic sampling, as it completes) -> advantages -> experience -> train -> sync;
then an eval every `eval_interval` steps and a checkpoint every `save_interval`. `algo=sft`
(and the SFT warm-up of `algo.sft_steps` before RL) runs through the same entry.

Everything here orchestrates; the maths lives in vlmrl.algo and vlmrl.rewards, the model work
in the trainer ranks and the rollout engines, the engines' weights in vlmrl.cluster.engine_weights
and the step's metrics in vlmrl.logging.step_metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .algo.advantages import compute_advantages, keeps_group
from .cluster.colocation import Colocation
from .cluster.engine_group import EngineGroup
from .cluster.engine_weights import EngineWeights
from .cluster.phase_memory import PhaseMemory
from .cluster.placement import create_placement
from .cluster.ray_cluster import ray_cluster
from .cluster.step_profile import profiled_step
from .cluster.trainer_group import TrainerGroup
from .config import config_notes
from .config.layout import compute_layout, returns_routed_experts, scheduled_steps
from .config.memory import trainer_offload
from .config.schema import VlmrlConfig
from .data.prompts import PromptDataset
from .experience import prepare_for, rollout_metrics, rollout_prompt, sample_rows, sft_samples, train_samples
from .logging import MetricsLogger
from .logging.console import library_log, quiet_libraries
from .logging.keys import eval_key
from .logging.progress import Progress
from .logging.step_metrics import (
    StepCounts,
    StepTimes,
    checkpoint_metrics,
    eval_metrics,
    rl_step_metrics,
    sft_step_metrics,
    write_summary,
)
from .models.bridge import check_checkpoint
from .models.hf_export import save_hf_checkpoint
from .models.processor import load_processor
from .models.sglang_checkpoint import check_sglang_checkpoint
from .models.tiny import model_path
from .rewards import build_verifier
from .rewards.pool import RewardPool
from .rewards.registry import eval_verifier, verifier_params
from .rollout.dynamic import SamplingPlan, StepRollout, run_step
from .rollout.manager import RolloutManager
from .training.checkpoint import (
    CHECKPOINT_DIR,
    LoopState,
    checkpoint_dir,
    read_loop_state,
    resume_path,
    save_summary,
    write_loop_state,
)


# --------------------------------------------------------------------------- the loop
class Loop:
    def __init__(self, cfg: VlmrlConfig) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.state = LoopState()
        self._next: tuple[list[Any], StepRollout, float] | None = None  # async: the overlapped rollout
        self._data_before_next: dict[str, int] | None = None
        self.engine_group: Any = None  # vlmrl.cluster.engine_group.EngineGroup, once started
        self.model_path: str | None = None
        # the engines' weight version and syncs; colocated, who holds the GPUs' memory (.colo)
        self.weights = EngineWeights(cfg)
        self.memory = PhaseMemory(cfg)  # each phase's device-memory peak against the plan
        self.logger: MetricsLogger | None = None  # opened by `run`
        # the driver's components (`_setup`, `_start_engines`, `run`; models, engines, reward workers: processes)
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
        verifier = eval_verifier(verifier, cfg.reward.eval_target)  # correctness, not the format
        self.eval_pool = self.pool if verifier is None else RewardPool(
            verifier, num_workers=0, timeout_s=cfg.reward.timeout_s)
        self.progress = Progress(cfg.logger.progress)

    def _start_engines(self) -> None:
        cfg = self.cfg
        self.engine_group = group = EngineGroup(cfg, self.placement, self.model_path, self.run_dir)
        group.start()
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
        group = self.engine_group
        await group.restart(i, after=lambda j: self.weights.resync_restarted(j, self.trainer, group))

    # ------------------------------------------------------------ checkpoints
    def _restore(self, path: Path) -> None:
        self.weights.need_trainer()
        self.trainer.load(str(path))
        state = read_loop_state(path)
        self.state = LoopState(**state)
        self.train_data.load_state_dict(self.state.data)
        print(f"resumed from {path}: RL step {self.state.step}, SFT steps {self.state.sft_steps_done}")

    def save_checkpoint(self) -> Path:
        path = checkpoint_dir(self.run_dir / CHECKPOINT_DIR, self.state.sft_steps_done + self.state.step)
        # an overlapped rollout already drew its prompts: a resumed run draws them again
        self.state.data = self._data_before_next if self._next is not None else self.train_data.state_dict()
        self.weights.need_trainer()
        saved = self.trainer.save(str(path), {"rl_step": self.state.step})
        write_loop_state(path, dataclasses.asdict(self.state))
        print(save_summary(path.name, saved))
        if self.logger is not None:
            self.logger.log(self.state.sft_steps_done + self.state.step, checkpoint_metrics(saved))
        return path

    def _phase(self, name: str) -> None:
        self.weights.phase(name, self.trainer, self.engine_group)

    def _sync_weights(self, version: str) -> float:
        return self.weights.sync(version, self.trainer, self.engine_group)

    # ------------------------------------------------------------ phases
    def evaluate(self) -> dict[str, float]:
        self._phase("generate")
        prompts = list(self.test_data)[: self.cfg.rollout.eval.max_prompts or None]  # 0 / null: all of them
        batch = self.evaluator.run([rollout_prompt(p) for p in prompts], step=self.state.step, description="eval")
        answers = {p.index: p.answer for p in prompts}
        rewards = self.eval_pool.score([r.text for r in batch.records],
                                       [answers[r.prompt_index] for r in batch.records])
        self._log_samples(self.state.sft_steps_done + self.state.step,
                          sample_rows(batch.records, rewards, groups=self.cfg.logger.eval_samples,
                                      prompts={p.index: p for p in prompts}, kind="eval"))
        return eval_metrics(self.cfg.data.name, rewards)

    def _log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        if self.logger is not None:  # a loop driven without `run` (tests) logs nothing
            self.logger.log_samples(step, rows)

    def sft(self, steps: int) -> None:
        bs = self.cfg.algo.sft_batch_size
        while self.state.sft_steps_done < steps:
            t0 = time.perf_counter()
            samples = sft_samples(self.processor, self.train_data.sample_batch(bs))
            self._phase("train")
            self.weights.trained = True
            m = self.trainer.sft_step(samples)
            self.state.sft_steps_done += 1
            dt = time.perf_counter() - t0
            self.state.train_seconds += dt
            row = sft_step_metrics(m, dt)
            done = self.state.sft_steps_done
            if self.cfg.eval_interval and done % self.cfg.eval_interval == 0 and done < steps:
                self._sync_weights(f"sft-{done}")
                row.update(self.evaluate())
            self.logger.log(done, row, refresh_plots=eval_key(self.cfg.data.name) in row)
            self.progress.print_sft_step(done, steps, row)

    # ------------------------------------------------------------ one RL step
    def rl_step(self) -> dict[str, float]:
        """One GRPO step, stage by stage. Scoring and filtering run inside generation: each
        group is scored as it completes, and dynamic sampling (`algo.filter_groups`) draws more
        prompts while too few groups are kept."""
        t_step, _ = time.perf_counter(), self.weights.take_moves()  # moves before the step (SFT, evals) are not its own
        # generate, score, filter (async mode: generated while the previous step trained)
        (prompts, batch, t_rollout), self._next = self._next or self._rollout(self.state.step), None
        self.memory.ended("rollout", self.trainer)
        # samples from weights other than the trainer's current ones (async: all of them; a
        # sync that did not reach an engine shows here too)
        version, records = self.weights.version, batch.records
        stale = sum(r.weight_version != version for r in records) if version else 0
        pending = self._overlap_next_rollout()  # async: the next step's rollout, during training
        t_experience = time.perf_counter()
        samples, skipped = self._experience(prompts, batch, self._advantages(batch))
        t_experience = time.perf_counter() - t_experience
        train_metrics, times = self._train(samples)
        if pending is not None:  # engines finish the overlapped rollout before taking new weights
            self._next = pending.result()
        # colocated: the engines take their weights back to receive the new ones; KV cache and
        # graphs return (and the trainer leaves) when the next rollout or eval needs them
        times.sync = self._sync_weights(f"step-{self.state.step + 1}")
        self.memory.ended("sync", self.trainer)
        times.rollout, times.experience, times.step = t_rollout, t_experience, time.perf_counter() - t_step
        self.state.train_seconds += times.step  # the whole step: rollout, train, sync
        return self._step_metrics(batch, samples, skipped, stale, train_metrics, times)

    def _rollout(self, step: int) -> tuple[list[Any], StepRollout, float]:
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
                       SamplingPlan.from_config(cfg.rollout, cfg.algo.filter_groups), step=step,
                       prepare=prepare_for(self.processor, drawn, self._routing))  # samples' inputs, as groups end
        if out.bound_hit and not self._bound_noted:
            self._bound_noted = True
            print(out.bound_note(step, cfg.rollout.batch_size))
        return drawn, out, time.perf_counter() - t0

    def _overlap_next_rollout(self) -> Future | None:
        """Async mode: start the next step's rollout now, with the weights the engines have, so
        it overlaps this step's training (its samples are one step off-policy)."""
        if not (self.cfg.cluster.async_rollout and self.state.step + 1 < self.cfg.num_steps):
            return None
        self._data_before_next = self.train_data.state_dict()  # a checkpoint rewinds to here
        return self._executor.submit(self._rollout, self.state.step + 1)

    def _advantages(self, batch: StepRollout) -> list[float]:
        """Each sample's advantage within its group (`algo.advantage_estimator`)."""
        if not batch.records:
            return []
        algo = self.cfg.algo
        return compute_advantages(algo.advantage_estimator, batch.rewards, algo.n_samples_per_prompt,
                                  reward_dtype=algo.reward_dtype).tolist()

    def _experience(self, prompts: list[Any], batch: StepRollout, advantages: list[float]) -> tuple[list[Any], dict]:
        """The trainer's samples (tokens, masks, logprobs, advantages, routed experts) and the
        counts of those left out by reason; the step's sample rows go to the log."""
        by_index = {p.index: p for p in prompts}
        samples, skipped = train_samples(self.processor, by_index, batch.records, advantages, routing=self._routing,
                                         replay=self.cfg.algo.routing_replay != "none", prepared=batch.prepared)
        self._log_samples(self.state.sft_steps_done + self.state.step + 1,  # the step this one is logged at
                          sample_rows(batch.records, batch.rewards, groups=self.cfg.logger.sample_groups,
                                      advantages=advantages, prompts=by_index))
        return samples, skipped

    def _train(self, samples: list[Any]) -> tuple[list[dict[str, float]], StepTimes]:
        """The optimizer steps on `samples` (`trainer.global_batch_size` each, in a shuffled
        order), after the old policy's logprobs where the update needs them."""
        cfg, times = self.cfg, StepTimes()
        t_train = time.perf_counter()
        self._phase("train")  # colocated: the engines give their GPU memory to the trainer
        gbs = cfg.trainer.global_batch_size
        steps = max(len(samples) // gbs, 1) if samples else 0
        per = -(-len(samples) // steps) if steps else 0
        order = list(range(len(samples)))
        random.Random(cfg.seed + self.state.step).shuffle(order)
        if cfg.cluster.async_rollout or steps > 1:
            # PPO's old policy: the trainer's weights before this step's first update. In async
            # mode the samples came from the weights of one sync earlier: the engine's logprobs
            # stay the rollout's, so TIS (algo.tis) weighs old / rollout and
            # train/train_rollout_logprob_abs_diff measures that gap.
            t_logprob = time.perf_counter()
            for s, lp in zip(samples, self.trainer.logprobs(samples)):
                s.old_logprobs = lp.tolist()
            times.logprob = time.perf_counter() - t_logprob
            self.memory.ended("logprob", self.trainer)
        train_metrics = []
        for k in range(steps):
            self.weights.trained = True
            train_metrics.append(self.trainer.train_step([samples[i] for i in order[k * per:(k + 1) * per]]))
        times.train = time.perf_counter() - t_train
        self.memory.ended("train", self.trainer)
        return train_metrics, times

    def _step_metrics(self, batch: StepRollout, samples: list[Any], skipped: dict[str, int], stale: int,
                      train_metrics: list[dict[str, float]], times: StepTimes) -> dict[str, float]:
        cfg = self.cfg
        counts = StepCounts(
            dropped_groups=batch.stats.dropped_groups, retries=batch.stats.retries,
            engine_restarts=batch.stats.engine_restarts + self.weights.take_restarts(),
            stale_samples=stale, skipped=skipped, reward_timeouts=self.pool.stats.timeouts,
            reward_retries=self.pool.stats.retries, reward_errors=self.pool.stats.errors,
            data_skipped_rows=self.train_data.skips.total)
        metrics = rl_step_metrics(
            # what the policy sampled: every scored group, the ones a filter dropped too
            rollout=rollout_metrics(batch.records + batch.rejected, batch.rewards + batch.rejected_rewards),
            sampling=batch.metrics() if cfg.algo.filter_groups != "none" else None,
            train_metrics=train_metrics, tokens=sum(s.num_tokens for s in samples),
            devices=max(cfg.cluster.num_gpus, cfg.cluster.num_cpu_ranks, 1), times=times,
            sync_bytes=self.weights.last_bytes, sync_phases=self.weights.last_phases, counts=counts,
            moved=self.weights.take_moves())
        return {**metrics, **self.memory.take()}

    # ------------------------------------------------------------ driver
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        quiet_libraries(library_log(self.run_dir))  # notices to the run dir's log, not the screen
        for note in config_notes(cfg):
            print(f"note: {note}")
        self._resolve_model()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")
        total = scheduled_steps(cfg)
        resume = resume_path(cfg.resume, self.run_dir / CHECKPOINT_DIR)
        resume_step = -1
        if resume is not None:
            saved = read_loop_state(resume)
            resume_step = saved["sft_steps_done"] + saved["step"]
        key = eval_key(cfg.data.name)
        with contextlib.ExitStack() as stack:
            stack.enter_context(ray_cluster(cfg, self.run_dir))
            self.placement = create_placement(cfg, compute_layout(cfg))
            # The trainer ranks start up (processes, imports, Megatron, the model) while the
            # engines launch and the driver loads its processor, data, reward workers and
            # logger. Colocated engines start first (SGLang sizes its KV cache from the free
            # memory it finds), then give all of it back while the trainer builds its model
            # and optimizer (engines that stay, cluster.release_engines=false, keep it).
            if cfg.cluster.colocate:
                self._start_engines()
                self.weights.colo = Colocation(release=self.engine_group.release, resume=self.engine_group.resume,
                                               offload=trainer_offload(cfg), stay=not cfg.cluster.release_engines)
                self.weights.colo.to("train")
            self.trainer = TrainerGroup(cfg, self.model_path, total_steps=total, placement=self.placement,
                                        wait=False)  # returns once the ranks are requested
            if self.weights.colo is not None:
                self.weights.colo.trainer = self.trainer
            if not cfg.cluster.colocate:
                self._start_engines()
            self._setup()
            stack.enter_context(self.pool)
            self.logger = logger = stack.enter_context(MetricsLogger(
                self.run_dir, cfg.logger, dataclasses.asdict(cfg), self.run_dir.name, resume_step=resume_step))
            self.trainer.wait_ready()
            if self.weights.colo is not None:
                self.weights.colo.trainer_started()
            if resume is not None:
                self._restore(resume)
                self._sync_weights(f"resume-{resume_step}")
            elif self.weights.colo is not None and self.weights.colo.weights_stale:  # given up while it built
                self._sync_weights("init")
            if cfg.algo.name == "sft":
                self.sft(cfg.num_steps)
                self._sync_weights("sft")
                ev = self.evaluate()
                logger.log(cfg.num_steps, ev, refresh_plots=True)
                if cfg.save_final:
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
                with profiled_step(cfg.profile_steps, self.run_dir, self.state.step + 1, self.trainer):
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
            if cfg.save_final and (not cfg.save_interval or self.state.step % cfg.save_interval):
                self.save_checkpoint()
            self._executor.shutdown(wait=True)
            self.engine_group.stop()
            return self._finish(start, ev)

    def _finish(self, start: dict[str, float], end: dict[str, float]) -> dict[str, Any]:
        key, state = eval_key(self.cfg.data.name), self.state
        if self.cfg.save_hf:
            self._save_hf()
        summary = {"eval_accuracy_start": start[key], "eval_accuracy_end": end[key],
                   "train_seconds": round(state.train_seconds, 2), "rl_steps": state.step,
                   "sft_steps": state.sft_steps_done}
        if self.memory.problems:
            summary["memory_plan_problems"] = self.memory.problems
        if self.trainer is not None:  # where the trainer's start went (kernel compiles are in the checks)
            summary["trainer_start_s"] = {k: round(v, 2) for k, v in self.trainer.start_phases_s.items()}
        return write_summary(self.run_dir, summary)

    def _save_hf(self) -> None:
        self.weights.need_trainer()
        save_hf_checkpoint(self.run_dir / "hf", self.trainer.export_hf(), self.model_path, self.processor,
                           self.cfg.model.family)


def train(cfg: VlmrlConfig) -> dict[str, Any]:
    return Loop(cfg).run()
