"""The device-side token dispatch of all-local MoE layers (`vlmrl.models.moe`) against the
definition of a routed SwiGLU MoE: out[t] = sum over the token's k experts of p * expert(x[t]).

The layer-level check (the dispatcher inside Megatron's MoELayer, against HF and against
Megatron's all-to-all dispatcher under expert parallelism) is in
tests/integration/test_qwen35_parity.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from vlmrl.models.moe import LocalTokenDispatcher, expert_mlp


def _reference(x, experts, weights, gate_up, down):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, p in zip(experts[t].tolist(), weights[t]):
            g, u = F.linear(x[t], gate_up[e]).chunk(2)
            out[t] += p * F.linear(F.silu(g) * u, down[e])
    return out


@pytest.mark.parametrize("tokens,experts_n,k", [(13, 4, 2), (32, 8, 3), (5, 6, 4)])
def test_local_dispatch_equals_the_definition(tokens, experts_n, k):
    torch.manual_seed(tokens)
    h, ffn = 8, 6
    cfg = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=1, num_moe_experts=experts_n,
                            moe_router_topk=k, moe_ffn_hidden_size=ffn)
    x = torch.randn(tokens, 1, h, dtype=torch.float64, requires_grad=True)
    logits = torch.randn(tokens, experts_n, dtype=torch.float64)
    top, chosen = logits.topk(k, dim=1)
    probs = torch.zeros_like(logits).scatter(1, chosen, top.softmax(-1)).requires_grad_()
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, chosen, True)
    gate_up = torch.randn(experts_n, 2 * ffn, h, dtype=torch.float64, requires_grad=True)
    down = torch.randn(experts_n, h, ffn, dtype=torch.float64, requires_grad=True)

    d = LocalTokenDispatcher(experts_n, cfg)
    rows, p = d.dispatch_preprocess(x, routing_map, probs)
    rows, p = d.token_dispatch(rows, p)
    rows, counts, p = d.dispatch_postprocess(rows, p)
    assert isinstance(counts, torch.Tensor) and counts.tolist() == routing_map.sum(0).tolist()
    out = d.combine_postprocess(d.token_combine(d.combine_preprocess(expert_mlp(rows, counts, gate_up, down, p))))
    assert out.shape == x.shape

    chosen_sorted = routing_map.to(torch.uint8).topk(k, dim=1).indices
    ref = _reference(x[:, 0], chosen_sorted, probs.gather(1, chosen_sorted), gate_up, down)
    torch.testing.assert_close(out[:, 0], ref, rtol=1e-12, atol=1e-12)

    with torch.profiler.profile() as prof:  # the backward gathers: no index_add / index_put atomics
        grads = torch.autograd.grad(out.square().sum(), (x, probs, gate_up, down))
    assert not [e.key for e in prof.key_averages() if "index_add" in e.key or "index_put" in e.key]
    ref_grads = torch.autograd.grad(ref.square().sum(), (x, probs, gate_up, down))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)


def test_compiled_block_maths_equals_the_definition_and_scatters_nothing():
    """`moe_forward` (the compiled block's function, run eagerly in float32 here) against the
    per-token definition with the router's top-k softmax and the gated shared expert; its
    backward gathers over the inverse permutation, so no index_add / index_put (atomics on
    colliding rows) runs in it."""
    from vlmrl.models.moe import moe_forward

    torch.manual_seed(0)
    n, h, e, k, ffn, shared_ffn = 37, 16, 6, 3, 8, 12

    def w(*shape):  # O(1) activations: float32 (torch's grouped GEMM has no float64)
        return (torch.randn(*shape) / shape[-1] ** 0.5).requires_grad_()

    x = torch.randn(n, h, requires_grad=True)
    router, gate_up, down = w(e, h), w(e, 2 * ffn, h), w(e, h, ffn)
    fc1, fc2, gate = w(2 * shared_ffn, h), w(h, shared_ffn), w(1, h)
    leaves = (x, router, gate_up, down, fc1, fc2, gate)

    with torch.profiler.profile() as prof:
        out, counts = moe_forward(x, router, k, gate_up, down, fc1, fc2, gate)
        grads = torch.autograd.grad(out.square().sum(), leaves)
    ops = {evt.key for evt in prof.key_averages()}
    assert not {op for op in ops if "index_add" in op or "index_put" in op}, ops

    top, chosen = (x @ router.T).topk(k, dim=1)
    ref = _reference(x, chosen, top.softmax(-1), gate_up, down)
    sg, su = F.linear(x, fc1).chunk(2, dim=-1)
    ref = ref + F.linear(F.silu(sg) * su, fc2) * torch.sigmoid(F.linear(x, gate))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert counts[:-2].tolist() == torch.bincount(chosen.reshape(-1), minlength=e).tolist()
    assert counts[-2:].tolist() == [0, 0]  # no engine experts given: nothing compared
    for g, r in zip(grads, torch.autograd.grad(ref.square().sum(), leaves)):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("replay", [False, True])
def test_compiled_block_measures_and_replays_the_engines_experts(replay):
    """`moe_forward` given the engine's experts (some tokens unreported, -1): it counts the
    reported tokens whose own top-k set differs, and with `replay` computes the per-token
    definition with the engine's experts, weighted by the softmax of its own logits at them
    (tokens the engine did not report keep their own experts); without, its own routing."""
    from vlmrl.models.moe import moe_forward

    torch.manual_seed(1)
    n, h, e, k, ffn = 29, 16, 6, 2, 8
    x = torch.randn(n, h, requires_grad=True)
    router = (torch.randn(e, h) / h ** 0.5).requires_grad_()
    gate_up = (torch.randn(e, 2 * ffn, h) / h ** 0.5).requires_grad_()
    down = (torch.randn(e, h, ffn) / ffn ** 0.5).requires_grad_()
    engine = torch.rand(n, e).argsort(-1)[:, :k]
    engine[-4:] = -1
    out, stats = moe_forward(x, router, k, gate_up, down, None, None, None, False, engine, replay)
    logits = x @ router.T
    own = logits.topk(k, dim=1).indices
    known = engine[:, 0] >= 0
    differ = ((own.sort(-1).values != engine.sort(-1).values).any(-1) & known).sum()
    assert stats[-2:].tolist() == [int(differ), int(known.sum())] and int(differ) > 0
    chosen = torch.where(known[:, None], engine, own) if replay else own
    ref = _reference(x, chosen, logits.gather(1, chosen).softmax(-1), gate_up, down)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert stats[:-2].tolist() == torch.bincount(chosen.reshape(-1), minlength=e).tolist()
    leaves = (x, router, gate_up, down)
    for g, r in zip(torch.autograd.grad(out.square().sum(), leaves), torch.autograd.grad(ref.square().sum(), leaves)):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_experts", [64, 256, 300])
def test_expert_order_on_narrow_keys_is_the_stable_sort(num_experts):
    """The sort by expert runs on the narrowest key dtype (one radix pass per byte); its
    order and inverse are those of the stable sort of the int64 ids, at the uint8 bound and
    past it."""
    from vlmrl.models.moe import _expert_order, _sort_key_dtype

    torch.manual_seed(0)
    flat = torch.randint(0, num_experts, (4096,))
    flat[:3] = num_experts - 1  # the largest id must survive the narrowing
    order, inverse = _expert_order(flat, num_experts)
    assert torch.equal(order, torch.argsort(flat, stable=True))
    assert torch.equal(order[inverse], torch.arange(flat.numel()))
    assert _sort_key_dtype(num_experts) == (torch.uint8 if num_experts <= 256 else torch.int16)


def test_router_logits_of_bf16_inputs_are_the_float32_gemm():
    """The compiled block's router GEMM for bf16 tokens and weights (`router_logits`): its
    forward is Megatron's float32 GEMM of the upcast inputs (the products of bf16 numbers are
    exact in float32); its gradients, which enter as two bf16 terms each, are those of the
    float32 GEMM to far below bf16's rounding: after the cast to bf16, the same numbers but
    for entries that sit on a rounding boundary (under 1% here), each off by one bf16 step."""
    from vlmrl.models.moe import router_logits

    torch.manual_seed(0)
    x = torch.randn(300, 64).bfloat16().requires_grad_()
    w = (torch.randn(16, 64) * 0.1).bfloat16().requires_grad_()
    g = torch.randn(300, 16)
    out = router_logits(x, w)
    assert out.dtype == torch.float32
    out.backward(g)
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = F.linear(xr, wr)
    ref.backward(g)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-5)
    for got, want in ((x.grad, xr.grad), (w.grad, wr.grad)):
        assert got.dtype == torch.bfloat16
        same = (got == want.bfloat16()).float().mean().item()
        assert same > 0.99, same
        torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-3 * want.abs().max().item())
