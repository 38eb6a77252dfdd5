"""The engines' copy of the policy: which weight version they hold, the syncs that send them
the trainer's weights (a restarted engine's included), and, colocated, the memory phase each
sync or generation needs (`vlmrl.cluster.colocation`). The loop hands in the trainer group and
the engine group it started; this keeps what the engines hold."""

from __future__ import annotations

import time
from typing import Any

from ..config.schema import VlmrlConfig


class EngineWeights:
    def __init__(self, cfg: VlmrlConfig) -> None:
        self.bucket_bytes = max(int(cfg.rollout.weight_update_bucket_mb), 1) << 20
        self.colo: Any = None  # vlmrl.cluster.colocation.Colocation when engines and trainer share GPUs
        self.version: str | None = None  # the weight_version last synced to the engines
        self.trained = False  # the trainer took an optimizer step since that sync
        self.last_bytes = 0  # bytes the last sync sent each engine
        self.last_phases: dict[str, float] = {}  # rank 0's transport phases of the last sync
        self.restarts = 0  # engines restarted because their process died in a sync (`take_restarts`)

    def phase(self, name: str, trainer: Any, group: Any) -> None:
        """Colocated: move device memory to phase `name`. Before generating, engines that came
        back from a restart in a memory move get the trainer's weights."""
        if self.colo is None:
            return
        if name == "generate" and self.colo.weights_stale and self.version is not None:
            self.sync(self.version + "+", trainer, group, reset_links=group.http)
        self.colo.to(name)

    def need_trainer(self) -> None:
        """The trainer's state on the GPU (checkpoints, exports), unless it is there already: as
        for a sync, so the engines keep their weights (released ones would need a sync again)."""
        if self.colo is not None and not self.colo.now.trainer:
            self.colo.to("sync")

    def sync(self, version: str, trainer: Any, group: Any, *, reset_links: bool = False) -> float:
        """The trainer's weights to every engine of `group`, as `version`; its seconds
        (`reset_links`: an engine behind a URL was restarted, so the transport's links are new)."""
        self.phase("sync", trainer, group)
        t0 = time.perf_counter()
        def send(reset: bool) -> Any:
            return trainer.sync_weights(group.sync_targets, bucket_bytes=self.bucket_bytes, weight_version=version,
                                        reset_links=reset, api_key=group.key)

        try:
            sent = send(reset_links)
        except Exception as err:
            # every trainer rank raised rank 0's error (the transport agrees on it); an engine
            # whose process died in the sync is restarted and the whole sync sent again, once
            dead = group.restart_dead()
            if not dead:
                raise
            print(f"engine(s) {dead} died in the weight sync ({type(err).__name__}: {err}); restarted, syncing again",
                  flush=True)
            self.restarts += len(dead)
            sent = send(group.http)
        self.last_bytes = int(sent or 0)
        seconds = time.perf_counter() - t0
        self.last_phases = trainer.sync_phases()  # read after the clock: not part of the sync
        self.version = version  # every sample generated from now on should report it
        self.trained = False
        if self.colo is not None:
            self.colo.synced()
        return seconds

    def take_moves(self) -> dict[str, float] | None:
        """Colocated: the seconds of the memory moves since the last call, by kind and by phase
        entered (`Colocation.take_seconds`); None where nothing is colocated."""
        return self.colo.take_seconds() if self.colo is not None else None

    def take_restarts(self) -> int:
        """Engines restarted since the last call: in a sync, and (colocated) in a memory move."""
        out, self.restarts = self.restarts, 0
        return out + (self.colo.take_restarts() if self.colo is not None else 0)

    def resync_restarted(self, i: int, trainer: Any, group: Any) -> None:
        """Give restarted engine `i` the trainer's current weights, so the retried requests are
        sampled from the policy being trained."""
        if self.version is None:
            return  # nothing synced yet: the checkpoint it loaded is the trainer's starting point
        targets = group.sync_targets if group.http else [group.sync_targets[i]]
        offloaded = self.colo is not None and not self.colo.now.trainer
        if offloaded:
            # the new server holds all its memory: it gives back its KV cache and graphs while
            # the trainer comes back on the GPU to send it the current weights (the other engines
            # keep theirs: with several colocated engines the onload needs room beside them)
            group.call("release_memory_occupation", ["kv_cache", "cuda_graph"], only=i)
            trainer.onload()
        trainer.sync_weights(targets, bucket_bytes=self.bucket_bytes, weight_version=self.version
                             + ("+" if self.trained else ""), reset_links=group.http, api_key=group.key)
        if offloaded:
            trainer.offload()
            group.call("resume_memory_occupation", ["cuda_graph", "kv_cache"], only=i)
