"""The Megatron language model on a GPU: fused kernels compiled by Triton, NCCL parity.

`hardware.fused_kernels` is on in every GPU hardware config, so the trainer's norms,
M-RoPE, SwiGLU and log-softmax run as Triton kernels there. These tests hold those kernels
to the same bounds as the CPU suite: against their plain definitions per function
(float32 and bfloat16), and the whole model (fp32, TF32 off) against HF transformers.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_triton_kernels_match_plain(dtype, tol):
    from vlmrl.models.kernels import fused
    from vlmrl.models.mrope import MRopeSpec, mrope_cos_sin, rope_qk
    from vlmrl.models.norm import rms_norm
    from vlmrl.training.logprobs import fused_log_softmax_pick, log_softmax_pick

    dev = "cuda"
    torch.manual_seed(0)
    x = torch.randn(1000, 1, 256, device=dev, dtype=dtype)
    w = (1 + 0.1 * torch.randn(256, device=dev)).to(dtype)
    assert torch.allclose(fused(rms_norm)(x, w, 1e-6, False).float(), rms_norm(x, w, 1e-6, False).float(),
                          atol=tol, rtol=tol)
    spec = MRopeSpec(head_dim=128, rotary_dim=128, theta=1e6, mrope_section=(16, 24, 24))
    cos, sin = mrope_cos_sin(torch.randint(0, 4000, (3, 1000), device=dev), spec, dtype=dtype)
    q, k = torch.randn(1000, 12, 128, device=dev, dtype=dtype), torch.randn(1000, 2, 128, device=dev, dtype=dtype)
    for a, b in zip(fused(rope_qk)(q, k, cos, sin), rope_qk(q, k, cos, sin)):
        assert torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)
    logits = (4 * torch.randn(1000, 32000, device=dev)).to(dtype).requires_grad_()
    targets = torch.randint(0, 32000, (1000,), device=dev)
    got = fused(log_softmax_pick)(logits, targets, 1.0, True)
    (g1,) = torch.autograd.grad(got[0].sum() + got[1].sum(), logits)
    ref = log_softmax_pick(logits, targets, 1.0, True)
    (g2,) = torch.autograd.grad(ref[0].sum() + ref[1].sum(), logits)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)  # float32 math inside in both dtypes
    assert torch.allclose(g1.float(), g2.float(), atol=tol, rtol=tol)
    # the trainer's fused loss: one compiled pass each way, the backward written by hand
    for temperature in (1.0, 0.7):
        got = fused_log_softmax_pick(logits, targets, temperature, True)
        ref = log_softmax_pick(logits, targets, temperature, True)
        weights = torch.randn(1000, device=dev)
        (g1,) = torch.autograd.grad((got[0] * weights).sum() + got[1].sum(), logits)
        (g2,) = torch.autograd.grad((ref[0] * weights).sum() + ref[1].sum(), logits)
        for a, b in zip(got, ref):
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
        # bfloat16: both round the same float32 gradient to the logits' dtype. float32: the
        # two sum the partition function in different orders, and an lse near 20 carries its
        # last bit (2e-6) into every probability and entropy term (largest entries near 5):
        # measured on the CPU, 1.2e-5 to 2.2e-5 apart
        atol = tol * 1e-2 if dtype == torch.bfloat16 else 1e-5 * float(g2.abs().max())
        assert torch.allclose(g1.float(), g2.float(), atol=atol, rtol=tol)


@pytest.mark.parametrize("fused_kernels", [False, True])
def test_cuda_model_matches_hf(fused_kernels):
    from test_megatron_parity import small_model

    from vlmrl import parity
    from vlmrl.training.parallel_state import spawn_local

    res = spawn_local(parity.worker, 1, small_model(), [parity.single_layout(1)], 0, True, fused_kernels,
                      backend="nccl", timeout_s=400)[0]
    assert res["single"].fast_path_layers == (4 if fused_kernels else 0)
    assert parity.max_abs_diff(res["single"].logits, res["hf"].logits) <= parity.LOGITS_VS_HF
    assert parity.max_abs_diff(res["single"].grads, res["hf"].grads) <= parity.GRADS_VS_HF


def _cuda_sft_grad_norm(rank: int, world: int, cfg, path: str) -> tuple[float, float, int]:
    import torch
    from test_trainer import _sft_grad_norms

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False  # the vision tower's patch Conv3d
    res = _sft_grad_norms(rank, world, {"single": cfg}, path)
    return res["single"][0], res["hf"], res["single"][1]


def test_trainer_step_on_cuda_is_the_per_token_mean(tiny_config, tiny_checkpoint):
    """The real trainer on one GPU (NCCL, Megatron DDP + distributed optimizer, the compiled
    dense layers, fp32): its step's gradient norm equals HF's per-token mean NLL's."""
    from vlmrl.training.parallel_state import spawn_local

    hw = dataclasses.replace(tiny_config.hardware, device="cuda", dist_backend="nccl", fused_kernels=True)
    cfg = dataclasses.replace(tiny_config, hardware=hw)
    megatron_norm, hf_norm, fast = spawn_local(_cuda_sft_grad_norm, 1, cfg, tiny_checkpoint, backend="nccl",
                                               timeout_s=600)[0]
    assert fast == cfg.model.lm.num_layers
    assert abs(megatron_norm - hf_norm) <= 1e-4 * hf_norm, (megatron_norm, hf_norm)


