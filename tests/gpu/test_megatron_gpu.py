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
    from vlmrl.training.logprobs import log_softmax_pick

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
    from test_trainer import _sft_grad_norm

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False  # the vision tower's patch Conv3d
    return _sft_grad_norm(rank, world, cfg, path)


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
