"""Gradient reductions vlmrl's modules need beyond megatron-core's.

A parameter replicated over tensor-parallel ranks whose ranks compute different parts of
its gradient must have those parts summed. Megatron does this for sequence-parallel norms
and q/k norms; vlmrl's Gated DeltaNet norm weight is shared by heads that TP shards, so
its gradient is partial on every rank with or without sequence parallelism. Such
parameters carry `vlmrl_tp_sum = True`; `finalize_model_grads` (the trainer's
`config.finalize_model_grads_func`) runs Megatron's finalisation and then sums them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def tp_sum_params(chunks: Iterable[Any]) -> list[torch.nn.Parameter]:
    return [p for c in chunks for p in c.parameters() if getattr(p, "vlmrl_tp_sum", False) and p.requires_grad]


def allreduce_tp_sum_grads(chunks: Iterable[Any]) -> None:
    """Sum the gradients (`main_grad` under Megatron DDP, else `.grad`) of the `vlmrl_tp_sum`
    parameters over the tensor-parallel group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mps

    if mps.get_tensor_model_parallel_world_size() == 1:
        return
    grads = []
    for p in tp_sum_params(chunks):
        g = getattr(p, "main_grad", None)
        if g is None:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            g = p.grad
        grads.append(g)
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=mps.get_tensor_model_parallel_group())
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def finalize_model_grads(model: list[Any], num_tokens: Any = None, pg_collection: Any = None,
                         force_all_reduce: bool | None = False) -> None:
    """megatron-core's finalize_model_grads, then the TP sums of `vlmrl_tp_sum` parameters."""
    from megatron.core.distributed import finalize_model_grads as megatron_finalize

    megatron_finalize(model, num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
    allreduce_tp_sum_grads(model)
