"""How a trainer rank's weights reach engines that speak SGLang's weight-sync protocol: one
class per transport, chosen once per set of engines (`weight_transport`).

- `ColocatedTransport`: trainer and engines share devices. Every trainer rank that shares a
  device with an engine rank serializes its own copy of each bucket (one CUDA IPC handle to a
  flattened copy on its GPU; host bytes on CPU), rank 0 gathers them and posts each engine one
  payload per TP rank (`/update_weights_from_tensor`), from the trainer rank on that rank's
  device. SGLang servers started with vlmrl's weight loader (`rollout.sglang.weight_loader`,
  `vlmrl/rollout/sglang_plugin`) get each layer's routed experts as one tensor, which that
  loader copies whole, and the bucket as (name, view) pairs rather than SGLang's flattened
  form (a custom loader takes pairs). Every rank keeps its copy alive until the engines have
  read it; the engines load one bucket while the ranks prepare the next (two buckets' copies
  alive at most).
- `BroadcastTransport`: engines on devices of their own. Rank 0 and every engine rank form a
  broadcast group (NCCL; gloo on CPU) and rank 0 broadcasts each bucket
  (`/update_weights_from_distributed`).

Both: every rank takes part in gathering the HF-named buckets (collective); rank 0 holds the
engines' clients; where the engines' release has weight-update sessions, one wraps the sync;
the last bucket flushes the engines' caches and carries the weight version the engines then
report with every sample.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from ..config.layout import Layout
from ..config.schema import VlmrlConfig
from ..rollout import sglang_plugin
from ..rollout import weights as wt
from ..rollout.client import HTTPEngine

Bucket = list[tuple[str, Any]]  # (HF name, tensor)


class WeightTransport(ABC):
    """One trainer rank's side of the sync to a fixed list of engines (`urls`). Made once and
    kept across syncs; `close` leaves the engines (a restarted engine or new URLs: make another)."""

    def __init__(self, cfg: VlmrlConfig, rank: int, urls: Sequence[str], *, tensor_format: str | None,
                 api_key: str | None, ipc_loader: str | None = None) -> None:
        self.cfg = cfg
        self.rank = rank
        self.urls = list(urls)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.engines: list[HTTPEngine] = []
        # each layer's routed experts as one tensor (the engines' loader copies it whole)
        self.fused_experts = ipc_loader is not None
        if rank == 0:
            tp = cfg.rollout.gpus_per_engine if cfg.rollout.name == "sglang" else 1
            self.loop = asyncio.new_event_loop()
            self.engines = [HTTPEngine(u, name=f"engine-{i}", tensor_format=tensor_format, tp_size=tp, api_key=api_key,
                                       ipc_loader=ipc_loader)
                            for i, u in enumerate(self.urls)]
        # host seconds of the last sync by phase, and its bucket count
        self.last_phases: dict[str, float] = {}

    def wants_compact(self, compact_views: bool) -> bool:
        """Whether the buckets must hold each tensor in storage of its own: payloads other
        than a flattened IPC copy need it; `compact_views` asks for it anyway."""
        return True

    # ------------------------------------------------------------ the sync
    def send(self, buckets: Iterable[Bucket], weight_version: str | None) -> int:
        """Every bucket to every engine (collective over the trainer ranks); returns the bytes
        sent to each engine (rank 0; 0 elsewhere)."""
        phases = dict.fromkeys(("gather_convert", "serialize", "engines", "barrier"), 0.0)
        clock = time.perf_counter()

        def lap(phase: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            phases[phase] += now - clock
            clock = now

        self._agree(_caught(self._open_session))
        count = sent = 0
        failed: BaseException | None = None
        try:
            try:
                for bucket, last in wt.with_last(buckets):
                    lap("gather_convert")
                    count += 1
                    self._send_bucket(bucket, last=last, version=weight_version if last else None, lap=lap)
                    if self.rank == 0:
                        sent += sum(t.numel() * t.element_size() for _, t in bucket)
                self._settle(lap)
            except Exception as e:  # noqa: BLE001 - agreed below, then raised on every rank
                failed = e
        finally:
            self._abandon()
            closed = _caught(self._close_session)
        # rank 0's failure (or, after a good sync, its session's failure to close) on every rank
        self._agree(failed or closed)
        self.last_phases = {**{f"{k}_s": v for k, v in phases.items()}, "buckets": count}
        return sent

    def _agree(self, error: BaseException | None) -> None:
        """Rank 0's outcome on every rank (collective over the trainer ranks): rank 0 alone
        talks to the engines, so where its call failed every rank raises, with rank 0's error,
        instead of waiting in the next collective for a rank that has left the sync."""
        message = None if error is None else f"{type(error).__name__}: {error}"
        if dist.is_initialized() and dist.get_world_size() > 1:
            # one integer per bucket on the sync's path; the message travels only on failure
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
            failed = torch.tensor([int(message is not None)], dtype=torch.int32, device=device)
            dist.broadcast(failed, src=0)
            if failed.item():
                box = [message]
                dist.broadcast_object_list(box, src=0)
                message = box[0]
        if error is not None:
            raise error
        if message is not None:
            raise RuntimeError(f"weight sync failed on trainer rank 0: {message}")

    @abstractmethod
    def _send_bucket(self, bucket: Bucket, *, last: bool, version: str | None, lap: Callable[[str], None]) -> None:
        """Send one bucket (`last`: it flushes the engines' caches and carries `version`)."""

    def _settle(self, lap: Callable[[str], None]) -> None:
        """Wait for whatever is still in flight (pipelined transports; nothing here)."""
        return None

    def _abandon(self) -> None:
        """A sync that failed midway: let anything in flight end first (nothing here)."""
        return None

    # ------------------------------------------------------------ sessions and links
    def _each(self, method: str) -> list[Any]:
        async def call() -> list[Any]:
            return await asyncio.gather(*(getattr(e, method)() for e in self.engines), return_exceptions=True)

        return self.loop.run_until_complete(call())

    def _open_session(self) -> None:
        if self.rank != 0:
            return
        failed = [e for e in self._each("begin_weight_update") if isinstance(e, BaseException)]
        if failed:
            self._each("end_weight_update")
            raise failed[0]

    def _close_session(self) -> None:
        """Closed whatever happened; its own failure only counts after a good sync (`send`
        raises it then)."""
        if self.rank != 0:
            return
        failed = [e for e in self._each("end_weight_update") if isinstance(e, BaseException)]
        if failed:
            raise failed[0]

    def close(self) -> None:
        """Forget the engines' clients (best effort on engines that may be gone)."""
        if self.rank != 0:
            return

        async def leave() -> None:
            await asyncio.gather(*(e.close() for e in self.engines), return_exceptions=True)

        self.loop.run_until_complete(leave())
        self.loop.close()
        self.engines = []


def _caught(call: Callable[[], Any]) -> BaseException | None:
    """What `call` raised, or None."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - handed to every rank by `_agree`
        return e
    return None


class ColocatedTransport(WeightTransport):
    """Payloads by reference from the ranks that share devices with the engines (CUDA IPC on
    GPUs, host bytes on CPU), posted by rank 0 while the ranks prepare the next bucket."""

    def __init__(self, cfg: VlmrlConfig, rank: int, urls: Sequence[str], layout: Layout, *,
                 api_key: str | None) -> None:
        fmt = "ipc" if cfg.hardware.device == "cuda" else "torch_save"
        # SGLang servers started with vlmrl's loader (`rollout.sglang.weight_loader=vlmrl`)
        # take (name, tensor) pairs with fused experts; others, flattened buckets
        loader = (sglang_plugin.LOADER if fmt == "ipc" and cfg.rollout.name == "sglang"
                  and cfg.rollout.sglang.weight_loader == "vlmrl" else None)
        super().__init__(cfg, rank, urls, tensor_format=fmt, api_key=api_key, ipc_loader=loader)
        self.format = fmt
        self.loader = loader
        tp = cfg.rollout.gpus_per_engine if cfg.rollout.name == "sglang" else 1
        self.sources = wt.payload_sources(layout.trainer_devices, layout.rollout_device_offset, len(self.urls), tp)
        self.senders = {r for ranks in self.sources for r in ranks}
        self._post_thread: ThreadPoolExecutor | None = None  # rank 0: runs the event loop's posts
        # (rank 0's post, this rank's copies) of the bucket the engines are loading
        self._inflight: tuple[Future | None, list[Any]] | None = None

    def wants_compact(self, compact_views: bool) -> bool:
        return self.format != "ipc" or compact_views

    def close(self) -> None:
        if self._post_thread is not None:
            self._post_thread.shutdown(wait=True)
            self._post_thread = None
        super().close()

    def _send_bucket(self, bucket: Bucket, *, last: bool, version: str | None, lap: Callable[[str], None]) -> None:
        alive: list[Any] = []  # this rank's flattened copy, until the engines have read it
        mine = (wt.serialize_payload(bucket, self.format, keep=alive, flattened=self.loader is None)
                if self.rank in self.senders else None)
        per_engine = wt.gather_rank_payloads(mine, self.sources)
        lap("serialize")
        # before bucket k+1 is posted the engines must have answered for bucket k (the last
        # bucket flushes and carries the version), and only then may the ranks drop bucket k
        self._settle(lap)
        post = None
        if per_engine is not None:  # rank 0
            async def send() -> None:
                await asyncio.gather(*(e.update_weights_from_serialized(payloads, flush_cache=last, weight_version=version)
                                       for e, payloads in zip(self.engines, per_engine)))

            if self._post_thread is None:
                self._post_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-post")
            post = self._post_thread.submit(self.loop.run_until_complete, send())
        self._inflight = (post, alive)

    def _settle(self, lap: Callable[[str], None]) -> None:
        if self._inflight is None:
            return
        post, alive = self._inflight
        self._inflight = None
        failed = _caught(post.result) if post is not None else None
        lap("engines")
        # rank 0's word that the engines have read every rank's copy (the bucket may go), or
        # its error on every rank
        self._agree(failed)
        alive.clear()
        lap("barrier")

    def _abandon(self) -> None:
        if self._inflight is not None and self._inflight[0] is not None:
            self._inflight[0].exception()
        self._inflight = None


class BroadcastTransport(WeightTransport):
    """Rank 0 broadcasts each bucket to every engine rank over a group they all join."""

    def __init__(self, cfg: VlmrlConfig, rank: int, urls: Sequence[str], *, api_key: str | None, host: str) -> None:
        # SGLang takes the broadcast only (its unpickler refuses torch.save payloads)
        fmt = "torch_save" if cfg.rollout.name == "embedded" else None
        super().__init__(cfg, rank, urls, tensor_format=fmt, api_key=api_key)
        self.group: Any = None
        if rank == 0:
            self.group = self.loop.run_until_complete(wt.init_weights_update_group_all(
                self.engines, host, backend=cfg.hardware.dist_backend))

    def _send_bucket(self, bucket: Bucket, *, last: bool, version: str | None, lap: Callable[[str], None]) -> None:
        failed = None
        if self.rank == 0:
            failed = _caught(lambda: self.loop.run_until_complete(wt.update_weights_distributed(
                self.engines, self.group, bucket, bucket_bytes=None, weight_version=version, final=last)))
            lap("engines")
        # rank 0's outcome before the next bucket: the other ranks gather it with rank 0 (TP, EP),
        # and would wait there for a rank 0 that left the sync
        self._agree(failed)
        lap("barrier")

    def close(self) -> None:
        """Leave the broadcast group (a restarted engine starts without it), then the clients."""
        if self.rank == 0 and self.group is not None:
            async def leave() -> None:
                await asyncio.gather(*(e.destroy_weights_update_group() for e in self.engines), return_exceptions=True)

            self.loop.run_until_complete(leave())
            wt.destroy_update_group(self.group)
            self.group = None
        super().close()


def weight_transport(cfg: VlmrlConfig, rank: int, urls: Sequence[str], layout: Layout, *, api_key: str | None,
                     host: str) -> WeightTransport:
    """The transport for these engines: colocated (shared devices) or broadcast."""
    if cfg.cluster.colocate:
        return ColocatedTransport(cfg, rank, urls, layout, api_key=api_key)
    return BroadcastTransport(cfg, rank, urls, api_key=api_key, host=host)
