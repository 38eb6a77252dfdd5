"""Run a function in N local gloo processes (spawned, on a free port) and collect results.

A thin test-side wrapper over `vlmrl.training.parallel_state.spawn_local` (the same helper
the parity CLI uses): `fn(rank, world_size, *args)` must live at module level in an
importable module (not a test file) and return something picklable; rank failures come
back as RuntimeError with the failing rank's traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def run_in_processes(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    from vlmrl.training.parallel_state import spawn_local

    return spawn_local(fn, world_size, *args, backend="gloo", timeout_s=timeout_s)
