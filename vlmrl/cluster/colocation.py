"""Who holds the GPUs' memory when trainer and engines share them.

A colocated step moves through phases, each with its own tenants:

    generate  the engines hold everything (weights, KV cache, CUDA graphs); the trainer's
              weights, gradients and optimizer state are offloaded (`trainer.offload`)
    train     the engines are released; the trainer is on the GPU (logprob recompute, the
              optimizer steps, checkpoints)
    sync      the trainer is on the GPU and the engines hold their weights only, which the
              sync overwrites; KV cache and CUDA graphs come back after it, once the sync's
              buffers are gone. With offload the trainer's state starts copying out to the
              host as the step enters this phase (`stage`): the sync only reads it

An engine whose process dies in a release or resume is restarted by the engine group, which
makes it hold what the others hold; it comes back with the start checkpoint's weights, so the
engines count as stale until the next sync, which the loop makes before they generate.

With `cluster.release_engines=false` (`stay`) the engines keep everything and the trainer
stays through every phase: a step moves nothing but the weights the sync sends, and the
trainer trims its cached activations when training ends.

`plan(now, target)` is the pure part: the calls that move from one residency to another, the
ones that free memory first (engine releases, the trainer's offload, and a trim: the trainer
gives torch's cached free blocks back to the device where it stays while engines take memory),
then the ones that take it (the trainer's onload, engine resumes). `Colocation` carries them out on the engines and the
trainer group and keeps the current residency. Without colocation nothing moves.

Released weights are not kept (SGLang frees them without a copy): from a release of the
engines' weights until the next sync (`synced`), entering `generate` is refused. So whatever
needs the trainer on the GPU between a sync and the next rollout (a checkpoint) goes to `sync`,
which keeps the engines' weights, not to `train`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..rollout.protocol import MEMORY_TAGS


@dataclass(frozen=True)
class Residency:
    """What holds device memory: the engines' resident memory tags and whether the trainer's
    state is on the GPU."""

    engine: frozenset[str]
    trainer: bool


ALL_TAGS = frozenset(MEMORY_TAGS)
PHASES: dict[str, Residency] = {
    "generate": Residency(ALL_TAGS, trainer=False),
    "train": Residency(frozenset(), trainer=True),
    "sync": Residency(frozenset({"weights"}), trainer=True),
}
# the order engines take tags back in: weights first (a sync writes into them), then the rest
RESUME_ORDER = ("weights", "cuda_graph", "kv_cache")


def phase(name: str, *, offload: bool, stay: bool = False) -> Residency:
    """The residency of phase `name`; without offload the trainer never leaves the GPU, and
    engines that `stay` never give anything back (the trainer then stays too)."""
    if name not in PHASES:
        raise ValueError(f"unknown phase {name!r}; phases: {sorted(PHASES)}")
    if stay:
        if offload:
            raise ValueError("engines that keep their memory leave the trainer no room to gain by offloading")
        return Residency(ALL_TAGS, trainer=True)
    r = PHASES[name]
    return r if offload else Residency(r.engine, trainer=True)


def plan(now: Residency, target: Residency, *, leaves_next: bool = False,
         after_training: bool = False) -> list[tuple[str, tuple[str, ...]]]:
    """The calls from `now` to `target`, in order: ("trim", ()), ("stage", ()), ("release", tags),
    ("offload", ()), ("onload", ()), ("resume", tags). Everything that frees
    memory comes before anything that takes it. A trim comes where the trainer stays on the GPU
    and engines take memory back (train -> sync; train -> generate without offload): what torch
    caches of the trainer's freed activations would otherwise sit beside the engines' weights
    and KV cache; and where it stays after training beside engines that kept everything
    (`after_training`): the next phases hold no training activations. The trim comes first: it
    returns blocks with cudaFree, which waits for all the device's work, a staged copy included.
    A stage comes next where the trainer stays but leaves at the phase after
    (`leaves_next`: train -> sync with offload): its state starts copying out while the engines
    resume and the sync runs, so that the offload after the sync waits only for the rest."""
    steps: list[tuple[str, tuple[str, ...]]] = []
    release = now.engine - target.engine
    resume = target.engine - now.engine
    if now.trainer and target.trainer and (resume or after_training):
        steps.append(("trim", ()))
    if leaves_next and now.trainer and target.trainer:
        steps.append(("stage", ()))
    if release:
        steps.append(("release", tuple(t for t in MEMORY_TAGS if t in release)))
    if now.trainer and not target.trainer:
        steps.append(("offload", ()))
    if target.trainer and not now.trainer:
        steps.append(("onload", ()))
    if resume:
        steps.append(("resume", tuple(t for t in RESUME_ORDER if t in resume)))
    return steps


@dataclass
class Colocation:
    """Carries out `plan` on the engines (`release(tags)` / `resume(tags)`, callables that
    reach every engine) and the trainer group (`offload()` / `onload()` / `trim()`), and times
    each kind of move and each whole move into a phase, `to_<phase>` (`seconds`, reset by
    `take_seconds`). The trainer starts a new window of its peak-memory statistics at each of
    its moves, so that a phase's measured peak begins where the phase's residency does
    (`vlmrl.config.memory.measured_phase_peak`)."""

    release: Callable[[tuple[str, ...]], Any]  # returns the engines it restarted (or None)
    resume: Callable[[tuple[str, ...]], Any]
    trainer: Any = None  # TrainerGroup; None until it exists (its state is then on the GPU)
    offload: bool = False
    stay: bool = False  # the engines keep their memory through the step (cluster.release_engines=false)
    now: Residency = field(default_factory=lambda: Residency(ALL_TAGS, trainer=False))
    at: str | None = None  # the phase moved to last
    seconds: dict[str, float] = field(default_factory=dict)
    moved_bytes: dict[str, float] = field(default_factory=dict)
    # the engines' weights were released since the last sync, or an engine restarted in a move
    # (it holds the start checkpoint's): they hold nothing usable
    weights_stale: bool = False
    # engines restarted because their process died in a release or resume (`release` and
    # `resume` return the indices of those they restarted)
    restarts: int = 0

    def to(self, name: str) -> None:
        """Move to phase `name` (a no-op when already there)."""
        target = phase(name, offload=self.offload, stay=self.stay)
        if self.trainer is None:  # the trainer has not started: only the engines move
            target = Residency(target.engine, trainer=self.now.trainer)
        if name == "generate" and self.weights_stale:
            raise RuntimeError("the engines' weights were released and not synced since: they would generate from "
                               "freed memory (sync the trainer's weights before the next rollout or eval)")
        # the trainer leaves the GPU after a sync (offload): its copy out can start now
        leaves_next = name == "sync" and self.offload and self.trainer is not None
        after_training = self.at == "train" and name != "train"
        self.at = name
        moves = plan(self.now, target, leaves_next=leaves_next, after_training=after_training)
        t_move = time.perf_counter()
        for kind, tags in moves:
            t0 = time.perf_counter()
            if kind == "release":
                restarted = self.release(tags)
                self.now = Residency(self.now.engine - set(tags), self.now.trainer)
                self.weights_stale = self.weights_stale or "weights" in tags or bool(restarted)
                self.restarts += len(restarted or ())
            elif kind == "resume":
                restarted = self.resume(tags)
                self.now = Residency(self.now.engine | set(tags), self.now.trainer)
                self.weights_stale = self.weights_stale or bool(restarted)
                self.restarts += len(restarted or ())
            else:
                figures = getattr(self.trainer, kind)()
                self.moved_bytes[kind] = self.moved_bytes.get(kind, 0.0) + float((figures or {}).get("bytes", 0))
                if kind not in ("trim", "stage"):
                    self.now = Residency(self.now.engine, trainer=kind == "onload")
            self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - t0
        if moves:  # the whole move into phase `name`, so a step's stages can be told from the moves inside them
            self.seconds[f"to_{name}"] = self.seconds.get(f"to_{name}", 0.0) + time.perf_counter() - t_move

    def synced(self) -> None:
        """The engines hold the trainer's weights again (a sync reached them)."""
        self.weights_stale = False

    def trainer_started(self) -> None:
        """The trainer group exists and holds its state on the GPU."""
        self.now = Residency(self.now.engine, trainer=True)

    def take_seconds(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out

    def take_restarts(self) -> int:
        out, self.restarts = self.restarts, 0
        return out
