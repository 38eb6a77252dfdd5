"""Megatron parallel state from a `ParallelConfig`, over gloo (CPU) or NCCL (GPU).

`init_parallel_state` starts torch.distributed when needed (from the usual RANK /
WORLD_SIZE / MASTER_ADDR / MASTER_PORT variables, or explicit arguments), installs the
CPU shims of `compat` when CUDA is absent, creates Megatron's groups in its default
`vlmrl.config.layout.RANK_ORDER` order (the one the layout assumes) and seeds the RNGs.
`destroy_parallel_state` tears the Megatron groups down so one process can switch layouts
(tests run several layouts in the same processes).

`spawn_local` runs a function in N local processes: the CPU multi-process path of the
parity CLI and the integration tests. Where vlmrl launches the ranks itself (`spawn_local`,
the Ray trainer group), the launcher hosts the rendezvous store (`host_store`) on a port the
OS assigns while it listens, and every rank joins as a client (`LAUNCHER_STORE`). A port
picked free, released and bound again by rank 0 can be taken in between by any outgoing
connection, which failed a CI run with EADDRINUSE.
"""

from __future__ import annotations

import io
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..config.layout import RANK_ORDER, megatron_parallel_sizes
from ..config.schema import ParallelConfig
from ..models import compat


@dataclass(frozen=True)
class ParallelInfo:
    """This rank's coordinates in the Megatron grid."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    cp_rank: int
    cp_size: int
    dp_rank: int
    dp_size: int
    ep_rank: int
    ep_size: int
    vpp_size: int | None


# set to "1" in a rank's environment when its launcher hosts the store at MASTER_ADDR:MASTER_PORT
LAUNCHER_STORE = "VLMRL_LAUNCHER_STORE"


def host_store(timeout_s: float = 600.0) -> dist.TCPStore:
    """A rendezvous store served by this process on a port the OS picks (`.port`), for the
    ranks it launches and for the weight-update group trainer rank 0 forms with the engines.

    Keep it referenced while the ranks live: Megatron creates its groups through it."""
    return dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def init_distributed(backend: str | None = None, *, rank: int | None = None, world_size: int | None = None,
                     timeout_s: float = 600.0) -> None:
    """Start the default process group if it is not running.

    The rendezvous is env:// (rank 0 serves the store at MASTER_PORT), or, with
    `LAUNCHER_STORE` set, the store the launcher serves there."""
    if dist.is_initialized():
        return
    backend = backend or ("nccl" if compat.cuda_available() else "gloo")
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store: dist.Store | None = None
    if os.environ.get(LAUNCHER_STORE) == "1":
        if "MASTER_PORT" not in os.environ:
            raise RuntimeError(f"{LAUNCHER_STORE}=1 but MASTER_PORT is not set")
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timeout)
    elif "MASTER_PORT" not in os.environ:
        if world_size != 1:
            raise RuntimeError("MASTER_PORT is not set for a multi-process run")
        store = host_store(timeout_s)  # one process: it serves its own
        os.environ["MASTER_PORT"] = str(store.port)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, store=store)


def init_parallel_state(parallel: ParallelConfig, *, backend: str | None = None, seed: int = 1234,
                        timeout_s: float = 600.0) -> ParallelInfo:
    """Create Megatron's process groups for `parallel` (world = dp * tp * pp * cp).

    backend "gloo" makes this a CPU rank even on a machine with GPUs."""
    if backend == "gloo":
        compat.force_cpu()
    compat.apply()
    init_distributed(backend, timeout_s=timeout_s)
    from megatron.core import parallel_state as mps
    from megatron.core import tensor_parallel

    if mps.model_parallel_is_initialized():
        mps.destroy_model_parallel()
    world = dist.get_world_size()
    model_parallel = parallel.tp * parallel.pp * parallel.cp
    if world % model_parallel:
        raise ValueError(f"world size {world} is not a multiple of tp*pp*cp = {model_parallel}")
    mps.initialize_model_parallel(
        **megatron_parallel_sizes(parallel),
        distributed_timeout_minutes=max(int(timeout_s // 60), 1),
        order=RANK_ORDER,
        # gloo groups double the group count; CPU runs use gloo for everything anyway
        create_gloo_process_groups=compat.cuda_available(),
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    torch.manual_seed(seed)
    return parallel_info()


def parallel_info() -> ParallelInfo:
    from megatron.core import parallel_state as mps

    return ParallelInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_rank=mps.get_tensor_model_parallel_rank(),
        tp_size=mps.get_tensor_model_parallel_world_size(),
        pp_rank=mps.get_pipeline_model_parallel_rank(),
        pp_size=mps.get_pipeline_model_parallel_world_size(),
        cp_rank=mps.get_context_parallel_rank(),
        cp_size=mps.get_context_parallel_world_size(),
        dp_rank=mps.get_data_parallel_rank(),
        dp_size=mps.get_data_parallel_world_size(),
        ep_rank=mps.get_expert_model_parallel_rank(),
        ep_size=mps.get_expert_model_parallel_world_size(),
        vpp_size=mps.get_virtual_pipeline_model_parallel_world_size(),
    )


def destroy_parallel_state(*, process_group: bool = False) -> None:
    """Destroy Megatron's groups (and the default process group when asked)."""
    from megatron.core import parallel_state as mps

    if mps.model_parallel_is_initialized():
        dist.barrier()
        mps.destroy_model_parallel()
    if process_group and dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------- local spawn
def _spawn_entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple,
                 queue: Any, backend: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **{LAUNCHER_STORE: "1"})
    try:
        torch.set_num_threads(1)
        if backend == "gloo":
            compat.force_cpu()  # CPU ranks, also on a machine with GPUs
        compat.apply()
        init_distributed(backend, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(result, buf)  # plain bytes: tensors must not outlive this process's shared memory
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # report the child's traceback to the parent
        queue.put((rank, False, traceback.format_exc()))
        raise
    finally:
        try:
            destroy_parallel_state(process_group=True)
        except Exception:
            pass


def spawn_local(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
                timeout_s: float = 600.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` fresh processes; return the results.

    The process group is up when `fn` starts (Megatron's groups are `fn`'s to create).
    `fn` must be importable (module level) and its result picklable. A failing rank raises
    RuntimeError here with that rank's traceback.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    store = host_store(timeout_s)  # served here until every rank has returned
    procs = [ctx.Process(target=_spawn_entry, args=(r, world_size, store.port, fn, args, queue, backend),
                         daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    import time

    deadline = time.monotonic() + timeout_s
    while len(results) + len(errors) < world_size:
        if queue.empty():
            if time.monotonic() > deadline or (not any(p.is_alive() for p in procs) and queue.empty()):
                break
            time.sleep(0.05)
            continue
        rank, ok, payload = queue.get()
        if ok:
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            errors.append(f"rank {rank}:\n{payload}")
            break
    for p in procs:
        p.join(timeout=5 if errors else max(deadline - time.monotonic(), 5))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        raise RuntimeError("a spawned rank failed:\n" + "\n".join(errors))
    if len(results) != world_size:
        codes = [p.exitcode for p in procs]
        raise RuntimeError(f"spawned ranks did not all report (exit codes {codes}, timeout {timeout_s}s)")
    return [results[r] for r in range(world_size)]
