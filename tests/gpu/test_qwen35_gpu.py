"""Qwen3.5 on a GPU: the fast paths against the torch paths, and the model against HF.

bf16 tolerances (relative to the largest reference magnitude): bf16 keeps 8 significant
bits (a relative step of 2^-8 = 3.9e-3). The Gated DeltaNet kernels round their inputs,
chunk states and outputs to bf16 several times per chunk, and the torch path rounds
differently, so their outputs and gradients differ by a few such steps: 2e-2 admits that
and still fails a wrong kernel (O(1) errors, as the known-bad Triton backward on Hopper
gives). The grouped expert GEMMs accumulate in fp32 and round once per projection, like the
per-expert loop: 1e-2.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def test_fla_gated_delta_matches_torch_at_the_recipe_head_sizes():
    """16 key / 32 value heads of 128 (Qwen3.5-35B-A3B), packed samples longer and shorter
    than a chunk, forward and backward in bf16 (`check_fast_path` raises on a mismatch)."""
    pytest.importorskip("fla")
    from vlmrl.models import gated_delta as gd

    worst = gd.check_fast_path(torch.device("cuda"), torch.bfloat16, hk=16, hv=32, dk=128, dv=128,
                               lens=(700, 1300, 96, 2000))
    print(f"fla vs torch Gated DeltaNet, bf16: worst relative difference {worst:.2e}")
    assert worst <= gd.FAST_PATH_TOL[torch.bfloat16]


def test_fast_path_check_covers_flash_qla_split_path():
    """The startup check also runs FlashQLA's intra-card split (its own kernels) against the
    torch path, at the recipe's head sizes, so that a run compiles and checks it before its
    first long sample."""
    pytest.importorskip("flash_qla")
    from vlmrl.models import gated_delta as gd

    hk, hv, d = 16, 32, 128
    lens = gd.SPLIT_CHECK_LENS
    offsets = gd.PackedOffsets(gd.segment_bounds([0, lens[0]], sum(lens)), torch.device("cuda"), force_split=True)
    ctx = offsets.flash_qla_context(hv, True)
    assert ctx.is_intra and ctx.intra_cp_cu_seqlens.numel() > len(lens) + 1  # the long sample is cut
    worst = gd._check_layout(torch.device("cuda"), torch.bfloat16, hk, hv, d, d, 4, lens, 0, force_split=True)
    print(f"FlashQLA split path vs torch, bf16: worst relative difference {worst:.2e}")
    assert worst <= gd.FAST_PATH_TOL[torch.bfloat16]


def test_flash_qla_chunk_metadata_is_flash_qlas_own():
    """The chunk offsets and indices FlashQLA's kernels read, attached to the device offsets by
    `PackedOffsets.flash_qla_context` from pinned memory, equal what FlashQLA's own
    `prepare_varlen_metadata` attaches (its pageable copies), for a layout it keeps whole
    and one whose long sample it splits (the split's offsets get theirs too). Host-side
    only: no kernel compiles."""
    pytest.importorskip("flash_qla")
    from flash_qla.utils.index import prepare_varlen_metadata

    from vlmrl.models import gated_delta as gd

    split_seen = False
    for lens in ((37, 130, 91, 700, 1090), (16384, 100)):
        bounds = gd.segment_bounds([sum(lens[:i]) for i in range(len(lens))], sum(lens))
        offsets = gd.PackedOffsets(bounds, torch.device("cuda"))
        ctx = offsets.flash_qla_context(4, True)
        split_seen |= ctx.is_intra
        for cu in (offsets.cu, *((ctx.intra_cp_cu_seqlens,) if ctx.is_intra else ())):
            ref = cu.clone()
            prepare_varlen_metadata(ref, cu.cpu())
            got, want = cu._flash_qla_prepared_varlen, ref._flash_qla_prepared_varlen
            assert got[0] == want[0] and got[2] == want[2], (got, want)
            for a, b in ((got[1], want[1]), (got[3], want[3])):
                assert a.device == cu.device and a.dtype == b.dtype and torch.equal(a, b)
    assert split_seen, "no layout took FlashQLA's intra-card split: the test missed that path"


def test_gated_delta_offsets_from_the_host_match_fla_and_read_nothing_back():
    """`PackedOffsets` hands fla's convolution its chunk tiling and FlashQLA its split context,
    both built on the host. The results equal fla's own path (which derives them from the
    device offsets: the same kernels, the same split), forward and backward, for a layout of
    short samples and one whose long sample FlashQLA splits across SMs (intra-card CP); and
    a step over a fresh layout makes no host sync at all."""
    pytest.importorskip("fla")
    pytest.importorskip("flash_qla")
    from fla.ops.utils import prepare_chunk_indices
    from flash_qla.ops.gated_delta_rule.chunk import CHUNK_SIZE, _auto_intra_cp_context

    from vlmrl.models import gated_delta as gd
    from vlmrl.models.kernels import pick

    assert gd._flash_qla_backend() is not None
    dev, hk, hv, d = torch.device("cuda"), 2, 4, 128
    fla_conv, fla_rule = gd._fla()

    def inputs(total: int, seed: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        shapes = [(total, 2 * hk * d + hv * d), (2 * hk * d + hv * d, 4), (total, hv), (total, hv), (total, hv, d)]
        return [(torch.randn(*s, generator=gen) * (0.5 if i == 1 else 1.0)).to(dev, torch.bfloat16) for i, s in enumerate(shapes)]

    def step(tensors: list[torch.Tensor], offsets, ours: bool, conv=gd.fla_causal_conv1d) -> list[torch.Tensor]:
        """Conv + rule forward and backward: ours on `offsets`, or fla's own path on a plain
        copy of the device offsets (nothing of ours attached to it). `conv` is fla's kernel
        with the host's tiling for the comparison, so that only where the offsets come from
        differs (vlmrl's own convolution kernels round their backward differently, by a few
        bf16 steps, and `test_short_conv.py` holds them to fla), and the model's
        `packed_causal_conv1d` for the host-sync check."""
        x, w, a, b, grad = tensors
        x, w, a, b = (t.detach().clone().requires_grad_(True) for t in (x, w, a, b))
        total, cu = x.shape[0], (None if ours else offsets.cu_host.to(dev))
        if ours:
            mixed = conv(x, w, offsets)
        else:
            mixed = fla_conv(x.unsqueeze(0), weight=w, bias=None, activation="silu", cu_seqlens=cu)[0][0]
        qk, vv = mixed.split([2 * hk * d, hv * d], dim=-1)
        q, k = qk.reshape(total, 2 * hk, d).split(hk, dim=1)
        v = vv.reshape(total, hv, d)
        g, beta = -torch.nn.functional.softplus(a.float()), b.sigmoid()
        if ours:
            o = gd.fla_gated_delta_rule(q, k, v, g, beta, offsets)
        else:  # the same q / k norm as ours (one compiled graph before the kernel), so only the offsets differ
            q, k, v = pick(gd.kernel_inputs, True)(q, k, v)
            o = fla_rule(q[None], k[None], v[None], g[None], beta[None],
                         scale=d ** -0.5, cu_seqlens=cu, use_qk_l2norm_in_kernel=False)[0][0]
        o.backward(grad)
        return [o.detach(), x.grad, w.grad, a.grad, b.grad]

    split_seen = False
    for lens in ((37, 130, 91, 700, 1090), (16384, 100)):
        bounds = gd.segment_bounds([sum(lens[:i]) for i in range(len(lens))], sum(lens))
        offsets = gd.PackedOffsets(bounds, dev)
        assert torch.equal(offsets.conv_chunks(), prepare_chunk_indices(offsets.cu, gd.FLA_CONV_CHUNK))
        ctx = offsets.flash_qla_context(hv, True)
        auto = _auto_intra_cp_context(torch.empty(1, 1, hk, d), torch.empty(1, 1, hv, d), offsets.cu,
                                      CHUNK_SIZE, True, True)
        assert ctx.is_intra == auto.is_intra
        split_seen |= ctx.is_intra
        for name in ("intra_cp_cu_seqlens", "seq_map_r2c", "seq_map_c2r", "ht_mask", "ht_mask_bwd"):
            got, want = getattr(ctx, name), getattr(auto, name)
            assert (got is None and want is None) or torch.equal(got, want), name
        tensors = inputs(sum(lens), seed=len(lens))
        ours, theirs = step(tensors, offsets, True), step(tensors, offsets, False)
        for name, got, want in zip(("output", "dx", "dw", "da", "db"), ours, theirs):
            assert _rel(got, want) <= 1e-3, (lens, name, _rel(got, want))
        # a fresh layout object (new tensors, nothing cached), kernels already compiled
        fresh = gd.PackedOffsets(bounds, dev)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(tensors, fresh, True, conv=gd.packed_causal_conv1d)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert split_seen, "no layout took FlashQLA's intra-card split: the test missed that path"


def test_grouped_experts_match_the_loop_in_bf16():
    from vlmrl.models.moe import expert_mlp

    torch.manual_seed(0)
    experts, hidden, ffn, tokens = 64, 2048, 512, 4096 * 8
    counts = torch.multinomial(torch.ones(experts), tokens, replacement=True).bincount(minlength=experts)
    counts[3] = 0  # an expert without tokens
    counts[4] += tokens - int(counts.sum())
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    gate_up = (torch.randn(experts, 2 * ffn, hidden, device="cuda") * 0.02).bfloat16()
    down = (torch.randn(experts, hidden, ffn, device="cuda") * 0.02).bfloat16()
    probs = torch.rand(tokens, device="cuda")
    grad = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    results = []
    for grouped in (True, False):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, gate_up, down)]
        out = expert_mlp(leaves[0], counts.tolist(), leaves[1], leaves[2], probs, grouped=grouped)
        out.backward(grad)
        results.append([out.detach()] + [t.grad for t in leaves])
    for name, a, b in zip(("output", "grad x", "grad gate_up", "grad down"), *results):
        assert _rel(a, b) <= 1e-2, (name, _rel(a, b))


def test_cuda_qwen35_moe_matches_hf(tiny_config):
    """The tiny Qwen3.5-MoE on one GPU (NCCL, fp32, TF32 off, torch GDN path) within the CPU
    suite's parity bounds of HF transformers, and a packed sample equal to it alone."""
    from vlmrl import parity
    from vlmrl.config import load
    from vlmrl.training.parallel_state import spawn_local

    model = load(["model=tiny_qwen3_5_moe"], check_rules=False).model
    res = spawn_local(parity.worker, 1, model, [parity.single_layout(1)], 0, True, False, None, "torch",
                      backend="nccl", timeout_s=400)[0]
    checks = parity.compare(res)
    print(parity.format_table(checks))
    assert all(c.ok for c in checks), parity.format_table(checks)


