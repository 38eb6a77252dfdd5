"""Checkpoints of the trainer: Megatron distributed checkpoint + per-rank RNG states.

Layout of one checkpoint directory (`<run_dir>/checkpoints/step_<N>`):

    dist/            megatron.core.dist_checkpointing: model chunks and optimizer state
                     (the weights load under another TP/PP/DP layout; the distributed
                     optimizer's state as `trainer.checkpoint_format` says)
    rng_<rank>.pt    torch / numpy / python / Megatron tracker RNG states of each rank
    trainer.pt       scheduler state, step counters and the optimizer state's format (rank 0)
    loop.json        the driver's state (written by the loop after the ranks are done)

A checkpoint counts only once `loop.json` exists; `latest` in the parent names the newest
complete one, replaced atomically, so a kill mid-save leaves the previous one in force.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..models import compat
from .offload import release_host_memory
from .trainer import use_fused_adam

LATEST = "latest"
LOOP_STATE = "loop.json"


# The distributed optimizer's (NCCL) state in a checkpoint: `trainer.checkpoint_format`, one of
# megatron-core's formats. dp_reshardable writes each rank's shards as the optimizer holds them
# (no gather; loads under another data-parallel size), fully_reshardable one tensor per parameter
# and moment, gathered over each data-parallel group at save and re-cut at load (loads under any
# TP/PP/DP layout). trainer.pt records which one a checkpoint holds, and a load reads that one.
# megatron-core's default, 'fully_sharded_model_space', cannot be saved in 0.16
# ("ShardedTensor.flattened_range is not supported").
LEGACY_OPTIMIZER_FORMAT = "fully_reshardable"  # checkpoints written before trainer.pt named it


REFERENCE_PREFIX = "ref."


CHECKPOINT_DIR = "checkpoints"  # under the run directory


@dataclasses.dataclass
class LoopState:
    """The loop's own state, saved beside the trainer's (loop.json)."""

    step: int = 0  # RL steps done (SFT: optimizer steps done)
    sft_steps_done: int = 0
    train_seconds: float = 0.0  # wall time of SFT and RL steps (rollout, train, sync); evals excluded
    eval_accuracy_start: float | None = None
    data: dict[str, int] = dataclasses.field(default_factory=dict)  # the prompt sampler's position


def _sharded_state_dict(trainer: Any, *, is_loading: bool = False, reference: bool = False,
                        optimizer_format: str | None = None) -> dict[str, Any]:
    """Model chunks + optimizer, and with `reference` the KL term's reference model (under
    `ref.`-prefixed keys). `is_loading` makes the optimizer create its (Adam) state first, so
    that the loaded moments have somewhere to go (a fresh optimizer has none).
    `optimizer_format`: the distributed optimizer's format (default `trainer.checkpoint_format`)."""
    model_sd: dict[str, Any] = {}
    for i, chunk in enumerate(trainer.chunks):
        model_sd[_chunk_key("model", i, trainer.chunks)] = chunk.sharded_state_dict()
    metadata = ({"distrib_optim_sharding_type": optimizer_format or trainer.cfg.trainer.checkpoint_format}
                if trainer.distributed_optimizer else None)
    optim_sd = trainer.optimizer.sharded_state_dict(model_sd if len(trainer.chunks) > 1 else model_sd["model"],
                                                    is_loading=is_loading, metadata=metadata)
    ref_sd = {}
    if reference:
        for i, chunk in enumerate(trainer.ref_chunks):
            ref_sd[_chunk_key("ref", i, trainer.ref_chunks)] = chunk.sharded_state_dict(prefix=REFERENCE_PREFIX)
    return {**model_sd, "optimizer": optim_sd, **ref_sd}


def _chunk_key(name: str, i: int, chunks: list[Any]) -> str:
    return f"{name}{i}" if len(chunks) > 1 else name


def _saves_reference(trainer: Any) -> bool:
    """The reference model is saved when it is not the start checkpoint (which a resumed run
    loads again anyway): after `set_reference_to_policy`."""
    return getattr(trainer, "ref_chunks", None) is not None and trainer.reference != "initial"


