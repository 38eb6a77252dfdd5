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
  layer's elementwise steps around fla's kernels), and `kernel_inputs` (the q / k l2 norm
  before them, always compiled on a GPU),
- `vlmrl.training.logprobs.logsumexp_pick` and `logsumexp_pick_grad`, the forward and the
  written-out backward of `fused_log_softmax_pick` (logprobs and entropy when the vocabulary
  is not sharded; passes over the bf16 logits instead of a float32 copy),

and SwiGLU uses megatron-core's compiled fusion (`bias_activation_fusion`, set by the
bridge). The plain functions are the reference math and run as they are on CPU; the tests
check the compiled ones against them. Attention and the GEMMs stay outside the compiled
regions, so a new packing layout costs no recompilation, and a new total token count
compiles one shape-generic kernel set on its second occurrence (torch's automatic dynamic
shapes) that is reused from then on.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

# the compilers' cache variables, each under its own folder of `hardware.compile_cache_dir`: the
# trainer's (Inductor, Triton, TileLang, FlashAttention 4) and the SGLang servers' (read from
# SGLang 0.5.17 and flashinfer 0.6.15: its JIT kernels through tvm-ffi, flashinfer's JIT kernels,
# DeepGEMM's, and SGLang's own cache of autotune results); every process a run starts gets them
COMPILE_CACHE_VARS = {
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
    "TILELANG_CACHE_DIR": "tilelang",
    "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": "flash_attn_cute",
    "TVM_FFI_CACHE_DIR": "tvm_ffi",
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",
    "SGLANG_DG_CACHE_DIR": "deep_gemm",
    "SGLANG_CACHE_DIR": "sglang",
}