def test_compiled_moe_block_on_cuda():
    """`hardware.fused_kernels`' compiled MoE block (grouped GEMMs on Hopper) at 4096 tokens
    against Megatron's MoE forward of the same layer (float32, TF32 off, as the reference): the
    bf16 compiled block within 1.5x Megatron's own bf16 difference + 1e-2 (module docstring of
    tests/integration/test_moe_compiled.py, where the float32 maths is checked on the CPU).
    Routing replay on CUDA as on the CPU: with the engine's experts the compiled block sends
    every token where Megatron's RouterReplay does, and reports the same disagreement with the
    engine. With the router in the engines' precision (bf16 logits) the two paths may route a
    token differently only where its k-th and (k+1)-th logits lie within one bf16 ulp (on
    2026-12-05 their expert counts differed on CUDA at 4096 tokens, while the CPU's 48 tokens
    agree exactly): at most as many tokens differ as there are such near-ties."""
    from _dist import compiled_moe_worker

    from vlmrl.training.parallel_state import spawn_local

    tokens = 4096
    res = spawn_local(compiled_moe_worker, 1, tokens, "cuda", backend="nccl", timeout_s=400)[0]
    print({k: v for k, v in res.items() if k != "replay_counts"})
    assert res["compiled_bf16_vs_megatron_fp32"] <= 1.5 * res["megatron_bf16_vs_megatron_fp32"] + 1e-2
    assert res["counts_match"] == 1.0 and res["compiled_graphs"] >= 1
    assert res["engine_precision_problem"] is None
    assert res["engine_precision_tokens_differ"] <= res["engine_precision_near_ties"]
    megatron_counts, compiled_counts = res["replay_counts"]
    assert compiled_counts == megatron_counts
    assert res["replay_compiled_vs_megatron"] < 0.5 < 1.0 < res["replay_vs_own_routing"]
    (m_differ, m_known), (c_differ, c_known) = res["replay_mismatch_reported"]
    assert m_known == c_known == tokens - 3 and 0 < c_differ == m_differ <= c_known


