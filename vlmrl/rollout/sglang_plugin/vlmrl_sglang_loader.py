"""vlmrl's weight loader inside an SGLang server (`--custom-weight-loader
vlmrl_sglang_loader.load_weights`): the engine's side of the colocated weight sync.

SGLang's model loaders take routed experts one expert and one matrix at a time: for each of
a layer's E experts a Python call per gate, up and down matrix (3 x 64 calls a layer for the
scaled Qwen3.5-MoE), which held the whole sync to 22-29 GB/s on one H200. The trainer sends
each layer's experts fused instead, under transformers' in-memory names
(`...layers.L.mlp.experts.gate_up_proj` [E, 2I, H], gate rows then up rows per expert, and
`...mlp.experts.down_proj` [E, H, I]). Where the engine's fused-MoE layer L keeps all E
experts in exactly that layout (`w13_weight` [E, 2I, H] and `w2_weight` [E, H, I]:
unquantized, read by SGLang's Triton MoE as loaded (`LAYOUT_FLAGS` all false), no tensor or
expert parallelism inside the engine, no fused shared expert), one copy loads the tensor.
Every other tensor, and a fused expert tensor of any layer that fails a check, goes to the
model's own `load_weights`, which takes fused expert tensors too (one expert at a time).

Imports torch alone: this folder sits on the server's PYTHONPATH by itself, and the server's
environment need not have vlmrl's dependencies.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

log = logging.getLogger(__name__)

_FUSED = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_MOE_MODULE = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts$")
# transformers' fused expert tensor -> the fused-MoE layer's parameter in that layout
ENGINE_PARAM = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}
_CACHE = "_vlmrl_fused_expert_modules"


def fused_expert_key(name: str) -> tuple[int, str] | None:
    """(layer, engine parameter) of a fused expert tensor's name; None for any other name."""
    m = _FUSED.search(name)
    return None if m is None else (int(m.group(1)), ENGINE_PARAM[m.group(2)])


# Attributes of SGLang's UnquantizedFusedMoEMethod (as its __init__ sets them; the contracts
# record them per release) under which the experts leave the checkpoint layout or a backend
# other than SGLang's Triton MoE reads them: transposed (triton_kernels), rows permuted or
# packed into blocks (flashinfer TRT-LLM), gate and up rows interleaved, other kernels'
# expectations (flashinfer CUTLASS, DeepGEMM). Each must be false for the one-copy path.
LAYOUT_FLAGS = ("use_triton_kernels", "use_flashinfer_trtllm_moe", "use_flashinfer_cutlass", "use_deep_gemm",
                "w13_swiglu_interleaved")
# its other attributes, read in each release's source: none of them changes the experts' layout
# (a bias, caches, the runner object; ROCm's aiter shuffle is refused below on its own)
OTHER_ATTRIBUTES = ("with_bias", "_cache_permute_indices", "runner", "_aiter_runner")


def layout_problem(module: Any) -> str | None:
    """Why the fused-MoE `module` does not keep its experts as [E, 2I, H] / [E, H, I] of the
    whole model (None: it does, and a fused tensor of the same shape copies in as it is)."""
    method = getattr(module, "quant_method", None)
    if type(method).__name__ != "UnquantizedFusedMoEMethod":
        return f"quant_method {type(method).__name__}"
    flags = [f for f in LAYOUT_FLAGS if getattr(method, f, False)]
    if flags:
        return ", ".join(flags)
    if torch.version.hip is not None:
        return "ROCm (aiter may shuffle the experts)"
    if getattr(module, "moe_tp_size", 1) != 1 or getattr(module, "moe_ep_size", 1) != 1:
        return f"moe_tp_size {getattr(module, 'moe_tp_size', 1)}, moe_ep_size {getattr(module, 'moe_ep_size', 1)}"
    if getattr(module, "num_fused_shared_experts", 0):
        return "shared experts fused into the routed ones"
    for pname in ENGINE_PARAM.values():
        if getattr(getattr(module, pname, None), "is_transposed", False):
            return f"{pname} is transposed"
    return None


def fused_expert_modules(model: Any) -> dict[int, Any]:
    """layer -> the fused-MoE module of that layer, for every one of `model` that
    `layout_problem` passes (a layer index found twice, e.g. a draft model's layers: neither).
    Worked out once per model."""
    found = getattr(model, _CACHE, None)
    if found is not None:
        return found
    seen: dict[int, Any] = {}
    twice: set[int] = set()
    for module_name, module in model.named_modules():
        m = _MOE_MODULE.search(module_name)
        if m is None or not all(hasattr(module, p) for p in ENGINE_PARAM.values()):
            continue
        layer = int(m.group(1))
        if layer in seen:
            twice.add(layer)
        seen[layer] = module
    problems = {layer: "found twice" if layer in twice else layout_problem(module) for layer, module in seen.items()}
    found = {layer: module for layer, module in seen.items() if problems[layer] is None}
    setattr(model, _CACHE, found)
    others = sorted({p for p in problems.values() if p is not None})
    log.warning("%s: %d of %d MoE layers load their routed experts in one copy each%s", __name__, len(found),
                len(seen), f" (the others through the model's loader: {'; '.join(others)})" if others else "")
    return found


def split(model: Any, named_tensors: list[tuple[str, Any]]) -> tuple[list[tuple[Any, Any]], list[tuple[str, Any]]]:
    """(the (parameter, tensor) pairs that copy in as they are, the named tensors left for the
    model's own loader)."""
    modules = fused_expert_modules(model)
    direct: list[tuple[Any, Any]] = []
    rest: list[tuple[str, Any]] = []
    for name, tensor in named_tensors:
        key = fused_expert_key(name)
        module = modules.get(key[0]) if key is not None else None
        param = getattr(module, key[1]) if module is not None else None
        if param is not None and param.shape == tensor.shape and tensor.is_floating_point():
            direct.append((param, tensor))
        else:
            rest.append((name, tensor))
    return direct, rest


def load_weights(model: Any, named_tensors: list[tuple[str, Any]]) -> None:
    """SGLang's custom-loader entry point: `model`, and the bucket's (name, tensor) pairs."""
    direct, rest = split(model, list(named_tensors))
    with torch.no_grad():
        for param, tensor in direct:
            param.data.copy_(tensor)
    if rest:
        model.load_weights(rest)
