"""Per-token logprobs and entropy from logits sharded over the vocabulary (TP).

The output layer is column-parallel: each tensor-parallel rank holds logits for a slice of
the vocabulary. Logprobs of the targets and the entropy need the softmax over the whole
vocabulary; three all-reduces (max, sum of exp, the target logit and sum p*logit) give them
without gathering the logits. With tp == 1 this is a plain log_softmax (`log_softmax_pick`);
with `fused=True` (`hardware.fused_kernels`) it is `fused_log_softmax_pick`: the forward
keeps only the log-partition (and entropy) per token, and the backward is one elementwise
pass given those, reading the bf16 logits once and writing their gradient once. On CUDA
both are Triton kernels (`logprob_kernels`: the forward reads the logits once, where
torch's logsumexp reads them twice); elsewhere Inductor compiles the same maths. The
contract is the rollout engines' one: logprobs of log_softmax(logits / T).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..models.kernels import pick
from . import logprob_kernels


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


def _tempered(logits: Tensor, temperature: float) -> Tensor:
    """logits / temperature in float32, or wider when the logits already are (float64 in
    gradient checks)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return x / temperature if temperature != 1.0 else x


def log_softmax_pick(logits: Tensor, targets: Tensor, temperature: float,
                     with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """(log p(target) [T], entropy [T] or None) of log_softmax(logits / temperature) over the
    whole vocabulary, in float32 (or wider)."""
    x = _tempered(logits, temperature)
    logp_all = torch.log_softmax(x, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    return logp, entropy


def logsumexp_pick(logits: Tensor, targets: Tensor, temperature: float,
                   with_entropy: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """(log p(target), log-partition, entropy or None) of the tempered logits [..., V], in
    float32: the forward of `fused_log_softmax_pick`."""
    x = _tempered(logits, temperature)
    lse = torch.logsumexp(x, dim=-1)
    logp = x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        logp_all = x - lse.unsqueeze(-1)
        entropy = -(torch.exp(logp_all) * logp_all).sum(-1)
    return logp, lse, entropy


def logsumexp_pick_grad(logits: Tensor, targets: Tensor, lse: Tensor, entropy: Tensor | None,
                        g_logp: Tensor | None, g_entropy: Tensor | None, temperature: float) -> Tensor:
    """The gradient of the logits, elementwise given the per-token lse (and entropy): with
    z = x / T, p = softmax(z), d logp(t) / dz = onehot(t) - p and dH / dz = -p (log p + H)."""
    x = _tempered(logits, temperature)
    logp_all = x - lse.unsqueeze(-1)
    p = torch.exp(logp_all)
    dz: Tensor | float = 0.0
    if g_logp is not None:
        onehot = torch.arange(x.shape[-1], device=x.device) == targets.unsqueeze(-1)
        dz = g_logp.to(x.dtype).unsqueeze(-1) * (onehot.to(x.dtype) - p)
    if g_entropy is not None:
        if entropy is None:
            raise ValueError("an entropy gradient needs the forward's entropy")
        dz = dz - g_entropy.to(x.dtype).unsqueeze(-1) * p * (logp_all + entropy.unsqueeze(-1))
    if not isinstance(dz, Tensor):
        raise ValueError("no gradient given: g_logp and g_entropy are both None")
    if temperature != 1.0:
        dz = dz / temperature
    return dz.to(logits.dtype)


class _LogSoftmaxPick(torch.autograd.Function):
    """`log_softmax_pick` with a hand-written backward (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool,
                compiled: bool) -> tuple[Tensor, Tensor | None]:
        triton = compiled and logprob_kernels.supported(logits)
        if triton:
            lse, entropy = logprob_kernels.lse_and_entropy(logits, temperature, with_entropy)
            logp = _tempered(logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1), temperature) - lse
        else:
            logp, lse, entropy = pick(logsumexp_pick, compiled)(logits, targets, temperature, with_entropy)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.temperature, ctx.compiled, ctx.triton = temperature, compiled, triton
        ctx.set_materialize_grads(False)  # an entropy only logged gets no gradient pass
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor | None, g_entropy: Tensor | None) -> tuple[Tensor | None, ...]:
        logits, targets, lse, entropy = ctx.saved_tensors
        if g_logp is None and g_entropy is None:
            return None, None, None, None, None
        if ctx.triton:
            grad = logprob_kernels.logits_gradient(logits, targets, lse, entropy, g_logp, g_entropy,
                                                   ctx.temperature)
        else:
            grad = pick(logsumexp_pick_grad, ctx.compiled)(logits, targets, lse, entropy, g_logp, g_entropy,
                                                          ctx.temperature)
        return grad, None, None, None, None


def fused_log_softmax_pick(logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool,
                           compiled: bool = True) -> tuple[Tensor, Tensor | None]:
    """`log_softmax_pick`'s values and gradients: the forward reads the logits for the lse
    (and once more for the entropy), the backward once to write their gradient
    (`compiled=False` runs the same maths eagerly, for tests)."""
    return _LogSoftmaxPick.apply(logits, targets, float(temperature), bool(with_entropy), compiled)


def logprobs_and_entropy(logits: Tensor, targets: Tensor, *, temperature: float = 1.0,
                         vocab_start: int = 0, group: dist.ProcessGroup | None = None,
                         with_entropy: bool = True, fused: bool = False) -> tuple[Tensor, Tensor | None]:
    """(logp [T], entropy [T] or None) of `logits` [T, V_local] (this rank's vocab slice
    starting at `vocab_start`; `group` = the tensor-parallel group, None when unsharded)."""
    if group is None:
        if fused:
            return fused_log_softmax_pick(logits, targets, temperature, with_entropy)
        return log_softmax_pick(logits, targets, float(temperature), with_entropy)
    x = _tempered(logits, temperature)
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
