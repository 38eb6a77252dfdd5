"""The trainer as a group of Ray actors, one per Megatron rank.

Ranks rendezvous over torch.distributed (gloo on CPU, NCCL on GPUs) at an address chosen
by rank 0. The driver hands each rank its data-parallel share of a global batch (ranks
with the same DP coordinate get the same samples) and calls the ranks together, since
every step is collective. Weight sync runs inside the ranks: all of them take part in
gathering the HF-named buckets, and global rank 0 pushes each bucket to every engine.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..config.layout import Layout, compute_layout, shares_prompts
from ..config.schema import VlmrlConfig
from ..training.batch import TrainSample, split_by_tokens
from ..training.parallel_state import host_store
from .placement import Placement


class TrainerWorker:
    """Ray actor body: one Megatron rank."""

    # a colocated IPC sync flattens views (q/k/v of a fused QKV, each expert's matrices) as
    # they are; True copies each into storage of its own first, as other formats need
    compact_views = False

    def __init__(self, cfg: VlmrlConfig, rank: int, world_size: int, master_addr: str, master_port: int | None,
                 layout: Layout | None = None) -> None:
        """`master_port` is the port of the store the launcher serves (`host_store`); None
        for a rank that is the whole world and serves its own."""
        from ..logging.console import quiet_from_env
        from ..training.parallel_state import LAUNCHER_STORE

        quiet_from_env()
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=master_addr, LOCAL_RANK="0")
        if master_port is None:
            if world_size != 1:
                raise ValueError(f"rank {rank} of {world_size} needs the launcher's store port")
            os.environ.pop("MASTER_PORT", None)
            os.environ.pop(LAUNCHER_STORE, None)
        else:
            os.environ.update(MASTER_PORT=str(master_port), **{LAUNCHER_STORE: "1"})
        self.cfg = cfg
        self.layout = layout or compute_layout(cfg)  # the run's, where the group passes it
        self._transport: Any = None  # vlmrl.cluster.weight_transport, made at the first sync over HTTP
        self.last_sync_phases: dict[str, float] = {}
        self.rank = rank
        self.trainer: Any = None
        self._profiler: Any = None  # torch.profiler.profile while a step is traced

    def node_ip(self) -> str:
        return socket.gethostbyname(socket.gethostname())

    def init(self, model_path: str, total_steps: int) -> dict[str, int]:
        import torch

        from ..training.trainer import MegatronTrainer
        from .placement import available_cores, cpu_threads

        threads = cpu_threads(self.cfg, "trainer", available_cores())
        if threads:
            torch.set_num_threads(threads)

        self.trainer = MegatronTrainer(self.cfg, model_path, total_steps=total_steps)
        i = self.trainer.info
        return {"rank": i.rank, "dp_rank": i.dp_rank, "dp_size": i.dp_size, "tp_rank": i.tp_rank,
                "pp_rank": i.pp_rank, "cp_rank": i.cp_rank, "init_phases_s": dict(self.trainer.init_phases_s)}

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        return self.trainer.train_step(samples)

    def sft_step(self, samples: list[TrainSample]) -> dict[str, float]:
        return self.trainer.sft_step(samples)

    def logprobs(self, samples: list[TrainSample]) -> list[Any] | None:
        return self.trainer.logprobs(samples)

    def sync_weights(self, engines: Sequence[Any], bucket_bytes: int, weight_version: str | None = None,
                     reset_links: bool = False, api_key: str | None = None) -> int:
        """Gather the weights (collective) and, on global rank 0, push every bucket to every
        engine: embedded engine actors (Ray handles) or servers speaking SGLang's protocol (URLs,
        called with the run's engine key `api_key`). Returns the number of bytes sent per engine."""
        if engines and isinstance(engines[0], str):
            return self._sync_http(list(engines), bucket_bytes, weight_version, reset=reset_links, api_key=api_key)
        import ray

        sent = 0
        for bucket in self.trainer.iter_hf_weights(bucket_bytes):
            if self.rank == 0:
                payload = [(n, t.detach().cpu()) for n, t in bucket]
                ray.get([e.update_weights_from_tensor.remote(payload, None, False, None) for e in engines])
                sent += sum(t.numel() * t.element_size() for _, t in payload)
        if self.rank == 0:
            ray.get([e.update_weights_from_tensor.remote([], None, True, weight_version) for e in engines])
        return sent

    def _sync_http(self, urls: list[str], bucket_bytes: int, weight_version: str | None, *,
                   reset: bool = False, api_key: str | None = None) -> int:
        """SGLang's weight-sync protocol, to SGLang servers or to the embedded server over HTTP,
        through this rank's transport to these engines (`vlmrl.cluster.weight_transport`:
        colocated or broadcast), made at the first sync and kept; `reset` (an engine was
        restarted) or a changed URL list makes a new one."""
        from .weight_transport import weight_transport

        if self._transport is not None and (reset or list(urls) != self._transport.urls):
            self._drop_engine_links()
        if self._transport is None:
            broadcast_host = self.node_ip() if self.rank == 0 and not self.cfg.cluster.colocate else ""
            self._transport = weight_transport(self.cfg, self.rank, urls, self.layout, api_key=api_key,
                                               host=broadcast_host)
        transport = self._transport
        buckets = self.trainer.iter_hf_weights(bucket_bytes, compact=transport.wants_compact(self.compact_views),
                                               fused_experts=transport.fused_experts)
        sent = transport.send(buckets, weight_version)
        self.last_sync_phases = transport.last_phases
        return sent

    def sync_phases(self) -> dict[str, float]:
        """Host seconds of the last sync's phases on this rank (gather_convert, serialize,
        engines, barrier; `buckets`), as its weight transport measured them; empty before
        the first sync or for engines driven as Ray actors."""
        return dict(self.last_sync_phases)

    def _drop_engine_links(self) -> None:
        """Leave the engines (best effort on engines that may be gone: a restarted one starts
        without the broadcast group)."""
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def offload(self) -> dict[str, float]:
        """Move this rank's weights, gradients and optimizer state off the GPU (see
        `MegatronTrainer.offload`); returns its bytes and seconds."""
        return self.trainer.offload()

    def onload(self) -> dict[str, float]:
        return self.trainer.onload()

    def stage(self) -> dict[str, float]:
        """Start the copy out of what the next offload moves (see `MegatronTrainer.stage_offload`)."""
        return self.trainer.stage_offload()

    def trim(self) -> dict[str, float]:
        """Return torch's cached free blocks to the device (see `MegatronTrainer.trim`)."""
        return self.trainer.trim()

    def profile_start(self) -> None:
        """Start this rank's torch.profiler trace (`vlmrl.training.profile`)."""
        from ..training import profile

        self._profiler = profile.start()

    def profile_stop(self, out_dir: str) -> dict[str, str]:
        """Stop the trace and write it under `out_dir`; returns the files' paths."""
        from ..training import profile

        prof, self._profiler = self._profiler, None
        return profile.stop(prof, out_dir, self.rank)

    def start_rl_schedule(self, steps: int) -> float:
        return self.trainer.start_rl_schedule(steps)

    def set_reference_to_policy(self) -> None:
        self.trainer.set_reference_to_policy()

    def memory_stats(self) -> dict[str, float]:
        """This rank's device memory now (see `MegatronTrainer.memory_stats`)."""
        return self.trainer.memory_stats()

    def export_hf(self) -> dict[str, Any] | None:
        from ..models import adapters

        sd = adapters.export_hf_state_dict(self.trainer.chunks, self.cfg.model)
        return sd if self.rank == 0 else None

    def save(self, path: str, extra: dict[str, Any]) -> dict[str, float]:
        from ..training.checkpoint import save_checkpoint

        return save_checkpoint(self.trainer, path, extra)

    def load(self, path: str) -> dict[str, Any]:
        from ..training.checkpoint import load_checkpoint

        return load_checkpoint(self.trainer, path)


