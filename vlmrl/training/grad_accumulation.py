"""Each micro-batch's gradient added into Megatron's float32 main gradient by one vectorised
kernel (`hardware.fused_grad_accumulation`).

Without TransformerEngine, megatron-core's DDP adds every parameter's bf16 gradient into its
float32 main gradient in a backward hook, `main_grad.add_(grad)`: torch's casting elementwise
kernel, which loads one element at a time (its unrolled path, not the vectorised one). On the
H200 that ran at about 2.7 TB/s and took 54 ms of a 0.33 s trainer step of the scaled
Qwen3.5-MoE (16 samples, 5 micro-batches; 90 ms of a 1.05 s step at 64 samples; 2026-12-05,
`bench/results/trainer_steps.md`). `accumulate` makes the same sum (each bf16 value widened
exactly, one float32 addition: the same bits as torch's) in a Triton kernel that reads and
writes whole vectors. `ddp_class` gives megatron-core's DDP with its hook doing that first;
the rest of the hook is Megatron's own.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

try:  # Triton comes with CUDA builds of torch; CPU machines have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the kernel is GPU-only
    triton = None

BLOCK = 4096  # elements a program adds
WARPS = 8

if triton is not None:

    @triton.jit
    def _add_into(main, grad, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < n
        total = tl.load(main + offs, mask=keep) + tl.load(grad + offs, mask=keep).to(tl.float32)
        tl.store(main + offs, total, mask=keep)


def supported(main: Tensor, grad: Tensor) -> bool:
    """Whether `accumulate` takes this pair: a float32 main gradient and a bf16 / fp16
    gradient of as many elements, both contiguous on one CUDA device, Triton present."""
    return (triton is not None and main.is_cuda and grad.device == main.device
            and main.dtype == torch.float32 and grad.dtype in (torch.bfloat16, torch.float16)
            and main.numel() == grad.numel() and main.is_contiguous() and grad.is_contiguous())


def accumulate(main: Tensor, grad: Tensor) -> bool:
    """main += grad, in place, by the vectorised kernel; False (nothing done) where the pair
    is not `supported`, for the caller's own add."""
    if not supported(main, grad):
        return False
    n = main.numel()
    if n:
        _add_into[(triton.cdiv(n, BLOCK),)](main, grad, n, BLOCK=BLOCK, num_warps=WARPS)
    return True


def ddp_class(fused: bool) -> type:
    """megatron-core's DistributedDataParallel, or with `fused` its subclass whose backward
    hook adds the gradient by `accumulate` where it can (then leaves the rest of the hook,
    the gradient's release and any reduction bookkeeping, to Megatron)."""
    from megatron.core.distributed import DistributedDataParallel

    return _fused_ddp() if fused else DistributedDataParallel


@functools.cache
def _fused_ddp() -> type:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.cuda_graphs import is_graph_capturing

    class FusedAccumulationDDP(DistributedDataParallel):
        """DistributedDataParallel whose gradient hook sums by `accumulate` (module docstring)."""

        def _make_backward_post_hook(self, param: torch.nn.Parameter) -> Any:
            megatron_hook = super()._make_backward_post_hook(param)

            def hook(*unused: Any) -> None:
                grad = param.grad
                # the cases where Megatron's own hook would add grad into main_grad, less the
                # overlapped reduction (its hook then needs the gradient still attached)
                if (grad is not None and not self.ddp_config.overlap_grad_reduce and not is_graph_capturing()
                        and param in self.param_to_bucket_group and not param.grad_added_to_main_grad
                        and accumulate(param.main_grad, grad.data)):
                    param.grad = None  # added: Megatron's hook finds nothing left to add
                megatron_hook(*unused)

            return hook

    return FusedAccumulationDDP
