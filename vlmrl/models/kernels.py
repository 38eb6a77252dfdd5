"""Inductor-fused twins of the language model's elementwise functions.

Without TransformerEngine, every RMSNorm, rotary embedding and log-softmax of the language
model runs as a chain of small torch kernels (casts, pow, mean, rsqrt, mul, cat, ...), each
reading and writing the whole activation. With `hardware.fused_kernels=true` (the GPU
hardware configs) the dense layers run as two compiled graphs each
(`vlmrl.models.fused_layer`); where a layer falls back to Megatron's own forward (TP/SP,
MoE, ...) and for the loss, these pure functions are compiled one by one instead:

- `vlmrl.models.norm.rms_norm` (input/pre-MLP/final/qk norms),
- `vlmrl.models.mrope.rope_qk` (M-RoPE on queries and keys),
- `vlmrl.models.gated_delta.decay_and_beta` and `gated_rms_norm` (the Gated DeltaNet
  layer's elementwise steps around fla's kernels),
- `vlmrl.training.logprobs.log_softmax_pick` (logprobs and entropy when the vocabulary is
  not sharded; one pass over the bf16 logits instead of a float32 copy),

and SwiGLU uses megatron-core's compiled fusion (`bias_activation_fusion`, set by the
bridge). The plain functions are the reference math and run as they are on CPU; the tests
check the compiled ones against them. Attention and the GEMMs stay outside the compiled
regions, so a new packing layout costs no recompilation, and a new total token count
compiles one shape-generic kernel set on its second occurrence (torch's automatic dynamic
shapes) that is reused from then on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

# Calls of each compiled function whose activations are marked dynamic in their token dim
# (see `fused`): enough to cover its first compile in every process; later calls reuse it.
_MARKED_CALLS = 64


@functools.cache
def fused(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The Inductor-compiled twin of a pure tensor function (one per process).

    Its activations (tensor arguments that are not parameters) come in with their first dim,
    the packed token count, marked dynamic: the first compile is then the shape-generic one,
    where torch's automatic dynamic shapes would compile a static graph first and the generic
    one again at the first new length, which in training is the second micro-batch."""
    compiled = torch.compile(fn, fullgraph=True, dynamic=None)
    calls = 0

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        if calls < _MARKED_CALLS:
            calls += 1
            for a in args:
                if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter) and a.dim():
                    torch._dynamo.maybe_mark_dynamic(a, 0)
        return compiled(*args, **kwargs)

    return run


def pick(fn: Callable[..., Any], use_fused: bool) -> Callable[..., Any]:
    return fused(fn) if use_fused else fn