def _strip_prefix(state: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state.items()}


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def host_available_bytes(cgroup_root: str | os.PathLike = "/sys/fs/cgroup") -> int:
    """Host memory this process may still take: the kernel's MemAvailable, or less where the
    process's cgroup sets a limit (v2 `memory.max` less `memory.current`; v1
    `memory.limit_in_bytes` less `memory.usage_in_bytes`)."""
    import psutil

    room = int(psutil.virtual_memory().available)
    root = Path(cgroup_root)
    for limit, usage in (("memory.max", "memory.current"),
                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            cap = (root / limit).read_text().strip()
            used = int((root / usage).read_text().strip())
        except (OSError, ValueError):
            continue
        if cap.isdigit() and int(cap) < 1 << 60:  # "max", or v1's page-rounded "unlimited"
            room = min(room, max(int(cap) - used, 0))
    return room


class HostPeak:
    """The largest resident set size of this process while the block runs (`before`, `peak`
    in bytes), sampled every `interval` seconds by a thread."""

    def __init__(self, interval: float = 0.02) -> None:
        import psutil

        self._proc = psutil.Process()
        self.interval = interval
        self.before = self.peak = 0

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __enter__(self) -> HostPeak:
        import threading

        self.before = self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="host-peak", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


def _host_room(trainer: Any, what: str) -> tuple[float, int, float]:
    """Room in host memory for a save or a load, which stages about the same bytes per rank
    (`checkpoint_host_bytes`): where the node's ranks would not fit beside their pinned offload
    copies, this rank frees its copy first (the next offload pins it again). Returns the bytes
    the plan gives the save or load, the bytes available before, and the bytes freed."""
    from ..config.memory import checkpoint_host_bytes, trainer_ranks_per_node

    need = checkpoint_host_bytes(trainer.cfg)
    available = host_available_bytes()
    copy = getattr(trainer, "host_copy_bytes", 0)
    if copy and need * trainer_ranks_per_node(trainer.cfg) > available:
        print(f"checkpoint: the {what} needs about {need / 2**30:.1f} GiB of host memory per rank and "
              f"{available / 2**30:.1f} GiB are available: freeing the pinned offload copy "
              f"({copy / 2**30:.1f} GiB) first", flush=True)
        return need, available, trainer.drop_host_copy()["bytes"]
    return need, available, 0.0


def _write_results_in_process() -> None:
    """megatron-core's file writer returns each save's write results through a queue, by default
    one served by a `multiprocessing` Manager: a spawned process that imports torch to unpickle
    them, about 2 s of CPU and 270 MiB resident per rank for the rest of the run, none of it in
    the plan's host memory. A synchronous save (the only kind vlmrl makes) writes and collects in
    this process (its forked writers report through a queue of their own), so a plain queue
    serves. Set before the first save, where megatron-core still has that hook and has not made
    its Manager yet; otherwise nothing changes."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = queue.Queue()


def save_checkpoint(trainer: Any, path: str | os.PathLike, extra: dict[str, Any] | None = None) -> dict[str, float]:
    """Collective over all trainer ranks. Returns this rank's figures: `seconds`;
    `host_need_bytes`, the host memory the plan gives the save (`checkpoint_host_bytes`);
    `host_available_bytes` before it; `host_copy_dropped_bytes`, the pinned offload copy freed
    first where the node's ranks would not fit beside it (the next offload pins it again); and
    the process's resident memory before, at its peak during the save and after it
    (`host_rss_before_bytes`, `host_rss_peak_bytes`, `host_rss_after_bytes`: the staged memory
    given back, `vlmrl.training.offload.release_host_memory`)."""
    import time

    from megatron.core import dist_checkpointing

    t0 = time.perf_counter()
    path = Path(path)
    rank = dist.get_rank()
    getattr(trainer, "settle_offload", lambda: None)()  # the optimizer state whole on the device
    need, available, dropped = _host_room(trainer, "save")
    if rank == 0:
        (path / "dist").mkdir(parents=True, exist_ok=True)
    dist.barrier()
    _write_results_in_process()
    with HostPeak() as host:
        dist_checkpointing.save(_sharded_state_dict(trainer, reference=_saves_reference(trainer)), str(path / "dist"))
    release_host_memory()
    import psutil

    after = psutil.Process().memory_info().rss
    torch.save(_rng_state(), path / f"rng_{rank}.pt")
    if rank == 0:
        torch.save({"steps": trainer.steps, "scheduler": trainer.scheduler.state_dict(), "extra": extra or {},
                    "reference": trainer.reference if _saves_reference(trainer) else "initial",
                    "optimizer_format": trainer.cfg.trainer.checkpoint_format if trainer.distributed_optimizer
                    else "plain"}, path / "trainer.pt")
    dist.barrier()
    return {"seconds": time.perf_counter() - t0, "host_need_bytes": need, "host_available_bytes": float(available),
            "host_copy_dropped_bytes": dropped, "host_rss_before_bytes": float(host.before),
            "host_rss_peak_bytes": float(host.peak), "host_rss_after_bytes": float(after)}


def load_checkpoint(trainer: Any, path: str | os.PathLike) -> dict[str, Any]:
    """Collective over all trainer ranks; returns trainer.pt's `extra`."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    getattr(trainer, "settle_offload", lambda: None)()
    _host_room(trainer, "load")
    if getattr(trainer, "distributed_optimizer", False):
        # megatron-core 0.16's DistributedOptimizer reads torch Adam's step counters while it
        # describes what to load, and a trainer that has not stepped yet has none
        from .offload import init_optimizer_state

        init_optimizer_state(trainer.optimizer)
    meta = torch.load(path / "trainer.pt", weights_only=False)
    # the reference model, where the checkpoint has one (a run without the KL term skips it)
    reference = meta.get("reference", "initial") != "initial" and getattr(trainer, "ref_chunks", None) is not None
    fmt = meta.get("optimizer_format", LEGACY_OPTIMIZER_FORMAT)
    if not getattr(trainer, "distributed_optimizer", False) and fmt == "dp_reshardable":
        raise ValueError(f"{path}: the checkpoint holds the distributed optimizer's shards (dp_reshardable), which only "
                         "the distributed optimizer (GPU ranks, trainer.use_distributed_optimizer=true) loads")
    # a plain optimizer's state is per parameter, the layout fully_reshardable reads
    state = dist_checkpointing.load(_sharded_state_dict(trainer, is_loading=True, reference=reference,
                                                        optimizer_format=LEGACY_OPTIMIZER_FORMAT if fmt == "plain"
                                                        else fmt),
                                    str(path / "dist"))
    for i, chunk in enumerate(trainer.chunks):
        chunk.load_state_dict(state[_chunk_key("model", i, trainer.chunks)])
    if reference:
        for i, chunk in enumerate(trainer.ref_chunks):
            chunk.load_state_dict(_strip_prefix(state[_chunk_key("ref", i, trainer.ref_chunks)], REFERENCE_PREFIX))
        trainer.reference = meta["reference"]
    trainer.optimizer.load_state_dict(state["optimizer"])
    if compat.cuda_available():  # the loaded param groups carry the saved implementation flags
        use_fused_adam(trainer.optimizer)
    getattr(trainer, "state_written", lambda: None)()
    trainer.steps = meta["steps"]
    trainer.load_scheduler_state(meta["scheduler"])
    _set_rng_state(torch.load(path / f"rng_{dist.get_rank()}.pt", weights_only=False))
    del state
    release_host_memory()
    dist.barrier()
    return meta.get("extra", {})


# --------------------------------------------------------------------------- driver side
def checkpoint_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def write_loop_state(path: str | os.PathLike, state: dict[str, Any]) -> None:
    """Mark the checkpoint at `path` complete and make it the latest."""
    path = Path(path)
    tmp = path / (LOOP_STATE + ".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(path / LOOP_STATE)
    latest = path.parent / LATEST
    tmp_latest = path.parent / (LATEST + ".tmp")
    tmp_latest.write_text(path.name)
    tmp_latest.replace(latest)


def find_latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    root = Path(root)
    latest = root / LATEST
    if latest.exists():
        candidate = root / latest.read_text().strip()
        if (candidate / LOOP_STATE).exists():
            return candidate
    done = sorted(p for p in root.glob("step_*") if (p / LOOP_STATE).exists())
    return done[-1] if done else None


def read_loop_state(path: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(path) / LOOP_STATE).read_text())


def resume_path(resume: str, root: str | os.PathLike) -> Path | None:
    """The checkpoint a run resumes from (`resume`: never, auto (the latest complete one under
    `root`) or a checkpoint's path, which must be complete)."""
    if resume == "never":
        return None
    if resume == "auto":
        return find_latest(root)
    path = Path(resume)
    if not (path / "loop.json").exists():
        raise FileNotFoundError(f"resume={resume}: no complete checkpoint there (no loop.json)")
    return path


def save_summary(name: str, saved: dict[str, Any]) -> str:
    """One line on a save, from `save_checkpoint`'s report."""
    gib = float(1 << 30)
    taken, dropped = saved["host_rss_peak_bytes"] - saved["host_rss_before_bytes"], saved["host_copy_dropped_bytes"]
    kept = saved.get("host_rss_after_bytes", saved["host_rss_before_bytes"]) - saved["host_rss_before_bytes"]
    return (f"checkpoint {name}: {saved['seconds']:.1f} s; host memory taken by the save {taken / gib:.1f} GiB "
            f"(plan {saved['host_need_bytes'] / gib:.1f}; {saved['host_available_bytes'] / gib:.1f} available), "
            f"{kept / gib:.1f} GiB still held after it"
            + (f"; pinned offload copy of {dropped / gib:.1f} GiB freed first" if dropped else ""))