def test_compiled_norm_compiles_once_across_micro_batch_sizes():
    """The compiled RMSNorm's forward and backward, at token counts on both sides of
    Inductor's mix-order reduction thresholds for a 2,048-wide hidden state (2,560 and 4,096
    tokens): one compile, however the micro-batches' sizes vary (`kernels.compile_options`).
    Before, each range of sizes compiled again (3-4 compiles per function in a training run's
    first steps)."""
    import torch._dynamo.utils

    from vlmrl.models.kernels import fused
    from vlmrl.models.norm import rms_norm

    graphs = torch._dynamo.utils.counters["stats"]
    w = torch.nn.Parameter(torch.randn(2048, device="cuda", dtype=torch.bfloat16) * 0.1)
    seen = []
    for tokens in (6000, 3000, 1000, 9000, 4096):
        x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        before = graphs["unique_graphs"]
        out = fused(rms_norm)(x, w, 1e-6, True)
        out.float().square().sum().backward()
        seen.append(graphs["unique_graphs"] - before)
        ref = rms_norm(x.detach(), w.detach(), 1e-6, True)
        assert _rel(out.detach(), ref) < 2e-2
    assert seen == [1, 0, 0, 0, 0], seen


def test_fused_layers_on_cuda():
    """`FusedTransformerLayer`'s compiled fast path on CUDA, both Qwen3.5 layer kinds, five
    packed samples (4048 tokens: flash varlen attention in bf16; the torch Gated DeltaNet
    recurrence, which both paths share, so no TileLang compile for the miniature's heads: fla's
    kernels have their own test above) against Megatron's forward of the same layer: float32 agrees to
    1e-4 of the scale (TF32 off; Inductor's GEMMs may sum in another order); bf16 within 1.5x
    Megatron's own bf16 difference + 1e-2 (tests/integration/test_fused_layer.py)."""
    from _dist import fused_layer_worker

    from vlmrl.training.parallel_state import spawn_local

    res = spawn_local(fused_layer_worker, 1, (300, 700, 1000, 48, 2000), "cuda",
                      backend="nccl", timeout_s=500)[0]
    print(res)
    assert all(res["fast_path"])
    for kind in ("gdn", "attention"):
        r = res[kind]
        assert r["fp32"] <= 1e-4, (kind, r)
        assert r["moe_compiled"] and r["bf16_fast"] <= 1.5 * r["bf16_megatron"] + 1e-2, (kind, r)
        # bf16: the compiled MoE block runs inside the mixer's output graph, reported as its own span
        assert r["bf16_spans"] == [(kind, "start"), (kind, "stop"), ("moe", "start"), ("moe", "stop")], r
    assert res["observed_spans_bf16"] == {"gdn": 3, "attention": 1, "moe": 4}
    assert len(res["routed_layers_bf16"]) == 4
    assert set(res["routed_layers_bf16"].values()) == {res["routed_expected"]}