def compile_cache_env(root: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables that put every compiler's kernel cache under `root`
    (`hardware.compile_cache_dir`), for processes that have not imported those libraries yet
    (they read them at import or first compile). FlashAttention 4 keeps its CuTe DSL kernels
    on disk only when asked (`FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED`), so without this every
    process compiles them again. Variables set in `environ` (default: this process's) are
    left out: the user's own setting wins. Not torch's own: at its first compile Inductor
    writes its default folder into the environment, where every process started later would
    inherit it as if the user had chosen it. An empty `root` sets nothing."""
    if not root:
        return {}
    environ = os.environ if environ is None else environ
    out = {var: os.path.join(root, sub) for var, sub in COMPILE_CACHE_VARS.items()}
    out["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] = "1"
    return {k: v for k, v in out.items() if k not in environ or _torch_default(k, environ[k])}


def _torch_default(var: str, value: str) -> bool:
    """Whether `value` of `var` is what torch itself puts there (Inductor's default folder)."""
    if var != "TORCHINDUCTOR_CACHE_DIR":
        return False
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(value) == os.path.abspath(default_cache_dir())


# Calls of each compiled function whose activations are marked dynamic in their token dim
# (see `fused`): enough to cover its first compile in every process; later calls reuse it.
_MARKED_CALLS = 64


def compile_options(graphs: bool) -> dict[str, Any]:
    """Inductor's options for vlmrl's compiled functions: "reduce-overhead"'s (CUDA graphs)
    with `graphs`, and Inductor's mix-order reductions (a norm's backward: the per-token
    reduction and the weight gradient's reduction over tokens in one kernel) without their
    size thresholds. Those thresholds (at least 4,096 tokens, at least 5 Mi elements) are
    checked against the token count and guarded on, so each compiled function compiled
    again for every range of micro-batch sizes it met: on the scaled Qwen3.5-MoE, 3 or 4
    compiles of each in the first three training steps (2026-12-05 cold run,
    `bench/results/trainer_steps.md`). Without them the kernel set is the same for every token
    count. Left as it is where this torch has no such option."""
    from torch._inductor import config, list_mode_options

    options = dict(list_mode_options("reduce-overhead")) if graphs else {}
    if hasattr(config.triton, "mix_order_reduction_non_strict_mode"):
        options["triton.mix_order_reduction_non_strict_mode"] = True
    return options


@functools.cache
def _compiled(fn: Callable[..., Any], graphs: bool) -> Callable[..., Any]:
    return torch.compile(fn, fullgraph=True, dynamic=None, options=compile_options(graphs))


def fused(fn: Callable[..., Any], graphs: bool = False) -> Callable[..., Any]:
    """The Inductor-compiled twin of a pure tensor function (one per process and `graphs`).

    Its activations (tensor arguments that are not parameters) come in with their first dim,
    the packed token count, marked dynamic: the first compile is then the shape-generic one,
    where torch's automatic dynamic shapes would compile a static graph first and the generic
    one again at the first new length, which in training is the second micro-batch.

    With `graphs` (`hardware.cuda_graphs`, see `use_cuda_graphs`) a call with autograd on
    replays the graph's kernels, forward and backward, as CUDA graphs (torch's CUDA graph
    trees: one recording per token count, which the trainer keeps to a few buckets); a call
    without autograd (the logprob passes) runs the plain compiled kernels, since CUDA graph
    trees start a new generation, and so reuse the outputs' memory, at every compiled call
    that has no backward pending. The caller marks each micro-batch's start with
    `begin_graph_step`."""
    return _twin(fn, bool(graphs))


@functools.cache
def _twin(fn: Callable[..., Any], graphs: bool) -> Callable[..., Any]:
    """`fused`'s wrapper, one per (fn, graphs) however `fused` was called."""
    plain = _compiled(fn, False)
    replayed = _compiled(fn, True) if graphs else plain
    calls = 0

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        if calls < _MARKED_CALLS:
            calls += 1
            for a in args:
                if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter) and a.dim():
                    torch._dynamo.maybe_mark_dynamic(a, 0)
        return (replayed if torch.is_grad_enabled() else plain)(*args, **kwargs)

    return run


def begin_graph_step() -> None:
    """Mark the start of a micro-batch's forward for CUDA graph trees (with `graphs`).

    Once marked by hand, a new generation (whose replays reuse the memory of the last
    generation's outputs) starts only here. Left to its own heuristic, torch starts one at any
    torch.compile'd call made after the first compiled backward has run, and libraries call
    such functions inside the backward (FlashQLA's l2norm): the activations that the rest of
    the backward still needs would be overwritten."""
    torch.compiler.cudagraph_mark_step_begin()


def use_cuda_graphs(model: torch.nn.Module) -> int:
    """Let every module of `model` that runs compiled graphs through `fused(..., graphs)` (a
    class attribute `cuda_graphs`) replay them as CUDA graphs; returns how many modules took it.

    The parameters are marked as static addresses (without a guard, so one graph serves every
    layer): CUDA graph trees then read the weights in place instead of copying them into the
    graph's input buffers at every replay. Their storage must stay where it is (Megatron's DDP
    buffers and optimizers update in place)."""
    n = 0
    for module in model.modules():
        if hasattr(type(module), "cuda_graphs") and getattr(module, "graphs_eligible", True):
            module.cuda_graphs = True
            n += 1
    if n:
        for p in model.parameters():
            torch._dynamo.mark_static_address(p, guard=False)
    return n


def pick(fn: Callable[..., Any], use_fused: bool) -> Callable[..., Any]:
    return fused(fn) if use_fused else fn


def cuda_graph_stats(device_index: int = 0) -> dict[str, int]:
    """What CUDA graph trees hold on this device: recorded graphs (tree nodes, forward and
    backward) and the compiled calls that ran without a graph (skips, with torch's log of why)."""
    from torch._dynamo.utils import counters

    skips = int(counters["inductor"]["cudagraph_skips"])
    if not torch.cuda.is_available():
        return {"graphs": 0, "skips": skips}
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(device_index, create_if_none_exists=False)
    graphs = 0 if manager is None else sum(1 + root.num_descendants() for root in manager.get_roots())
    return {"graphs": graphs, "skips": skips}
