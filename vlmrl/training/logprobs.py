"""Per-token logprobs and entropy from logits sharded over the vocabulary (TP).

The output layer is column-parallel: each tensor-parallel rank holds logits for a slice of
the vocabulary. Logprobs of the targets and the entropy need the softmax over the whole
vocabulary; three all-reduces (max, sum of exp, the target logit and sum p*logit) give them
without gathering the logits. With tp == 1 this is a plain log_softmax (`log_softmax_pick`,
Inductor-fused with `fused=True`: one pass over the bf16 logits instead of a float32 copy
and several passes over it). The contract is the rollout engines' one: logprobs of
log_softmax(logits / T).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..models.kernels import pick


def _all_reduce(x: Tensor, group: dist.ProcessGroup | None, op: dist.ReduceOp.RedOpType) -> Tensor:
    """All-reduce over the tensor-parallel group: max (no gradient needed) or sum.

    The sum's backward is the identity, not another all-reduce: every TP rank computes the
    same loss from the reduced values, so the gradient reaching each rank's partial sum is
    already the whole gradient (an all-reduce there would scale it by the TP size)."""
    if group is None:
        return x
    if op == dist.ReduceOp.MAX:
        x = x.clone()
        dist.all_reduce(x, op=op, group=group)
        return x
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x, group)


def log_softmax_pick(logits: Tensor, targets: Tensor, temperature: float,
                     with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """(log p(target) [T], entropy [T] or None) of log_softmax(logits / temperature) over the
    whole vocabulary, in float32."""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    logp_all = torch.log_softmax(x, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    return logp, entropy


def logprobs_and_entropy(logits: Tensor, targets: Tensor, *, temperature: float = 1.0,
                         vocab_start: int = 0, group: dist.ProcessGroup | None = None,
                         with_entropy: bool = True, fused: bool = False) -> tuple[Tensor, Tensor | None]:
    """(logp [T], entropy [T] or None) of `logits` [T, V_local] (this rank's vocab slice
    starting at `vocab_start`; `group` = the tensor-parallel group, None when unsharded)."""
    if group is None:
        return pick(log_softmax_pick, fused)(logits, targets, float(temperature), with_entropy)
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    vmax = _all_reduce(x.detach().max(dim=-1, keepdim=True).values, group, dist.ReduceOp.MAX)
    shifted = x - vmax
    exp = shifted.exp()
    sum_exp = _all_reduce(exp.sum(-1, keepdim=True), group, dist.ReduceOp.SUM)
    log_z = sum_exp.log()  # log-partition of the shifted logits
    local = targets - vocab_start
    in_range = (local >= 0) & (local < x.shape[-1])
    picked = shifted.gather(-1, local.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    picked = _all_reduce(torch.where(in_range, picked, 0.0), group, dist.ReduceOp.SUM)
    logp = picked - log_z.squeeze(-1)
    entropy = None
    if with_entropy:
        p_times_x = _all_reduce((exp * shifted).sum(-1, keepdim=True), group, dist.ReduceOp.SUM)
        entropy = (log_z - p_times_x / sum_exp).squeeze(-1)
    return logp, entropy
