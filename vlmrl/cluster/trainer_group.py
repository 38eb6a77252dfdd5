"""The trainer as a group of Ray actors, one per Megatron rank.

Ranks rendezvous over torch.distributed (gloo on CPU, NCCL on GPUs) at an address chosen
by rank 0. The driver hands each rank its data-parallel share of a global batch (ranks
with the same DP coordinate get the same samples) and calls the ranks together, since
every step is collective. Weight sync runs inside the ranks: all of them take part in
gathering the HF-named buckets, and global rank 0 pushes each bucket to every engine.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import Any

from ..config.layout import compute_layout
from ..config.schema import VlmrlConfig
from ..training.batch import TrainSample, split_by_tokens
from .placement import Placement


class TrainerWorker:
    """Ray actor body: one Megatron rank."""

    def __init__(self, cfg: VlmrlConfig, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
        from ..logging.console import quiet_from_env

        quiet_from_env()
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=master_addr,
                          MASTER_PORT=str(master_port), LOCAL_RANK="0")
        self.cfg = cfg
        self.rank = rank
        self.trainer: Any = None

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
                "pp_rank": i.pp_rank, "cp_rank": i.cp_rank}

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        return self.trainer.train_step(samples)

    def sft_step(self, samples: list[TrainSample]) -> dict[str, float]:
        return self.trainer.sft_step(samples)

    def logprobs(self, samples: list[TrainSample]) -> list[Any] | None:
        return self.trainer.logprobs(samples)

    def sync_weights(self, engines: Sequence[Any], bucket_bytes: int, weight_version: str | None = None) -> int:
        """Gather the weights (collective) and, on global rank 0, push every bucket to every
        engine: embedded engine actors (Ray handles) or SGLang servers (URLs). Returns the
        number of bytes sent per engine."""
        import ray

        if engines and isinstance(engines[0], str):
            return self._sync_sglang(list(engines), bucket_bytes, weight_version)
        sent = 0
        for bucket in self.trainer.iter_hf_weights(bucket_bytes):
            if self.rank == 0:
                payload = [(n, t.detach().cpu()) for n, t in bucket]
                ray.get([e.update_weights_from_tensor.remote(payload, None, False, None) for e in engines])
                sent += sum(t.numel() * t.element_size() for _, t in payload)
        if self.rank == 0:
            ray.get([e.update_weights_from_tensor.remote([], None, True, weight_version) for e in engines])
        return sent

    def _sync_sglang(self, urls: list[str], bucket_bytes: int, weight_version: str | None) -> int:
        """SGLang: colocated engines read rank 0's GPU tensors through CUDA IPC handles
        (/update_weights_from_tensor); engines on their own GPUs receive an NCCL broadcast
        from rank 0 (/init_weights_update_group once, then /update_weights_from_distributed)."""
        import asyncio

        from ..rollout import weights as sg
        from ..rollout.client import HTTPEngine

        colocate = self.cfg.cluster.colocate
        if self.rank == 0 and getattr(self, "_http", None) is None:
            self._loop = asyncio.new_event_loop()
            fmt = "ipc" if colocate else "torch_save"
            self._http = [HTTPEngine(u, name=f"sglang-{i}", tensor_format=fmt,
                                     tp_size=self.cfg.rollout.gpus_per_engine) for i, u in enumerate(urls)]
            self._group = None
            if not colocate:
                self._group = self._loop.run_until_complete(sg.init_weights_update_group_all(
                    self._http, self.node_ip(), _free_port()))
        sent = 0
        for bucket in self.trainer.iter_hf_weights(bucket_bytes):
            if self.rank != 0:
                continue
            if colocate:
                calls = [e.update_weights_from_tensor(bucket, flush_cache=False) for e in self._http]
                self._loop.run_until_complete(asyncio.gather(*calls))
            else:
                self._loop.run_until_complete(sg.update_weights_distributed(self._http, self._group, bucket,
                                                                            bucket_bytes=None))
            sent += sum(t.numel() * t.element_size() for _, t in bucket)
        if self.rank == 0:
            self._loop.run_until_complete(asyncio.gather(*(e.flush_cache() for e in self._http)))
        return sent

    def export_hf(self) -> dict[str, Any] | None:
        from ..models import adapters

        sd = adapters.export_hf_state_dict(self.trainer.chunks, self.cfg.model)
        return sd if self.rank == 0 else None

    def save(self, path: str, extra: dict[str, Any]) -> None:
        from ..training.checkpoint import save_checkpoint

        save_checkpoint(self.trainer, path, extra)

    def load(self, path: str) -> dict[str, Any]:
        from ..training.checkpoint import load_checkpoint

        return load_checkpoint(self.trainer, path)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class TrainerGroup:
    """The driver's handle on all trainer ranks."""

    def __init__(self, cfg: VlmrlConfig, model_path: str, *, total_steps: int, placement: Placement) -> None:
        import ray

        self.cfg = cfg
        layout = compute_layout(cfg)
        self.world_size = layout.trainer_world_size
        on_gpu = layout.on_gpu
        # On GPUs each rank owns one GPU; colocated engines take a share of the same GPUs.
        gpus = 0.5 if on_gpu and cfg.cluster.colocate else (1.0 if on_gpu else 0.0)
        cls = ray.remote(TrainerWorker)

        def opts(rank: int) -> dict[str, Any]:
            return dict(num_cpus=cfg.cluster.cpus_per_actor, num_gpus=gpus,
                        scheduling_strategy=placement.strategy(placement.trainer_bundles[rank]))

        port = _free_port()
        first = cls.options(**opts(0)).remote(cfg, 0, self.world_size, "127.0.0.1", port)
        addr = ray.get(first.node_ip.remote()) if cfg.cluster.num_nodes > 1 else "127.0.0.1"
        if addr != "127.0.0.1":
            ray.kill(first)
            first = cls.options(**opts(0)).remote(cfg, 0, self.world_size, addr, port)
        self.workers = [first] + [cls.options(**opts(r)).remote(cfg, r, self.world_size, addr, port)
                                  for r in range(1, self.world_size)]
        self.ranks = ray.get([w.init.remote(model_path, total_steps) for w in self.workers])
        self.dp_size = self.ranks[0]["dp_size"]

    def _shards(self, samples: Sequence[TrainSample]) -> list[list[TrainSample]]:
        parts = split_by_tokens(samples, self.dp_size)
        return [[samples[i] for i in parts[r["dp_rank"]]] for r in self.ranks]

    def _call(self, method: str, samples: Sequence[TrainSample], *args: Any) -> list[Any]:
        import ray

        shards = self._shards(samples)
        return ray.get([getattr(w, method).remote(s, *args) for w, s in zip(self.workers, shards)])

    def train_step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        return self._call("train_step", samples)[0]

    def sft_step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        return self._call("sft_step", samples)[0]

    def logprobs(self, samples: Sequence[TrainSample]) -> list[Any]:
        """Per-sample logprobs of the loss-masked tokens under the current weights, in the
        order of `samples` (each DP group scores its share)."""
        import ray

        parts = split_by_tokens(samples, self.dp_size)
        outs = ray.get([w.logprobs.remote([samples[i] for i in parts[r["dp_rank"]]])
                        for w, r in zip(self.workers, self.ranks)])
        result: list[Any] = [None] * len(samples)
        for out, r in zip(outs, self.ranks):
            if out is not None:
                for i, lp in zip(parts[r["dp_rank"]], out):
                    result[i] = lp
        return result

    def sync_weights(self, engine_actors: Sequence[Any], *, bucket_bytes: int, weight_version: str | None = None) -> int:
        import ray

        return ray.get([w.sync_weights.remote(list(engine_actors), bucket_bytes, weight_version)
                        for w in self.workers])[0]

    def export_hf(self) -> dict[str, Any]:
        import ray

        return next(sd for sd in ray.get([w.export_hf.remote() for w in self.workers]) if sd is not None)

    def save(self, path: str, extra: dict[str, Any]) -> None:
        import ray

        ray.get([w.save.remote(path, extra) for w in self.workers])

    def load(self, path: str) -> dict[str, Any]:
        import ray

        return ray.get([w.load.remote(path) for w in self.workers])[0]

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w)
