"""The Megatron trainer of one rank: model, optimizer, RL and SFT steps, weight export.

Every trainer rank builds its share of the model (`vlmrl.models.bridge`), loads the HF
checkpoint through the adapters, wraps the chunks in Megatron's DDP and optimizer, and
runs Megatron's forward/backward schedules over packed micro-batches. Losses come from
`vlmrl.algo.losses` (pure functions); the per-token normaliser of the whole global batch is
applied by Megatron (`calculate_per_token_loss`), so gradient accumulation over
micro-batches and data parallelism reproduce the full-batch loss exactly.

With `trainer.offload` (colocated on GPUs), the weights, DDP buffers and optimizer state
live in torch_memory_saver regions (`vlmrl.training.offload`): `offload()` frees their device
memory while the engines generate and `onload()` brings it back at the same addresses.
`memory_stats()` reports the rank's device memory for the run to compare with the plan.

The same code runs on CPU ranks over gloo and on GPUs over NCCL.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

from ..algo import losses
from ..config.layout import shares_prompts
from ..config.schema import VlmrlConfig
from ..models.kernels import begin_graph_step
from .batch import (
    MicroBatch,
    TrainSample,
    build_micro_batch,
    even_micro_batches,
    micro_batches,
    shared_prompt_keys,
)
from .logprobs import logprobs_and_entropy

# Metrics that are sums over tokens / sequences (normalised by the global normaliser) and
# metrics that are means over masked tokens (weighted by the micro-batch's token count).
_SUMMED = ("loss", "pg_loss", "kl", "entropy")
_MEANS = ("pg_clipfrac", "ppo_kl", "tis_mean", "mis_masked_frac", "train_rollout_logprob_abs_diff")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _detached(v: Any) -> Any:
    return v.detach() if isinstance(v, Tensor) else v


def cuda_graphs_in_training(cfg: VlmrlConfig) -> bool:
    """Whether this run's trainer replays its compiled layers as CUDA graphs
    (`hardware.cuda_graphs`; `vlmrl.config.memory.training_cuda_graphs` says where the layout
    rules them out, and this prints why)."""
    from ..config.memory import training_cuda_graphs

    on, why = training_cuda_graphs(cfg)
    if why:
        print(f"hardware.cuda_graphs: off in this run, {why}; the compiled layers run without CUDA graphs", flush=True)
    return on


def use_fused_adam(optimizer: Any) -> int:
    """Run torch's Adam(W) under megatron's optimizer as torch's fused kernel; returns the
    number of torch optimizers switched.

    Without TransformerEngine or apex, megatron builds `torch.optim.AdamW` with torch's
    default foreach implementation: six or so passes over the float32 parameters and
    moments (66 ms a step for the 3.4B-parameter scaled Qwen3.5-MoE on an H200). The fused
    implementation is one pass per tensor group with the same update rule. It keeps its
    step counters on the parameters' device: counters that a checkpoint loaded onto the
    host move there too (call this again after loading)."""
    switched = 0
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in [*inner.param_groups, inner.defaults]:
            group["foreach"], group["fused"] = False, True
        for param, state in inner.state.items():
            step = state.get("step")
            if torch.is_tensor(step) and step.device != param.device:
                state["step"] = step.to(device=param.device, dtype=torch.float32)
        switched += 1
    return switched


def fix_param_group_index_map(optimizer: Any) -> int:
    """Point megatron-core's DistributedOptimizer at the right main parameter of every model
    parameter; returns the number of parameters whose entry changed.

    megatron-core 0.16 records each parameter's place in its optimizer group in the order the
    gradient buffer holds them (`model_param_group_index_map`), then builds the group as all
    float32 parameters first and the float32 copies of the 16-bit ones after them. Where a
    group mixes the two, as a bf16 Qwen3.5 keeps its Gated DeltaNet decays and gated norm in
    float32, the recorded places name other parameters. Training does not read them, but
    saving and loading the optimizer state does: a checkpoint failed with "The size of tensor
    a (256) must match the size of tensor b (32)" on an H200. The places are rebuilt here
    from the groups as the optimizer holds them."""
    changed = 0
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        index = getattr(chained, "model_param_group_index_map", None)
        fp32_groups = getattr(chained, "model_fp32_groups", None)
        half_groups = getattr(chained, "model_float16_groups", None)
        if index is None or fp32_groups is None or half_groups is None:
            continue
        for g, (fp32, half) in enumerate(zip(fp32_groups, half_groups)):
            for order, param in enumerate([*fp32, *half]):
                if index.get(param) != (g, order):
                    index[param] = (g, order)
                    changed += 1
    return changed


def fix_torch_adam_state_load(optimizer: Any) -> int:
    """Let megatron-core's DistributedOptimizer load its reshardable parameter state into torch's
    Adam; returns the number of optimizers patched.

    Without TransformerEngine or apex, megatron-core 0.16 runs torch's Adam, which keeps a
    "step" counter beside each parameter's moments. `load_state_dict` sets that counter from
    the saved param groups, then copies the saved moments and main parameters in with
    `_set_main_param_and_optimizer_states`, which copies every key the live state has and so
    asks the saved tensors for a "step" they never carry (`KeyError: 'step'` on the first
    resume on an H200). The setter here copies the saved tensors and leaves the counter as
    `load_state_dict` set it. The dp_reshardable format does hand it a "step", but megatron-core
    saves that one as a non-persistent object: what comes back is the counter the load read from
    the fresh optimizer (0), and copying it reset every loaded Adam counter to 0 (H100,
    2026-12-06: the next step's bias correction was that of a first step). It is dropped too.
    It copies without autograd: the dp_reshardable format's load calls the setter outside
    `torch.no_grad()`, and copying into a main parameter (a leaf that requires
    grad) raised "a view of a leaf Variable that requires grad is being used in an in-place
    operation" (H100, 2026-12-06). Applied to each DistributedOptimizer instance; megatron's own
    files stay as they are."""
    patched = 0
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        setter = getattr(chained, "_set_main_param_and_optimizer_states", None)
        if setter is None or getattr(setter, "vlmrl_keeps_step", False):
            continue

        @torch.no_grad()  # dp_reshardable's load copies into the main parameters (leaves that require grad)
        def set_states(model_param: Any, tensors: dict[str, Any], _setter: Any = setter, _opt: Any = chained) -> None:
            config = getattr(_opt, "config", None)
            if getattr(config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
                return _setter(model_param, tensors)
            # dp_reshardable's tensors carry a "step" that is not the saved count: a non-persistent
            # object, the live counter the load's template read (0 after init_optimizer_state); the
            # saved count came in through the param groups
            tensors = {k: v for k, v in tensors.items() if k != "step"}
            group_index, group_order = _opt.model_param_group_index_map[model_param]
            state = _opt.optimizer.state[_opt.optimizer.param_groups[group_index]["params"][group_order]]
            step = state.pop("step", None)
            try:
                return _setter(model_param, tensors)
            finally:
                if step is not None:
                    state["step"] = step

        set_states.vlmrl_keeps_step = True  # type: ignore[attr-defined]
        chained._set_main_param_and_optimizer_states = set_states
        patched += 1
    return patched


def _laps(into: dict[str, float]) -> Any:
    """`lap(name)`: store the host seconds since the previous lap (or this call) under `name`."""
    last = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        into[name] = now - last[0]
        last[0] = now

    return lap


def micro_batch_metrics(mbs: Sequence[MicroBatch]) -> dict[str, float]:
    """What one update's micro-batches cost beyond their tokens: how many ran (each is a
    forward, a backward and a gradient accumulation), the padding tokens they carried
    (per-sample padding for CP / SP, the CUDA-graph token buckets, fillers' tokens), whole
    micro-batches, and how many were fillers (`even_micro_batches`)."""
    pad = sum(mb.whole.num_tokens - (0 if mb.filler else sum(mb.whole.seq_lens)) for mb in mbs)
    return {"perf/micro_batches": float(len(mbs)), "perf/pad_tokens": float(pad),
            "perf/filler_micro_batches": float(sum(mb.filler for mb in mbs)),
            "perf/shared_prompt_tokens": float(sum(mb.shared_prompt_tokens for mb in mbs))}


def _filler_loss(mb: MicroBatch, logits: Tensor) -> tuple[Tensor, Tensor, dict]:
    """A filler micro-batch's loss: zero, counted as no tokens, with the whole graph behind it,
    so that its backward runs every layer's collectives as the other ranks' do."""
    return logits.float().sum() * 0.0, torch.zeros((), dtype=torch.int, device=logits.device), {}


class MegatronTrainer:
    """Needs torch.distributed's default group (RANK/WORLD_SIZE/MASTER_* rendezvous)."""

    def __init__(self, cfg: VlmrlConfig, model_path: str, *, total_steps: int | None = None) -> None:
        # host seconds of each part of the start (a fresh machine compiles kernels in the checks)
        self.init_phases_s: dict[str, float] = {}
        lap = _laps(self.init_phases_s)
        from megatron.core import parallel_state as mps

        from ..models import adapters
        from ..models.bridge import build_model
        from .parallel_state import init_parallel_state

        self.cfg = cfg
        self.model_cfg = cfg.model
        lap("imports")
        self.info = init_parallel_state(cfg.parallel, backend=cfg.hardware.dist_backend, seed=cfg.seed)
        lap("parallel_state")
        self.dtype = DTYPES[cfg.hardware.train_dtype]
        self.cuda_graphs = cuda_graphs_in_training(cfg)
        self.share_prompts = shares_prompts(cfg)  # a prompt's replies in a micro-batch run it once
        from ..models import routing

        overrides = {"calculate_per_token_loss": True,
                     **routing.megatron_overrides(cfg.model, precision=cfg.trainer.moe_router_precision,
                                                  replay=cfg.algo.routing_replay != "none"),
                     **dict(cfg.trainer.megatron)}
        build = partial(build_model, cfg.model, cfg.parallel, params_dtype=self.dtype,
                        attention_backend=cfg.hardware.lm_attention_backend,
                        vision_attn_implementation=cfg.hardware.vision_attn_implementation,
                        fused_kernels=cfg.hardware.fused_kernels, gdn_backend=cfg.hardware.gdn_backend,
                        moe_aux_loss_coeff=cfg.trainer.moe_aux_loss_coeff, megatron_overrides=overrides)
        chunks = build(cuda_graphs=self.cuda_graphs)
        for c in chunks:  # the engine's experts replace the router's own (algo.routing_replay)
            routing.configure(c, replay=cfg.algo.routing_replay != "none")
        lap("build")
        self._check_gdn_fast_path()
        lap("check_gdn")
        self._check_attention_backend()
        lap("check_attention")
        adapters.load_hf_weights(chunks, cfg.model, model_path)
        from .offload import release_host_memory

        release_host_memory()  # the checkpoint's tensors were read through host memory
        lap("load_weights")
        self.ref_chunks = None
        # what the reference model holds: "initial" (the start checkpoint) or "warmup" (the
        # policy at the end of the SFT warm-up, `set_reference_to_policy`); checkpoints keep it
        self.reference = "initial"
        if cfg.algo.uses_reference:
            self.ref_chunks = build()
            adapters.load_hf_weights(self.ref_chunks, cfg.model, model_path)
            for c in self.ref_chunks:
                c.eval().requires_grad_(False)
            lap("reference")

        self.model = self._wrap_ddp(chunks)
        lap("ddp")
        # trainer.offload: weights and DDP buffers go into torch_memory_saver's regions now,
        # before the optimizer's state exists (the placement copies one storage at a time)
        self._offload = self._offload_regions()
        if self._offload is not None:
            self._offload.adopt()
            lap("offload_regions")
        # Megatron's schedules call this after the last micro-batch: the DP gradient
        # all-reduce, the sequence-parallel norm and tied-embedding reductions, (with
        # calculate_per_token_loss) the division by the global token count, and the TP sums
        # of vlmrl's head-shared parameters (the Gated DeltaNet norm).
        from ..models.grads import finalize_model_grads

        for c in chunks:
            c.config.finalize_model_grads_func = finalize_model_grads
        self.optimizer = self._optimizer()
        lap("optimizer")
        if self._offload is not None:
            # the optimizer's state exists from the start, in the region (torch makes it at
            # the first step otherwise), and no storage moves from here on
            from .offload import init_optimizer_state

            init_optimizer_state(self.optimizer)
            self._offload.adopt()
            self._offload.finish_build()
            # the pinned host copy, allocated now rather than in the first offload
            self.offload_host_copy_s = self._offload.allocate_host_copy()
            lap("offload_setup")
        self.scheduler = self._scheduler(total_steps or cfg.num_steps)
        from .observe import StepObserver

        # MoE routing (load imbalance, dropped tokens) and forward time per mixer kind
        self.observer = StepObserver(chunks)
        self.tp_group = mps.get_tensor_model_parallel_group() if self.info.tp_size > 1 else None
        self.steps = 0
        if self.info.rank == 0:  # where a slow start went (kernel compiles happen in the checks)
            import psutil

            copy = self.host_copy_bytes
            print("trainer start, host s: " + ", ".join(f"{k} {v:.1f}" for k, v in self.init_phases_s.items())
                  + f"; rank 0 resident {psutil.Process().memory_info().rss / 2**30:.1f} GiB"
                  + (f" (pinned offload copy {copy / 2**30:.1f} GiB)" if copy else "")
                  + (f"; the device's use while placing the state in the offload regions at most "
                     f"{self._offload.placement_peak_bytes / 2**30:.1f} GiB" if self._offload is not None else ""),
                  flush=True)

    # ------------------------------------------------------------------ setup
    def _check_gdn_fast_path(self) -> None:
        """With hardware.gdn_backend=fla: compare fla's Gated DeltaNet kernels (forward and
        backward, packed) with the torch path at this model's head sizes before the first step,
        and refuse to train on a mismatch (vlmrl.models.gated_delta.check_fast_path)."""
        lm = self.model_cfg.lm
        if self.cfg.hardware.gdn_backend != "fla" or "linear_attention" not in lm.layer_types:
            return
        from ..models import compat
        from ..models.gated_delta import check_model_fast_path

        # this rank's heads: TP shards them, CP splits them further
        check_model_fast_path(lm, compat.device(), self.dtype, split=self.info.tp_size * self.info.cp_size)

    def _check_attention_backend(self) -> None:
        """With hardware.lm_attention_backend=flash4: compare its kernels (forward and backward,
        packed) with the explicit softmax at this rank's attention heads before the first step,
        and refuse to train on a mismatch (vlmrl.models.attention.check_attention_backend)."""
        lm = self.model_cfg.lm
        if self.cfg.hardware.lm_attention_backend != "flash4":
            return
        from ..models import compat
        from ..models.attention import check_attention_backend

        tp = self.info.tp_size  # TP shards the heads; KV groups narrower than TP are replicated
        check_attention_backend("flash4", heads=lm.num_attention_heads // tp, groups=max(lm.num_query_groups // tp, 1),
                                head_dim=lm.head_dim, device=compat.device(), dtype=self.dtype)

    @property
    def chunks(self) -> list[Any]:
        return [m.module for m in self.model]

    def _offload_regions(self) -> Any:
        """The device-state offload of this rank (`vlmrl.training.offload`), or None where
        `trainer.offload` is off or the rank computes on the CPU."""
        from ..config.memory import trainer_offload
        from ..models import compat

        self.offload_off_reason: str | None = None
        self.offload_host_copy_s = 0.0
        if not trainer_offload(self.cfg):
            self.offload_off_reason = "trainer.offload is off in this run"
            return None
        if not compat.cuda_available():
            self.offload_off_reason = "this rank computes on the CPU: its state is in host memory already"
            return None
        from ..config.memory import offload_split
        from .offload import DeviceStateOffload

        split = offload_split(self.cfg)
        return DeviceStateOffload(self._device_state, compat.device(),
                                  resident_weights=split.part("weights") > 0,
                                  resident_optimizer_bytes=split.part("optimizer state"),
                                  overlap=self.cfg.trainer.offload_overlap)

    def _device_state(self) -> list[Any]:
        """What leaves the GPU with `offload`: the parameters (of the reference model too),
        the DDP parameter buffers they live in, the DDP gradient buffers (contents not kept),
        the optimizer's parameters and state."""
        from .offload import Held, optimizer_tensors

        held = []
        for ddp in self.model:
            for buf in [*ddp.buffers, *ddp.expert_parallel_buffers]:
                if buf.param_data is not None:
                    held.append(Held(buf.param_data, keep=True, fixed=True))
                held.append(Held(buf.grad_data, keep=False))
        for chunk in [*self.chunks, *(self.ref_chunks or [])]:
            held.extend(Held(p, keep=True, fixed=True) for p in chunk.parameters())
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None:
            held.extend(Held(t, keep=True, optimizer=True) for t in optimizer_tensors(optimizer))
        return held

    # ------------------------------------------------------------------ device memory
    @property
    def offloaded(self) -> bool:
        return self._offload is not None and self._offload.paused

    def _on_device(self, what: str) -> None:
        if self.offloaded:
            raise RuntimeError(f"{what}: the trainer's state is offloaded (trainer.offload); call onload() first")

    def offload(self) -> dict[str, Any]:
        """Free this rank's device memory of weights, gradients and optimizer state (their
        addresses stay reserved: compiled CUDA graphs remain valid) and return torch's cached
        blocks to the device, for colocated engines to use.

        Returns `bytes` (state that left the device), `copied_bytes` (the part copied to
        pinned host memory: all but the gradients, which every step zeroes anyway),
        `seconds` and `gb_per_s` (copied bytes per second, 1 GB = 1e9 bytes), and
        `device_freed_bytes` (device memory given back, torch's cache included). Where
        offload is off (`trainer.offload`, CPU ranks) nothing moves: the figures are zero and
        `offload` is "off: <why>". A second call without `onload` moves nothing."""
        if self._offload is None:
            return self._offload_off()
        out = {**self._offload.pause(), "offload": "on"}
        self._new_peak_window()
        return out

    @property
    def host_copy_bytes(self) -> int:
        """Pinned host memory that holds the offloaded state between steps (0 without offload)."""
        return self._offload.host_copy_bytes if self._offload is not None else 0

    def drop_host_copy(self) -> dict[str, float]:
        """Free the pinned host copy of the offloaded state while the state is on the device
        (see `DeviceStateOffload.drop_host_copy`); the next offload allocates it again."""
        if self._offload is None:
            return {"bytes": 0.0, "seconds": 0.0}
        return self._offload.drop_host_copy()

    def stage_offload(self) -> dict[str, Any]:
        """Start copying the state that the next `offload` moves to the host, on a side stream
        (`trainer.offload_overlap`; the loop calls this as it heads for the weight sync, which
        only reads the weights): the offload then waits for what is left of the copy. Returns
        the bytes it started copying (0 where nothing moves or overlap is off)."""
        if self._offload is None:
            return {"bytes": 0.0}
        return self._offload.stage_out()

    def settle_offload(self) -> None:
        """Wait for the optimizer state's overlapped copy back (before anything but the
        optimizer step reads or writes the state: a checkpoint's save or load)."""
        if self._offload is not None:
            self._offload.settle()

    def state_written(self) -> None:
        """The state was written outside an optimizer step (a checkpoint's load, the reference
        set to the policy): a copy out made before is stale."""
        if self._offload is not None:
            self._offload.changed()

    def onload(self) -> dict[str, Any]:
        """Bring back what `offload` freed, at the same addresses; returns the same figures."""
        if self._offload is None:
            return self._offload_off()
        out = {**self._offload.resume(), "offload": "on"}
        self._new_peak_window()
        return out

    def trim(self) -> dict[str, Any]:
        """Give torch's cached free blocks (a training step's activations, a sync's buckets)
        back to the device, for colocated engines that take memory while the trainer stays;
        returns `device_freed_bytes`. Starts a new peak window, as `offload` and `onload` do:
        the next phase's peak begins after this rank's move (`memory_stats`)."""
        from ..models import compat

        if not compat.cuda_available():
            return {"device_freed_bytes": 0.0}
        dev = compat.device()
        free_before, _ = torch.cuda.mem_get_info(dev)
        torch.cuda.empty_cache()
        free_after, _ = torch.cuda.mem_get_info(dev)
        self._new_peak_window()
        return {"device_freed_bytes": float(free_after - free_before)}

    def _new_peak_window(self) -> None:
        from ..models import compat

        if compat.cuda_available():
            torch.cuda.reset_peak_memory_stats(compat.device())

    def _offload_off(self) -> dict[str, Any]:
        return {**dict.fromkeys(("bytes", "copied_bytes", "seconds", "gb_per_s", "device_freed_bytes"), 0.0),
                "offload": f"off: {self.offload_off_reason}"}

    def memory_stats(self, reset_peak: bool = True) -> dict[str, Any]:
        """This rank's device memory now, in bytes: `allocated` and `reserved` by torch's
        caching allocator (they count the offloaded regions too, whose addresses stay
        reserved), `peak_allocated` and `peak_reserved` since the last reset, `offloaded`
        (bytes of trainer state off the device now), and `device_used` / `device_total` from
        `torch.cuda.mem_get_info`, which sees every process on the GPU (a colocated engine
        too). `reset_peak` (the default) starts the next peak here, so that successive calls
        give the peak of each interval between them. On a CPU rank every figure is 0 and
        `device` is "cpu"."""
        from ..models import compat

        keys = ("allocated", "reserved", "peak_allocated", "peak_reserved", "offloaded", "device_used",
                "device_total")
        if not compat.cuda_available():
            return {"device": "cpu", **dict.fromkeys(keys, 0.0)}
        dev = compat.device()
        free, total = torch.cuda.mem_get_info(dev)
        offloaded = 0.0
        if self.offloaded:
            offloaded = float(sum(self._offload.held_bytes().values()))
        out = {"device": str(dev), "allocated": float(torch.cuda.memory_allocated(dev)),
               "reserved": float(torch.cuda.memory_reserved(dev)),
               "peak_allocated": float(torch.cuda.max_memory_allocated(dev)),
               "peak_reserved": float(torch.cuda.max_memory_reserved(dev)), "offloaded": offloaded,
               "device_used": float(total - free), "device_total": float(total)}
        if reset_peak:
            torch.cuda.reset_peak_memory_stats(dev)
        return out

    def _wrap_ddp(self, chunks: list[Any]) -> list[Any]:
        from megatron.core.distributed import DistributedDataParallelConfig

        from .grad_accumulation import ddp_class

        ddp = ddp_class(self.cfg.hardware.fused_grad_accumulation)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=self.distributed_optimizer, check_for_nan_in_grad=False)
        return [ddp(config=c.config, ddp_config=ddp_config, module=c, disable_bucketing=(i > 0))
                for i, c in enumerate(chunks)]

    @property
    def distributed_optimizer(self) -> bool:
        """Whether the optimizer state is sharded over data parallelism (Megatron's
        DistributedOptimizer). NCCL runs only: megatron-core 0.16's DistributedOptimizer takes
        CUDA parameters alone (a type check on `torch.cuda.*Tensor`), although torch 2.13's gloo
        has the reduce-scatter it needs."""
        return self.cfg.trainer.use_distributed_optimizer and self.cfg.hardware.dist_backend == "nccl"

    def _optimizer(self) -> Any:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o = self.cfg.trainer.optim
        config = OptimizerConfig(
            optimizer=o.optimizer, lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
            bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype,
            use_distributed_optimizer=self.distributed_optimizer)
        optimizer = get_megatron_optimizer(config, self.model, use_gloo_process_groups=False)
        fix_param_group_index_map(optimizer)
        fix_torch_adam_state_load(optimizer)
        from ..models import compat

        if compat.cuda_available():
            use_fused_adam(optimizer)
        return optimizer

    def start_rl_schedule(self, steps: int) -> float:
        """Replace the learning-rate schedule by the RL phase's own (`trainer.optim.rl_lr`, over
        `steps` optimizer steps, warm-up and decay style as configured); returns the rate the
        next step uses. A checkpoint keeps whichever schedule is running (Megatron's scheduler
        takes its values from the checkpoint at load)."""
        lr = self.cfg.trainer.optim.rl_lr
        if lr is None:
            raise ValueError("trainer.optim.rl_lr is null: the SFT warm-up's schedule runs on through RL")
        self.scheduler = self._scheduler(steps, lr)
        return float(self.optimizer.param_groups[0]["lr"])

    def set_reference_to_policy(self) -> None:
        """The KL term's reference becomes the policy as it is now (the end of the SFT warm-up,
        `algo.kl_reference=warmup`): each rank copies its shards of the weights."""
        if self.ref_chunks is None:
            raise ValueError("algo.kl_coef is 0: there is no reference model to set")
        self._on_device("set_reference_to_policy")
        with torch.no_grad():
            for chunk, ref in zip(self.chunks, self.ref_chunks, strict=True):
                policy = dict(chunk.named_parameters())
                for name, p in ref.named_parameters():
                    p.copy_(policy[name])
        self.reference = "warmup"
        self.state_written()

    def load_scheduler_state(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint's learning-rate schedule (the warm-up's or RL's, whichever was
        running), its peak and floor included."""
        self.scheduler.load_state_dict(state)
        self._bind_lr_bounds(self.scheduler)

    def _bind_lr_bounds(self, scheduler: Any) -> Any:
        """Megatron's scheduler reads each parameter group's own `max_lr` / `min_lr` (set when
        the optimizer was built, from `trainer.optim.lr`) before its own: give the groups the
        schedule's, so that a schedule with another peak (RL's `rl_lr`) is the one applied."""
        for group in self.optimizer.param_groups:
            group["max_lr"], group["min_lr"] = scheduler.max_lr, scheduler.min_lr
        scheduler.step(increment=0)  # the groups' rate for the next step, from the bounds just set
        return scheduler

    def _scheduler(self, total_steps: int, lr: float | None = None) -> Any:
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        o = self.cfg.trainer.optim
        lr = o.lr if lr is None else lr
        decay = max(total_steps - o.lr_warmup_steps, 1)
        return self._bind_lr_bounds(OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if o.lr_warmup_steps else lr, max_lr=lr, min_lr=min(o.min_lr, lr),
            lr_warmup_steps=o.lr_warmup_steps, lr_decay_steps=decay + o.lr_warmup_steps,
            lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay,
            wd_incr_steps=decay + o.lr_warmup_steps, wd_incr_style="constant"))

    # ------------------------------------------------------------------ batches
    def _plan(self, samples: Sequence[TrainSample]) -> tuple[list[TrainSample], list[list[int]], int]:
        """This rank's micro-batches: the samples (fillers appended), the groups of indices into
        them, and how many samples are real (the first ones). Under expert parallelism every
        rank runs as many micro-batches as the rank with the most (`even_micro_batches`): an
        uneven split of a step's samples over the data-parallel ranks would otherwise leave
        ranks waiting in the MoE layers' all-to-all for ranks already in the gradient reduce."""
        p = self.cfg.parallel
        groups = micro_batches([s.num_tokens for s in samples],
                               max_tokens=p.max_tokens_per_gpu * p.cp if p.use_dynamic_batch_size else None,
                               micro_batch_size=p.micro_batch_size,
                               prompts=shared_prompt_keys(samples) if self.share_prompts else None)
        real = len(samples)
        if self.info.ep_size > 1 and dist.get_world_size() > 1:
            from ..models import compat

            most = torch.tensor([len(groups)], dtype=torch.int64, device=compat.device())
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            samples, groups, _ = even_micro_batches(samples, groups, int(most.item()))
        return list(samples), groups, real

    def _micro_batches(self, samples: Sequence[TrainSample], groups: list[list[int]], real: int) -> list[MicroBatch]:
        from dataclasses import replace

        from ..models import compat

        p, m = self.cfg.parallel, self.model_cfg
        dev = compat.device()
        return [replace(build_micro_batch([samples[i] for i in g], image_token_id=m.image_token_id,
                                          spatial_merge_size=m.vision.spatial_merge_size, cp_size=self.info.cp_size,
                                          cp_rank=self.info.cp_rank,
                                          sp_size=self.info.tp_size if p.sequence_parallel else 1,
                                          bucket=self.cuda_graphs, share_prompts=self.share_prompts),
                        filler=min(g) >= real).staged(dev)
                for g in groups]

    def _step_micro_batches(self, samples: Sequence[TrainSample]) -> list[MicroBatch]:
        return self._micro_batches(*self._plan(samples))

    def _vocab_start(self, logits: Tensor) -> int:
        return self.info.tp_rank * logits.shape[-1]

    def _token_logprobs(self, logits: Tensor, mb: MicroBatch, with_entropy: bool,
                        temperature: float | None = None) -> tuple[Tensor, Tensor | None]:
        """Logprobs of the targets; RL uses the rollout temperature (the engines' contract)."""
        t = self._temperature() if temperature is None else temperature
        logits = mb.outputs(logits)  # shared prompts: the rows the loss tensors read
        return logprobs_and_entropy(logits, mb.targets.to(logits.device), temperature=t,
                                    vocab_start=self._vocab_start(logits), group=self.tp_group,
                                    with_entropy=with_entropy, fused=self.cfg.hardware.fused_kernels)

    def _temperature(self) -> float:
        t = self.cfg.rollout.temperature
        return t if t > 0 else 1.0

    def _run(self, model: list[Any], mbs: list[MicroBatch], loss_fn: Any, forward_only: bool) -> list[dict]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Iterator[MicroBatch], chunk: Any) -> tuple[Tensor, Any]:
            mb = next(data_iterator)
            if self.cuda_graphs and not forward_only:
                begin_graph_step()
            return chunk(mb.packed, mb.pixel_values), partial(_filler_loss if mb.filler else loss_fn, mb)

        iters: Any = iter(mbs)
        if len(model) > 1:  # interleaved pipeline: one iterator per virtual stage
            iters = [iter(mbs) for _ in model]
        fb = get_forward_backward_func()
        return fb(forward_step_func=forward_step, data_iterator=iters,
                  model=model if len(model) > 1 else model[0], num_microbatches=len(mbs),
                  seq_length=max(mb.packed.num_tokens for mb in mbs), micro_batch_size=1,
                  forward_only=forward_only)

    # ------------------------------------------------------------------ logprobs
    @torch.no_grad()
    def _forward_logprobs(self, model: list[Any], mbs: list[MicroBatch], key: str) -> None:
        """Store per-token logprobs of `model` in each micro-batch's extras[key]."""
        def loss_fn(mb: MicroBatch, logits: Tensor) -> tuple[Tensor, Tensor, dict]:
            logp, _ = self._token_logprobs(logits, mb, with_entropy=False)
            mb.extras[key] = logp.detach()
            return logits.new_zeros(()), torch.tensor(1, dtype=torch.int), {}

        for m in model:
            m.eval()
        self._run(model, mbs, loss_fn, forward_only=True)

    # ------------------------------------------------------------------ steps
    def _step(self, mbs: list[MicroBatch], loss_fn: Any) -> dict[str, float]:
        # the phases are named for torch.profiler (record_function scopes: free when not profiling)
        with record_function("vlmrl.forward_backward"):
            for m in self.model:
                m.train()
                m.zero_grad_buffer()
            self.optimizer.zero_grad()
            outputs = self._run(self.model, mbs, loss_fn, forward_only=False)
        with record_function("vlmrl.optimizer_step"):
            if self._offload is not None:  # the optimizer state may still be on its way back (offload_overlap)
                self._offload.before_optimizer_step()
            ok, grad_norm, _ = self.optimizer.step()
            self.scheduler.step(increment=1)
            if self._offload is not None:
                self._offload.changed()
        self.steps += 1

        with record_function("vlmrl.metrics"):
            out = self._reduce_metrics(outputs)
            out.update(self.observer.collect())
        out["grad_norm"] = float(grad_norm) if grad_norm is not None else math.nan
        out["lr"] = self.optimizer.param_groups[0]["lr"]
        out["update_skipped"] = float(not ok)
        out.update(micro_batch_metrics(mbs))
        if self._offload is not None:
            out.update(self._offload.overlap_figures())
        return out

    def _reduce_metrics(self, outputs: list[dict[str, Any]]) -> dict[str, float]:
        """Sums and token-weighted means over micro-batches, pipeline stages and DP x CP ranks.

        The loss functions report 0-dim device tensors; they are summed on the device and
        read back once per step (no host sync per micro-batch). Every rank builds the same
        fixed-size vector (values and presence of each known metric): only the last
        pipeline stage has outputs, and NCCL reduces device tensors only."""
        from megatron.core import parallel_state as mps

        from ..models import compat

        keys = (*_SUMMED, *_MEANS, "_normaliser", "_tokens")
        dev = compat.device()
        vec = torch.zeros(2, len(keys), dtype=torch.float64, device=dev)  # [values; presence]
        for o in outputs:
            unknown = set(o) - set(keys)
            if unknown:
                raise KeyError(f"loss function reported unknown metrics {sorted(unknown)}")
            for i, k in enumerate(keys):
                if k in o:
                    vec[0, i] += torch.as_tensor(o[k], device=dev).double().reshape(())
                    vec[1, i] += 1.0
        if mps.get_pipeline_model_parallel_world_size() > 1:
            last = mps.get_pipeline_model_parallel_last_rank()
            dist.broadcast(vec, src=last, group=mps.get_pipeline_model_parallel_group())
        dist.all_reduce(vec, group=mps.get_data_parallel_group(with_context_parallel=True))
        values, present = vec.cpu().tolist()
        norm, tokens = max(values[-2], 1e-12), max(values[-1], 1e-12)
        out = {k: v / (tokens if k in _MEANS else norm)
               for k, v, n in zip(keys, values, present) if n and not k.startswith("_")}
        out["num_tokens"] = tokens
        return out

    def train_step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """One optimizer step on this DP rank's share of a global batch (RL loss).

        The old policy's logprobs come with the samples (`old_logprobs`, computed before the
        rollout's first optimizer step); without them the step is on-policy and the current
        logprobs, detached, are the old ones."""
        self._on_device("train_step")
        algo = self.cfg.algo
        with record_function("vlmrl.micro_batches"):
            mbs = self._step_micro_batches(samples)
        if self.ref_chunks is not None:
            with record_function("vlmrl.ref_logprobs"):
                self._forward_logprobs(self.ref_chunks, mbs, "ref_logp")
        need_entropy = True
        max_len = self.cfg.rollout.max_new_tokens

        def loss_fn(mb: MicroBatch, logits: Tensor) -> tuple[Tensor, Tensor, dict]:
            logp, entropy = self._token_logprobs(logits, mb, with_entropy=need_entropy)
            dev = logp.device
            mask, cu = mb.loss_mask.to(dev), mb.cu_seqlens.to(dev)
            old = mb.extras.get("old_logp", logp.detach())
            loss, metrics = losses.policy_loss(
                algo, logp, old.to(dev), mb.advantages.to(dev), mask, cu,
                ref_logp=mb.extras.get("ref_logp"), entropy=entropy,
                rollout_logp=mb.rollout_logp.to(dev) if mb.has_rollout_logp else None,
                normaliser=1.0, max_response_len=max_len)
            normaliser = losses.loss_normaliser(mask, cu, algo.loss_agg_mode, max_len)
            n_tok = mask.sum()
            reduced = {k: _detached(v) for k, v in metrics.items() if k in _SUMMED}
            reduced.update({k: _detached(v) * n_tok for k, v in metrics.items() if k in _MEANS})
            reduced["_normaliser"] = normaliser
            reduced["_tokens"] = n_tok
            return loss, normaliser.round().to(torch.int), reduced

        return self._step(mbs, loss_fn)

    def sft_step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """One optimizer step of supervised fine-tuning (loss on loss-masked tokens)."""
        self._on_device("sft_step")
        mbs = self._step_micro_batches(samples)

        def loss_fn(mb: MicroBatch, logits: Tensor) -> tuple[Tensor, Tensor, dict]:
            logp, _ = self._token_logprobs(logits, mb, with_entropy=False, temperature=1.0)
            mask = mb.loss_mask.to(logp.device)
            nll = -(torch.where(mask > 0, logp, 0.0) * mask).sum()
            n_tok = mask.sum()
            return nll, n_tok.round().to(torch.int), {"loss": nll.detach(), "_normaliser": n_tok, "_tokens": n_tok}

        return self._step(mbs, loss_fn)

    @torch.no_grad()
    def logprobs(self, samples: Sequence[TrainSample]) -> list[Tensor] | None:
        """Per-sample logprobs of the loss-masked tokens under the current weights, in the
        order of `samples` (old-policy logprobs, trainer-vs-engine checks). The ranks that
        hold the full result (last pipeline stage) return it; the others return None."""
        from megatron.core import parallel_state as mps

        self._on_device("logprobs")
        samples, groups, real = self._plan(samples)
        mbs = self._micro_batches(samples, groups, real)
        self._forward_logprobs(self.model, mbs, "logp")
        if not mps.is_pipeline_last_stage(ignore_virtual=True):
            return None
        out: list[Tensor | None] = [None] * real
        for g, mb in zip(groups, mbs):
            if mb.filler:
                continue
            logp = mb.extras["logp"].float()
            if self.info.cp_size > 1:  # gathered on the device: NCCL has no CPU tensors
                from ..models.packing import cp_merge

                shares = [torch.empty_like(logp) for _ in range(self.info.cp_size)]
                dist.all_gather(shares, logp.contiguous(), group=mps.get_context_parallel_group())
                logp = cp_merge([x.cpu() for x in shares], mb.whole.padded_lens)
            for i, values in zip(g, mb.sample_values(logp.cpu())):
                out[i] = values
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------------ weights
    def iter_hf_weights(self, bucket_bytes: int, dtype: torch.dtype | None = None,
                        compact: bool = True, fused_experts: bool = False) -> Iterator[list[tuple[str, Tensor]]]:
        """The current weights as HF-named buckets (collective over TP and PP); `compact` and
        `fused_experts` as in `adapters.iter_hf_weights`."""
        from ..models import adapters

        self._on_device("iter_hf_weights")
        return adapters.iter_hf_weights(self.chunks, self.model_cfg, bucket_bytes=bucket_bytes, dtype=dtype,
                                        compact=compact, fused_experts=fused_experts)

    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        return {"steps": self.steps, "scheduler": self.scheduler.state_dict()}
