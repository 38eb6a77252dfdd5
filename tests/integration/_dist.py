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


def gather_payloads_worker(rank: int, world_size: int, sources: list[list[int]], senders: list[int]) -> Any:
    """Each sending rank serializes its own bucket (a tensor holding its rank) in the
    embedded server's host format; rank 0 collects them per engine."""
    import torch

    from vlmrl.rollout.weights import decode_torch_payload, gather_rank_payloads, serialize_payload

    mine = serialize_payload([("w", torch.full((2,), float(rank)))], "torch_save") if rank in senders else None
    per_engine = gather_rank_payloads(mine, sources)
    if per_engine is None:
        return None
    return [[float(decode_torch_payload(p)[0][1][0]) for p in payloads] for payloads in per_engine]