def _graph_steps(rank: int, world: int, cfg, path: str) -> dict:
    """Five SFT steps of the real trainer (bf16, compiled layers and MoE block) on the tiny
    Qwen3.5-MoE, the third on fewer tokens (another bucket), with `cfg`'s hardware.cuda_graphs."""
    import torch
    from test_trainer import _sft_samples

    from vlmrl.models.kernels import cuda_graph_stats
    from vlmrl.training.trainer import MegatronTrainer

    samples = _sft_samples(cfg, path)
    trainer = MegatronTrainer(cfg, path)
    steps, tokens = [], []
    for k in range(5):
        batch = samples[:2] if k == 2 else samples
        tokens.append([mb.packed.num_tokens for mb in trainer._step_micro_batches(batch)])
        m = trainer.sft_step(batch)
        steps.append((m["loss"], m["grad_norm"]))
    layers = [layer for c in trainer.chunks for layer in c.language_model.decoder.layers]
    return {"steps": steps, "tokens": tokens, "stats": cuda_graph_stats(), "graphs": trainer.cuda_graphs,
            "graph_layers": sum(bool(getattr(layer, "cuda_graphs", False)) for layer in layers),
            "graph_moe": sum(bool(getattr(layer.mlp, "cuda_graphs", False)) for layer in layers),
            "memory_gib": torch.cuda.max_memory_allocated() / 2**30}


