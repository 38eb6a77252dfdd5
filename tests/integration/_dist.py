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


def compiled_moe_worker(rank: int, world_size: int, tokens: int, device: str = "cpu") -> dict[str, Any]:
    """One MoE layer of the Qwen3.5-MoE miniature: Megatron's forward (with the local
    dispatcher) against `vlmrl.models.moe.moe_forward`, eager in float32 and compiled in bf16
    (the `hardware.fused_kernels` path). Returns the worst differences and the compiled
    path's routing counts against the router's."""
    import torch

    from vlmrl.config import load
    from vlmrl.config.schema import ParallelConfig
    from vlmrl.models.bridge import build_model
    from vlmrl.models.moe import LocalMoELayer, moe_forward
    from vlmrl.training.parallel_state import init_parallel_state

    # a gloo rank is a CPU rank (vlmrl.models.compat): on CUDA the process group is NCCL
    init_parallel_state(ParallelConfig(), backend="nccl" if device == "cuda" else "gloo", seed=0)
    model = load(["model=tiny_qwen3_5_moe"], check_rules=False).model
    chunk = build_model(model, ParallelConfig(), params_dtype=torch.float32, fused_kernels=True)[0]
    layer = next(m for m in chunk.modules() if isinstance(m, LocalMoELayer)).to(device).train()
    assert layer.compiled, "the miniature's MoE layers take the compiled path"
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the shared expert's gate and the router away from their init
        for p in layer.parameters():
            p.add_((torch.randn(p.shape, generator=gen) * 0.1).to(p.device))
    x0 = torch.randn(tokens, 1, layer.config.hidden_size, generator=gen).to(device)
    r = torch.randn(tokens, 1, layer.config.hidden_size, generator=gen).to(device)
    params = [p for p in layer.parameters() if p.requires_grad]

    def run(fn, dtype):
        layer.to(dtype)
        x = x0.to(dtype).requires_grad_()
        out = fn(x)
        grads = torch.autograd.grad((out.float() * r).sum(), [x, *params])
        return out.float(), [g.float() for g in grads]

    def megatron(x):
        layer.compiled = False
        try:
            return layer(x)[0]
        finally:
            layer.compiled = True

    def eager(x):
        s = layer.shared_experts
        out, _ = moe_forward(x.view(tokens, -1), layer.router.weight, layer.router.topk, layer.experts.gate_up_proj,
                             layer.experts.down_proj, s.linear_fc1.weight, s.linear_fc2.weight, s.gate_weight)
        return out.view_as(x)

    seen: dict[str, Any] = {}
    layer.router.register_forward_hook(lambda m, a, o: seen.__setitem__("router", o[1].sum(0).tolist()))
    layer.router.vlmrl_routing_sink = lambda router, counts, n: seen.__setitem__("sink", (counts.tolist(), n))

    def worst(a, b):
        oa, ga = a
        ob, gb = b
        scale = [max(float(t.detach().abs().max()), 1e-6) for t in (ob, *gb)]
        return max(float((u - v).detach().abs().max()) / s for u, v, s in zip((oa, *ga), (ob, *gb), scale))

    from vlmrl.models.moe import compiled_path_problem

    problems = {"none": compiled_path_problem(layer)}
    for key, value in (("moe_aux_loss_coeff", 0.01), ("moe_router_enable_expert_bias", True),
                       ("moe_router_pre_softmax", True), ("moe_expert_capacity_factor", 1.0)):
        old = getattr(layer.config, key)
        setattr(layer.config, key, value)
        problems[key] = compiled_path_problem(layer)
        setattr(layer.config, key, old)

    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32
    m32 = run(megatron, torch.float32)
    # torch's grouped GEMM takes float32 on the CPU only (bf16 on CUDA)
    e32 = run(eager, torch.float32) if device == "cpu" else None
    m16 = run(megatron, torch.bfloat16)
    c16 = run(lambda x: layer(x)[0], torch.bfloat16)
    return {"eager_fp32_vs_megatron": worst(e32, m32) if e32 is not None else None, "compiled_bf16_vs_megatron_fp32": worst(c16, m32),
            "megatron_bf16_vs_megatron_fp32": worst(m16, m32),
            "counts_match": float(seen["sink"][0] == seen["router"] and seen["sink"][1] == tokens),
            "problems": problems, "compiled_graphs": _compiled_graphs(),
            "compiled_vs_megatron_bf16_output": float((c16[0] - m16[0]).detach().abs().max())}


def _compiled_graphs() -> int:
    import torch._dynamo.utils

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
