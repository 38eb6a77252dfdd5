"""Placement groups: one bundle per device, trainer ranks and engines pinned to bundles.

GPUs: `cluster.num_gpus` bundles of {GPU: 1, CPU: 1} packed per node; trainer rank r sits
on the bundle of its GPU (`Layout.trainer_devices`), an engine on the bundle of its first
GPU. Colocated actors share a bundle (fractional GPU requests); in separate mode the
engines' bundles follow the trainer's. CPU: one {CPU: cpus_per_actor} bundle per actor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config.layout import Layout
from ..config.schema import VlmrlConfig


@dataclass
class Placement:
    group: Any  # ray.util.placement_group.PlacementGroup
    trainer_bundles: list[int]  # bundle of each trainer rank
    engine_bundles: list[int]  # bundle of each engine
    layout: Layout | None = None  # the layout the bundles were cut from: the run's one computation of it
    # GPU layouts: the GPU Ray gave each bundle, as Ray names it (the node's CUDA_VISIBLE_DEVICES
    # entry: "4" where Ray's node was started with CUDA_VISIBLE_DEVICES=4,5); a process started
    # outside Ray on a bundle's GPU (an SGLang server) takes these, not the layout's indices
    bundle_gpus: list[str] | None = None

    def strategy(self, bundle: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.group, placement_group_bundle_index=bundle)


def bundles(cfg: VlmrlConfig, layout: Layout) -> tuple[list[dict[str, float]], list[int], list[int]]:
    """(bundles, trainer rank -> bundle, engine -> bundle): pure, for tests and the plan."""
    if layout.on_gpu:
        spec = [{"GPU": 1.0, "CPU": 1.0} for _ in range(cfg.cluster.num_gpus)]
        trainer = list(layout.trainer_devices)
        engines = [layout.rollout_device_offset + i * cfg.rollout.gpus_per_engine for i in range(layout.num_engines)]
        return spec, trainer, engines
    cpus = cfg.cluster.cpus_per_actor
    n = layout.trainer_world_size
    spec = [{"CPU": cpus} for _ in range(n + layout.num_engines)]
    return spec, list(range(n)), list(range(n, n + layout.num_engines))


def create_placement(cfg: VlmrlConfig, layout: Layout, *, timeout_s: float = 600.0) -> Placement:
    import ray
    from ray.util.placement_group import placement_group

    spec, trainer, engines = bundles(cfg, layout)
    group = placement_group(spec, strategy="PACK", name="")
    ray.get(group.ready(), timeout=timeout_s)
    placement = Placement(group, trainer, engines, layout)
    if layout.on_gpu:
        placement.bundle_gpus = bundle_gpu_ids(placement, len(spec), timeout_s=timeout_s)
    return placement


def bundle_gpu_ids(placement: Placement, count: int, *, timeout_s: float = 120.0) -> list[str]:
    """The GPU Ray gave each of the first `count` bundles (one each), read by a task that takes a
    sliver of the bundle's GPU: Ray's names for them, which are the node's CUDA_VISIBLE_DEVICES
    entries, not 0..n-1, where the node was started on some of its GPUs."""
    import ray

    @ray.remote(num_cpus=0, num_gpus=0.01)
    def gpu_ids() -> list[str]:
        return [str(i) for i in ray.get_gpu_ids()]

    found = ray.get([gpu_ids.options(scheduling_strategy=placement.strategy(b)).remote() for b in range(count)],
                    timeout=timeout_s)
    for b, ids in enumerate(found):
        if len(ids) != 1:
            raise RuntimeError(f"placement bundle {b} holds GPUs {ids} in Ray, not one")
    return [ids[0] for ids in found]


def available_cores() -> int:
    """CPU cores this process may use: its affinity mask, capped by a cgroup v2 CPU quota."""
    import math
    import os
    from pathlib import Path

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(cores, 1)


def cpu_threads(cfg: VlmrlConfig, role: str, cores: int) -> int | None:
    """torch threads of a CPU actor (`role` "trainer" or "engine"); None on GPUs.

    `cluster.cpu_threads` when set; else the cores divided among the actors that compute
    at the same moment: the trainer ranks together while training, the engine alone while
    generating, and all of them at once with `cluster.async_rollout`. (Ray would give an
    actor with a fractional CPU request one thread.)
    """
    if role not in ("trainer", "engine"):
        raise ValueError(f"role must be 'trainer' or 'engine', got {role!r}")
    if cfg.hardware.device != "cpu":
        return None
    if cfg.cluster.cpu_threads:
        return int(cfg.cluster.cpu_threads)
    ranks = max(cfg.cluster.num_cpu_ranks, 1)
    busy = ranks + 1 if cfg.cluster.async_rollout else (ranks if role == "trainer" else 1)
    return max(1, cores // busy)
