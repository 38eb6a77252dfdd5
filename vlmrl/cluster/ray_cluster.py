"""Starting and stopping the job's Ray cluster.

A local cluster keeps everything inside the run dir: Ray's temp dir (sessions, logs,
sockets) lives under `<run_dir>/ray`, reached through a short symlink in /tmp because
Ray's unix socket paths must stay under ~107 bytes (removed when the cluster stops);
authentication is off for the local cluster, so no token files are written outside it; the
dashboard is off or bound to loopback. Only the cluster this job started is shut down. `cluster.address` joins an
external cluster instead (nothing is started or stopped there).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..config.schema import VlmrlConfig
from ..models.kernels import compile_cache_env


def _short_link(target: Path) -> Path:
    digest = hashlib.sha1(str(target).encode()).hexdigest()[:10]
    link = Path("/tmp") / f"vlmrl-ray-{digest}"
    if link.is_symlink() and os.readlink(link) != str(target):
        link.unlink()
    if not link.exists():
        link.symlink_to(target, target_is_directory=True)
    return link


def cpu_slots(cfg: VlmrlConfig) -> float:
    """CPUs the local cluster advertises: one slot per actor, fractional on small machines."""
    import math

    actors = max(cfg.cluster.num_cpu_ranks, 1) + 1  # trainer ranks + the embedded engine
    # Ray takes whole CPU counts only (5 actors x 0.5 CPU = 2.5 -> 3)
    return float(max(os.cpu_count() or 1, math.ceil(actors * cfg.cluster.cpus_per_actor)))


@contextlib.contextmanager
def ray_cluster(cfg: VlmrlConfig, run_dir: str | os.PathLike) -> Iterator[Any]:
    import ray

    c = cfg.cluster
    if ray.is_initialized():  # an enclosing caller owns Ray (tests, notebooks)
        yield ray
        return
    started_link: Path | None = None
    import logging

    from ..logging.console import LOG_ENV, library_log

    log = str(library_log(run_dir))
    os.environ[LOG_ENV] = log  # for processes this one starts (and the driver's own notices)
    # every worker (trainer ranks, engines and the servers they start) keeps its compiled
    # kernels in the run's compile cache
    compiled = compile_cache_env(cfg.hardware.compile_cache_dir)
    env = {"RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", LOG_ENV: log, **compiled}
    if c.address:
        ray.init(address=c.address, log_to_driver=True, logging_level=logging.WARNING,
                 runtime_env={"env_vars": {LOG_ENV: log, **compiled}})
    else:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        tmp = Path(run_dir).resolve() / "ray"
        tmp.mkdir(parents=True, exist_ok=True)
        started_link = _short_link(tmp)
        ray.init(
            num_cpus=cpu_slots(cfg),
            num_gpus=c.num_gpus,
            include_dashboard=c.dashboard,
            dashboard_host="127.0.0.1",
            _temp_dir=str(started_link),
            log_to_driver=True,
            logging_level=logging.WARNING,  # no "Started a local Ray instance" banner
            runtime_env={"env_vars": env},
        )
    try:
        yield ray
    finally:
        ray.shutdown()
        if started_link is not None and started_link.is_symlink():
            started_link.unlink()