def test_per_sample_attention_padded_for_cudnn_matches_unpadded():
    """A causal sample padded at its end to `CUDNN_LEN_MULTIPLE` tokens (so cuDNN meets a
    bounded set of lengths) attends as the unpadded sample does: outputs and q/k/v gradients
    of the real tokens within bf16 rounding of one attention (2e-2), padding gets none."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from vlmrl.models.attention import CUDNN_LEN_MULTIPLE, PackedSelfAttentionCore

    cfg = TransformerConfig(num_layers=1, hidden_size=1024, num_attention_heads=8, num_query_groups=2,
                            kv_channels=128, attention_dropout=0.0)
    core = PackedSelfAttentionCore(cfg, 1, AttnMaskType.causal)
    torch.manual_seed(0)
    n = 3 * CUDNN_LEN_MULTIPLE - 37
    q = torch.randn(n, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(n, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(n, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(n, 8, 128, device="cuda", dtype=torch.bfloat16)
    padded = core._sample(q, k, v)
    grads_padded = torch.autograd.grad(padded, (q, k, v), dout)
    plain = core._sdpa(q, k, v, None, True)
    grads_plain = torch.autograd.grad(plain, (q, k, v), dout)
    assert padded.shape == (n, 8, 128)
    assert (padded.float() - plain.float()).abs().max() <= 2e-2
    for a, b in zip(grads_padded, grads_plain):
        assert (a.float() - b.float()).abs().max() <= 2e-2 * max(1.0, b.float().abs().max().item())


@pytest.mark.parametrize("heads,groups,head_dim", [(12, 2, 128), (16, 2, 256)])
def test_flash4_attention_matches_the_sdpa_path(heads, groups, head_dim):
    """`hardware.lm_attention_backend=flash4`: FlashAttention 4's one varlen call over the
    packed samples (KV groups read natively, no padding) against the "sdpa" backend's
    per-sample cuDNN calls (each sample padded, K / V repeated per query head), at the dense
    shape's heads (12 / 2 of 128) and Qwen3.5's gated attention's (16 / 2 of 256). Outputs and
    q / k / v gradients within 2e-2 of the largest reference value: two bf16 flash kernels,
    each rounding P and the output to bf16 once, with different tilings."""
    pytest.importorskip("flash_attn.cute")
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from vlmrl.models.attention import PackedSelfAttentionCore, VLPackedSeqParams

    cfg = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                            num_query_groups=groups, kv_channels=head_dim, attention_dropout=0.0)
    lens = [37, 300, 1000, 700, 2059]
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    torch.manual_seed(0)
    total = offsets[-1]
    q = torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, groups, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(total, groups, head_dim, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(total, heads * head_dim, device="cuda", dtype=torch.bfloat16)
    results = {}
    for backend in ("sdpa", "flash4"):
        core = PackedSelfAttentionCore(cfg, 1, AttnMaskType.causal, backend=backend)
        params = VLPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, host_offsets=offsets)
        qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
        out = core.attend(qq, kk, vv, params)
        results[backend] = (out, *torch.autograd.grad(out, (qq, kk, vv), dout))
    for name, got, want in zip(("out", "dq", "dk", "dv"), results["flash4"], results["sdpa"]):
        assert got.shape == want.shape, name
        err = (got.float() - want.float()).abs().max().item()
        assert err <= 2e-2 * max(1.0, want.float().abs().max().item()), (name, err)
    # the trainer's startup check at these heads: FlashAttention 4 against the float32 softmax
    from vlmrl.models.attention import ATTENTION_CHECK_TOL, check_attention_backend

    worst = check_attention_backend("flash4", heads=heads, groups=groups, head_dim=head_dim,
                                    device=torch.device("cuda"), dtype=torch.bfloat16)
    assert worst <= ATTENTION_CHECK_TOL[torch.bfloat16]


@pytest.mark.parametrize("heads,groups,head_dim,gated", [(12, 2, 128, False), (16, 2, 256, True)])
def test_flash4_inside_the_layer_graph_matches_the_eager_layer(heads, groups, head_dim, gated):
    """With flash4, an attention layer is one compiled graph (`fused_layer.attention_layer`,
    FlashAttention 4 a custom op inside it, `vlmrl.models.flash4`), replayed as CUDA graphs.
    Against the same layer run eagerly (the input and output functions uncompiled, the
    "sdpa" backend's attention between them), bf16: output and the gradients of the input,
    the QKV and output projections and the MLP within 2e-2 of the largest reference value.
    Five calls with new values each: three of five samples (offsets padded to eight; CUDA
    graph trees warm up, record, then replay, where stale inputs would give O(1) errors), two
    of three samples (offsets padded to four: another recording). `torch.library.opcheck`
    checks the ops' schema, fake shapes and autograd registration against the kernels."""
    pytest.importorskip("flash_attn.cute")
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from vlmrl.models import flash4
    from vlmrl.models.attention import PackedSelfAttentionCore, VLPackedSeqParams
    from vlmrl.models.fused_layer import attention_in, attention_layer, attention_out
    from vlmrl.models.kernels import begin_graph_step, fused
    from vlmrl.models.mrope import MRopeSpec, mrope_cos_sin

    dev, dt = torch.device("cuda"), torch.bfloat16
    hidden, ffn, total = 1024, 2048, 4096
    torch.manual_seed(0)
    per = heads // groups
    qkv_rows = groups * (per * head_dim * (2 if gated else 1) + 2 * head_dim)

    def w(*shape: int, scale: float = 0.02) -> torch.Tensor:
        p = torch.nn.Parameter((scale * torch.randn(*shape, device=dev)).to(dt))
        torch._dynamo.mark_static_address(p, guard=False)  # as `kernels.use_cuda_graphs` marks the model's
        return p

    weights = {"qkv": w(qkv_rows, hidden), "proj": w(hidden, heads * head_dim), "fc1": w(2 * ffn, hidden),
               "fc2": w(hidden, ffn), "norm1": w(hidden, scale=1.0), "norm2": w(hidden, scale=1.0)}
    spec = MRopeSpec(head_dim=head_dim, rotary_dim=128, theta=1e6, mrope_section=(16, 24, 24), interleaved=gated)
    cfg = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
                            kv_channels=head_dim, attention_dropout=0.0)
    core = PackedSelfAttentionCore(cfg, 1, AttnMaskType.causal, backend="sdpa")

    def args(offsets: list[int], h: torch.Tensor) -> tuple:
        pos = torch.cat([torch.arange(b - a) for a, b in zip(offsets[:-1], offsets[1:])]).to(dev)
        cos, sin = mrope_cos_sin(pos.expand(3, -1), spec, dtype=dt)
        return (h, (weights["norm1"], 1e-6, gated), weights["qkv"], None, None, None, cos, sin, heads, groups,
                head_dim, gated), (weights["proj"], (weights["norm2"], 1e-6, gated), weights["fc1"], weights["fc2"])

    def eager(offsets: list[int], h: torch.Tensor) -> torch.Tensor:
        a_in, (proj, norm2, fc1, fc2) = args(offsets, h)
        q, k, v, gate = attention_in(*a_in)
        params = VLPackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor(offsets, dtype=torch.int32, device=dev),
                                   cu_seqlens_kv=torch.tensor(offsets, dtype=torch.int32, device=dev),
                                   host_offsets=offsets)
        return attention_out(core.attend(q, k, v, params), gate, h, proj, norm2, fc1, fc2)[0]

    def graph(offsets: list[int], h: torch.Tensor) -> torch.Tensor:
        a_in, (proj, norm2, fc1, fc2) = args(offsets, h)
        padded, max_len = flash4.graph_layout(offsets)
        cu = torch.tensor(padded, dtype=torch.int32, device=dev)
        begin_graph_step()
        return fused(attention_layer, True)(*a_in, cu, max_len, True, proj, norm2, fc1, fc2, moe=None)[0]

    layouts = [[0, 37, 337, 1337, 2037, 4096]] * 3 + [[0, 1000, 1100, 4096]] * 2
    for call, offsets in enumerate(layouts):
        h = torch.randn(total, 1, hidden, device=dev, dtype=dt, requires_grad=True)
        dout = torch.randn(total, 1, hidden, device=dev, dtype=dt)
        wrt = (h, weights["qkv"], weights["proj"], weights["fc1"], weights["fc2"])
        results = {}
        for name, fn in (("eager", eager), ("graph", graph)):
            out = fn(offsets, h)
            results[name] = [x.detach().clone() for x in (out, *torch.autograd.grad(out, wrt, dout))]
        for label, got, want in zip(("out", "dh", "dqkv", "dproj", "dfc1", "dfc2"), results["graph"],
                                    results["eager"]):
            err = (got.float() - want.float()).abs().max().item()
            assert err <= 2e-2 * max(1.0, want.float().abs().max().item()), (call, label, err)
    q = torch.randn(total, heads, head_dim, device=dev, dtype=dt, requires_grad=True)
    k, v = (torch.randn(total, groups, head_dim, device=dev, dtype=dt, requires_grad=True) for _ in range(2))
    padded, max_len = flash4.graph_layout(layouts[2])
    torch.library.opcheck(flash4.flash4_varlen_fwd, (q, k, v, torch.tensor(padded, dtype=torch.int32, device=dev),
                                                     max_len, head_dim ** -0.5, True),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