def test_cuda_graphs_train_as_the_compiled_layers_do(tiny_moe_config, tiny_moe_checkpoint):
    """`hardware.cuda_graphs`: the trainer's compiled layer graphs and MoE block replayed as
    CUDA graphs, on micro-batches padded to their token bucket, give the same losses and
    gradient norms step by step as the same compiled layers launched kernel by kernel on the
    unpadded micro-batches. bf16, so the two runs differ by rounding only (flash attention's
    backward sums in a varying order; the padding changes the packed GEMMs' shapes): 2e-2
    relative, where a graph replaying stale inputs or weights gives O(1) errors. Where
    FlashAttention 4 is installed, a third run holds `hardware.lm_attention_backend=flash4`
    (the attention layer one graph, FlashAttention 4 inside it) to the same bound."""
    from vlmrl.training.parallel_state import spawn_local

    hw = dataclasses.replace(tiny_moe_config.hardware, device="cuda", dist_backend="nccl", fused_kernels=True,
                             train_dtype="bfloat16", vision_attn_implementation="sdpa")
    runs = {}
    variants = {False: {}, True: {}}
    try:
        import flash_attn.cute  # noqa: F401
        variants["flash4"] = {"lm_attention_backend": "flash4"}  # attention inside the layer's graph
    except ImportError:
        pass
    for key, extra in variants.items():
        cfg = dataclasses.replace(tiny_moe_config, hardware=dataclasses.replace(hw, cuda_graphs=bool(key), **extra))
        runs[key] = spawn_local(_graph_steps, 1, cfg, tiny_moe_checkpoint, backend="nccl", timeout_s=600)[0]
    print(runs)
    off = runs[False]
    for on in [runs[k] for k in runs if k]:
        _same_steps(on, off, tiny_moe_config.model.lm.num_layers)


def _same_steps(on: dict, off: dict, n_layers: int) -> None:
    assert on["graphs"] and on["graph_layers"] == n_layers and on["graph_moe"] == n_layers
    assert not off["graphs"] and off["stats"]["graphs"] == 0
    assert on["stats"]["graphs"] > 0, on["stats"]
    assert all(t % 64 == 0 for mbs in on["tokens"] for t in mbs), on["tokens"]
    assert on["tokens"] != off["tokens"]  # the buckets padded something
    for k, ((l1, g1), (l0, g0)) in enumerate(zip(on["steps"], off["steps"])):
        assert abs(l1 - l0) <= 2e-2 * abs(l0) and abs(g1 - g0) <= 2e-2 * g0, (k, on["steps"], off["steps"])