class TrainerGroup:
    """The driver's handle on all trainer ranks."""

    def __init__(self, cfg: VlmrlConfig, model_path: str, *, total_steps: int, placement: Placement,
                 wait: bool = True) -> None:
        """Start the ranks. `wait=False` returns once the actors are requested: their start-up
        (process, imports, Megatron, the model) runs while the caller does other work; the
        first call that needs the ranks (or `wait_ready`) waits for it."""
        import ray

        self.cfg = cfg
        layout = placement.layout or compute_layout(cfg)
        self.world_size = layout.trainer_world_size
        on_gpu = layout.on_gpu
        # On GPUs each rank owns one GPU; colocated engines take a share of the same GPUs.
        gpus = 0.5 if on_gpu and cfg.cluster.colocate else (1.0 if on_gpu else 0.0)
        cls = ray.remote(TrainerWorker)

        def opts(rank: int) -> dict[str, Any]:
            return dict(num_cpus=cfg.cluster.cpus_per_actor, num_gpus=gpus,
                        scheduling_strategy=placement.strategy(placement.trainer_bundles[rank]))

        # the ranks' rendezvous: served by the driver for as long as the group lives (Megatron
        # creates its groups through it), on a port the OS gave it, so no rank races for one
        self._store = host_store()
        addr = ray.util.get_node_ip_address() if cfg.cluster.num_nodes > 1 else "127.0.0.1"
        self.workers = [cls.options(**opts(r)).remote(cfg, r, self.world_size, addr, self._store.port, layout)
                        for r in range(self.world_size)]
        self._pending: list[Any] | None = [w.init.remote(model_path, total_steps) for w in self.workers]
        self._ranks: list[dict[str, int]] = []
        # every call is collective: callers on two threads (an async rollout restarting an
        # engine while the main thread trains) must reach all ranks in the same order
        self._lock = threading.RLock()
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait until every rank has built its model and optimizer (a rank's start-up error
        is raised here); a no-op once they have."""
        import ray

        if self._pending is not None:
            self._ranks = ray.get(self._pending)
            self._pending = None

    @property
    def ranks(self) -> list[dict[str, int]]:
        """Each rank's parallel coordinates (waits for the ranks' start-up)."""
        self.wait_ready()
        return self._ranks

    @property
    def dp_size(self) -> int:
        return self.ranks[0]["dp_size"]

    @property
    def start_phases_s(self) -> dict[str, float]:
        """Global rank 0's start, part by part (host seconds: imports, build, the kernel checks,
        weight load, DDP, optimizer; `MegatronTrainer.init_phases_s`)."""
        return next(r for r in self.ranks if r["rank"] == 0)["init_phases_s"]

    @contextlib.contextmanager
    def _collective(self) -> Iterator[None]:
        """A call that reaches every rank: after their start-up, one caller at a time."""
        with self._lock:
            self.wait_ready()
            yield

    def _parts(self, samples: Sequence[TrainSample]) -> list[list[int]]:
        """Each data-parallel rank's samples (a prompt's together where the trainer shares prompts)."""
        return split_by_tokens(samples, self.dp_size, keep_prompts=shares_prompts(self.cfg))

    def _shards(self, samples: Sequence[TrainSample]) -> list[list[TrainSample]]:
        parts = self._parts(samples)
        return [[samples[i] for i in parts[r["dp_rank"]]] for r in self.ranks]

    def _call(self, method: str, samples: Sequence[TrainSample], *args: Any) -> list[Any]:
        import ray

        shards = self._shards(samples)
        with self._collective():
            return ray.get([getattr(w, method).remote(s, *args) for w, s in zip(self.workers, shards)])

    def train_step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        return self._call("train_step", samples)[0]

    def sft_step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        return self._call("sft_step", samples)[0]

    def logprobs(self, samples: Sequence[TrainSample]) -> list[Any]:
        """Per-sample logprobs of the loss-masked tokens under the current weights, in the
        order of `samples` (each DP group scores its share)."""
        import ray

        parts = self._parts(samples)
        with self._collective():
            outs = ray.get([w.logprobs.remote([samples[i] for i in parts[r["dp_rank"]]])
                            for w, r in zip(self.workers, self.ranks)])
        result: list[Any] = [None] * len(samples)
        for out, r in zip(outs, self.ranks):
            if out is not None:
                for i, lp in zip(parts[r["dp_rank"]], out):
                    result[i] = lp
        return result

    def sync_weights(self, engine_actors: Sequence[Any], *, bucket_bytes: int, weight_version: str | None = None,
                     reset_links: bool = False, api_key: str | None = None) -> int:
        """Push the current weights to the engines (see TrainerWorker.sync_weights);
        `reset_links`: an engine behind one of the URLs was restarted; `api_key`: the run's
        engine key."""
        import ray

        with self._collective():
            return ray.get([w.sync_weights.remote(list(engine_actors), bucket_bytes, weight_version, reset_links,
                                                  api_key) for w in self.workers])[0]

    def sync_phases(self) -> dict[str, float]:
        """Rank 0's phases of the last sync (TrainerWorker.sync_phases): the rank that talks to
        the engines."""
        import ray

        return ray.get(self.workers[0].sync_phases.remote())

    def offload(self) -> dict[str, float]:
        """Every rank's weights, gradients and optimizer state leave its GPU (colocated
        engines generate meanwhile); returns rank 0's figures."""
        import ray

        with self._collective():
            return ray.get([w.offload.remote() for w in self.workers])[0]

    def onload(self) -> dict[str, float]:
        import ray

        with self._collective():
            return ray.get([w.onload.remote() for w in self.workers])[0]

    def stage(self) -> dict[str, float]:
        """Every rank starts copying out what its next offload moves, on a side stream, while
        the weight sync runs (`trainer.offload_overlap`); returns rank 0's figures."""
        import ray

        with self._collective():
            return ray.get([w.stage.remote() for w in self.workers])[0]

    def trim(self) -> dict[str, float]:
        """Every rank gives torch's cached free blocks back to its GPU (colocated engines take
        memory next while the trainer stays); returns rank 0's figures."""
        import ray

        with self._collective():
            return ray.get([w.trim.remote() for w in self.workers])[0]

    def profile_start(self) -> None:
        """Every rank starts its torch.profiler trace (`vlmrl.training.profile`)."""
        import ray

        ray.get([w.profile_start.remote() for w in self.workers])

    def profile_stop(self, out_dir: Path) -> None:
        """Every rank stops its trace and writes it under `out_dir`."""
        import ray

        ray.get([w.profile_stop.remote(str(out_dir)) for w in self.workers])

    def start_rl_schedule(self, steps: int) -> float:
        """Every rank switches to the RL phase's learning-rate schedule (`trainer.optim.rl_lr`);
        returns the rate of the next step."""
        import ray

        with self._collective():
            return ray.get([w.start_rl_schedule.remote(steps) for w in self.workers])[0]

    def set_reference_to_policy(self) -> None:
        """Every rank's reference model (the KL term's) takes the policy's current weights."""
        import ray

        with self._collective():
            ray.get([w.set_reference_to_policy.remote() for w in self.workers])

    def memory_stats(self) -> list[dict[str, float]]:
        """Each rank's device memory now, in rank order."""
        import ray

        with self._collective():
            return ray.get([w.memory_stats.remote() for w in self.workers])

    def export_hf(self) -> dict[str, Any]:
        import ray

        with self._collective():
            return next(sd for sd in ray.get([w.export_hf.remote() for w in self.workers]) if sd is not None)

    def save(self, path: str, extra: dict[str, Any]) -> dict[str, float]:
        """Save a checkpoint on every rank; returns the figures of the rank whose host memory
        peaked highest (`vlmrl.training.checkpoint.save_checkpoint`)."""
        import ray

        with self._collective():
            figures = ray.get([w.save.remote(path, extra) for w in self.workers])
        return max(figures, key=lambda f: f["host_rss_peak_bytes"])

    def load(self, path: str) -> dict[str, Any]:
        import ray

        with self._collective():
            return ray.get([w.load.remote(path) for w in self.workers])[0]

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w)
        self._store = None  # the rendezvous closes with its last rank

