"""The run's rollout engines, the twin of `TrainerGroup`: start, restart, release, resume, stop.

Either SGLang servers (one per engine, each in a Ray actor in its placement-group bundle,
launched by `vlmrl.rollout.sglang`) or embedded engines (Ray actors, called directly or over
SGLang's HTTP protocol with `rollout.embedded.serve_http`). Three views of them:

- `generation`: where rollouts send requests (SGLang's router when there is one);
- `admin`: every server, for memory, cache and weight calls;
- `sync_targets`: what the trainer's weight sync addresses (actors or URLs).

The group restarts an engine's process and points the clients at it; giving the new engine
the policy's current weights is the loop's part (`restart`'s `after`), since only the loop
knows which weights are current and where the trainer's state is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..config.layout import (
    embedded_engine_device,
    engine_batch_requests,
    engine_bind_host,
    returns_routed_experts,
)
from ..config.schema import VlmrlConfig
from ..rollout.manager import close_sessions, engine_answers
from ..rollout.protocol import MEMORY_TAGS
from .placement import Placement, available_cores, cpu_threads


class EngineGroup:
    def __init__(self, cfg: VlmrlConfig, placement: Placement, model_path: str, run_dir: Path) -> None:
        self.cfg = cfg
        self.placement = placement
        self.model_path = model_path
        self.run_dir = Path(run_dir)
        self.http = cfg.rollout.name == "sglang" or cfg.rollout.embedded.serve_http
        self.key: str | None = None  # the run's engine key (HTTP engines; vlmrl.rollout.auth)
        self.sglang: Any = None  # vlmrl.rollout.sglang.SGLangEngines
        self._embedded: list[Any] = []  # embedded engines' Ray actors
        self.generation: list[Any] = []
        self.admin: list[Any] = []
        self.sync_targets: list[Any] = []
        self.restarts = 0
        # the memory tags every engine holds (colocated moves: `release`, `resume`); a new
        # engine holds them all
        self.resident: set[str] = set(MEMORY_TAGS)

    # ------------------------------------------------------------ start and stop
    def start(self) -> None:
        cfg = self.cfg
        if self.http:
            from ..rollout.auth import run_key

            # every engine refuses callers without the run's key (kept out of the config)
            self.key = run_key(self.run_dir)
        if cfg.rollout.name == "sglang":
            from ..rollout.sglang import launch_sglang_engines

            layout = self.placement.layout
            assert layout is not None, "the placement carries the run's layout"
            self.sglang = asyncio.run(launch_sglang_engines(
                cfg.rollout, cfg.hardware, cfg.model, layout.engines(cfg), run_dir=self.run_dir,
                placement=self.placement, model_path=self.model_path, colocate=cfg.cluster.colocate,
                cpus_per_actor=cfg.cluster.cpus_per_actor, seed=cfg.seed, data=cfg.data,
                host=engine_bind_host(cfg), api_key=self.key, return_routed_experts=returns_routed_experts(cfg),
                batch_requests=engine_batch_requests(cfg)))
            print(f"SGLang {self.sglang.version}: {len(self.sglang.engines)} engine(s) at "
                  f"{', '.join(e.base_url for e in self.sglang.engines)}, healthy "
                  f"{', '.join(f'{t:.1f}' for t in self.sglang.start_seconds)} s after launch")
            self.generation = list(self.sglang.generation)  # the router when there is one
            self.admin = list(self.sglang.engines)
            self.sync_targets = [e.base_url for e in self.sglang.engines]
        else:
            import ray

            self._embedded = [self._new_embedded_actor(0)]
            where = ray.get(self._embedded[0].placement.remote())
            print(f"embedded engine on {where['device']} in {where['dtype']}")
            target, engine = self._embedded_endpoint(0)
            self.sync_targets, self.generation = [target], [engine]
            self.admin = self.generation

    def stop(self) -> None:
        """SGLang servers are processes of their actors: stop them before Ray goes down."""
        if self.sglang is not None:
            asyncio.run(self.sglang.shutdown())
            self.sglang = None

    @property
    def can_restart(self) -> bool:
        """A restart needs the engines themselves (not a router) to be the generation targets."""
        return self.generation == self.admin

    # ------------------------------------------------------------ embedded engines
    def _new_embedded_actor(self, i: int) -> Any:
        """Embedded engine i in its placement bundle: on that bundle's GPU (a share of it beside
        a colocated trainer rank, as an SGLang engine takes) in `model.dtype`, or on the host's
        CPU where the run has no GPUs or `rollout.embedded.device=cpu` says so."""
        from ..rollout.embedded import create_embedded_actor
        from ..rollout.sglang import engine_gpu_request

        cfg = self.cfg
        device = embedded_engine_device(cfg)
        gpus = engine_gpu_request(cfg.rollout, cfg.cluster.colocate) if device == "cuda" else 0.0
        return create_embedded_actor(
            self.model_path, num_cpus=cfg.cluster.cpus_per_actor, num_gpus=gpus, name=f"embedded-{i}",
            scheduling_strategy=self.placement.strategy(self.placement.engine_bundles[i]),
            torch_threads=cpu_threads(cfg, "engine", available_cores()), device=device,
            min_pixels=cfg.data.min_pixels, max_pixels=cfg.data.max_pixels, dtype=cfg.model.dtype,
            max_batch_size=cfg.rollout.embedded.max_batch_size, sglang_version=cfg.rollout.embedded.sglang_version)

    def _embedded_endpoint(self, i: int) -> tuple[Any, Any]:
        """(weight-sync target, Engine) of embedded engine i: its actor and direct Ray calls,
        or, with rollout.embedded.serve_http, its server's URL and the SGLang client."""
        import ray

        from ..rollout.client import HTTPEngine
        from ..rollout.embedded import RayEngine

        cfg, actor = self.cfg, self._embedded[i]
        if not cfg.rollout.embedded.serve_http:
            return actor, RayEngine(actor, f"embedded-{i}")
        url = ray.get(actor.start_http.remote(cfg.rollout.embedded.host, cfg.rollout.embedded.port, self.key))
        return url, HTTPEngine(url, name=f"embedded-{i}", max_concurrency=cfg.rollout.max_in_flight,
                               timeout_s=cfg.rollout.request_timeout_s, max_retries=cfg.rollout.max_retries,
                               drain_timeout_s=cfg.rollout.sglang.drain_timeout_s, api_key=self.key)

    # ------------------------------------------------------------ restart
    async def restart(self, i: int, after: Callable[[int], None] | None = None) -> None:
        """Bring engine i back after its process died (a rollout's `restart_engine`): close the
        dead server's connections on this event loop, start a new process, then `after(i)`
        (the loop's re-sync of the current weights), both off the event loop."""
        await close_sessions([self.generation[i]])

        def now() -> None:
            self.restart_process(i)
            if after is not None:
                after(i)

        await asyncio.to_thread(now)

    def restart_process(self, i: int) -> None:
        """A new embedded actor, or a new SGLang process in the same actor (same port); the
        existing clients are pointed at it."""
        import ray

        cfg = self.cfg
        if cfg.rollout.name == "sglang":
            actor = self.sglang.actors[i]
            ray.get(actor.stop.remote())
            ray.get(actor.start.remote())
            ray.get(actor.wait_healthy.remote(cfg.rollout.sglang.startup_timeout_s))
            self.admin[i].rebase(self.admin[i].base_url)  # a new server: all its memory, no gate
        else:
            try:
                ray.kill(self._embedded[i], no_restart=True)
            except Exception:  # noqa: BLE001 (already gone)
                pass
            self._embedded[i] = self._new_embedded_actor(i)
            target, _ = self._embedded_endpoint(i)
            if self.http:
                self.generation[i].rebase(target)
            else:
                self.generation[i].actor = target
            self.sync_targets[i] = target
        self.restarts += 1

    # ------------------------------------------------------------ memory and admin calls
    def call(self, method: str, *args: Any, only: int | None = None) -> None:
        """`method(*args)` on every engine's admin client (`only`: on engine `only` alone)."""
        engines = self.admin if only is None else [self.admin[only]]

        async def call_all() -> None:
            try:
                await asyncio.gather(*(getattr(e, method)(*args) for e in engines))
            finally:
                await close_sessions(engines)

        asyncio.run(call_all())

    def release(self, tags: Sequence[str]) -> list[int]:
        """Engines give back `tags` (each drains its requests first); a router in front of
        them stops taking requests too. Returns the engines restarted on the way (`_move`)."""
        for e in self.generation:
            if e not in self.admin and hasattr(e, "hold"):
                e.hold(tuple(tags))
        restarted = self._move("release_memory_occupation", tags, self.resident - set(tags))
        self.resident -= set(tags)
        return restarted

    def resume(self, tags: Sequence[str]) -> list[int]:
        restarted = self._move("resume_memory_occupation", tags, self.resident | set(tags))
        self.resident |= set(tags)
        for e in self.generation:
            if e not in self.admin and hasattr(e, "unhold"):
                e.unhold(tuple(tags))
        return restarted

    def _move(self, method: str, tags: Sequence[str], after: set[str]) -> list[int]:
        """`method(tags)` on every engine. An engine whose process died in it (it no longer
        answers its health check: SGLang's scheduler has died in a release) is restarted and
        made to hold what the others hold after the move (`after`): it comes back holding all
        its memory and the start checkpoint's weights. Returns the restarted engines, whose
        weights the loop must sync before they generate; any other failure is raised."""
        async def one(i: int, e: Any) -> tuple[int, BaseException] | None:
            try:
                await getattr(e, method)(list(tags))
                return None
            except Exception as err:  # noqa: BLE001
                if not self.can_restart or await engine_answers(e, alive=True):
                    raise
                return i, err

        async def move_all() -> list[tuple[int, BaseException] | None]:
            try:
                return list(await asyncio.gather(*(one(i, e) for i, e in enumerate(self.admin))))
            finally:
                await close_sessions(self.admin)

        dead = [d for d in asyncio.run(move_all()) if d is not None]
        for i, err in dead:
            print(f"engine {i} died in {method} ({type(err).__name__}: {err}); restarting it")
            self._restart_holding(i, after)
        return [i for i, _ in dead]

    def _restart_holding(self, i: int, holds: set[str]) -> None:
        """Restart engine i's process and have it give back what the others do not hold: a new
        server comes up holding all its memory and the start checkpoint's weights."""
        self.restart_process(i)
        drop = [t for t in MEMORY_TAGS if t not in holds]
        if drop:
            self.call("release_memory_occupation", drop, only=i)

    def restart_dead(self) -> list[int]:
        """Restart every engine whose process no longer answers (after a call to the engines
        failed: a weight sync), each holding what the others hold; their indices. Nothing where
        engines cannot be restarted."""
        if not self.can_restart:
            return []

        async def probe() -> list[bool]:
            try:
                return list(await asyncio.gather(*(engine_answers(e, alive=True) for e in self.admin)))
            finally:
                await close_sessions(self.admin)

        dead = [i for i, ok in enumerate(asyncio.run(probe())) if not ok]
        for i in dead:
            self._restart_holding(i, set(self.resident))
        return dead

