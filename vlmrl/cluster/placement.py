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
    return Placement(group, trainer, engines)
