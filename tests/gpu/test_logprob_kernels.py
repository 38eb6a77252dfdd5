"""The loss's Triton kernels (`vlmrl.training.logprob_kernels`, what `fused_log_softmax_pick`
runs on CUDA) against the plain log-softmax (`log_softmax_pick`), on the shapes the
trainer and the bench give them: [1, T, V] logits, no entropy (the bench's and an SFT
step's loss) and with it, few rows (each row then cut into several stretches) and many.

Float32 maths inside on both sides; logp and entropy to 1e-4 (sums over 10^5 terms in another
order). The gradient: float32 logits to 1e-5 of its largest entry; bf16 logits to one bf16
step (2^-8) of it: both round the same float32 value once, and the plain side's
probabilities come from another exp and sum order."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows,vocab,with_entropy,dtype", [
    (8, 151936, False, torch.bfloat16),     # few rows: several stretches per row
    (2048, 32000, True, torch.bfloat16),
    (300, 50000, True, torch.float32),
])
def test_triton_loss_matches_the_plain_log_softmax(rows, vocab, with_entropy, dtype):
    from vlmrl.training import logprob_kernels
    from vlmrl.training.logprobs import fused_log_softmax_pick, log_softmax_pick

    gen = torch.Generator().manual_seed(rows)
    base = (4 * torch.randn(1, rows, vocab, generator=gen)).to("cuda", dtype)
    targets = torch.randint(0, vocab, (1, rows), generator=gen).to("cuda")
    g_logp = torch.randn(1, rows, generator=gen).to("cuda")
    g_ent = torch.randn(1, rows, generator=gen).to("cuda")
    assert logprob_kernels.supported(base)
    if rows == 8:
        assert logprob_kernels._parts(rows, vocab) > 1
    out, grads = [], []
    for fn in (fused_log_softmax_pick, log_softmax_pick):
        x = base.detach().clone().requires_grad_()
        logp, ent = fn(x, targets, 1.0, with_entropy)
        loss = (logp * g_logp).sum() + ((ent * g_ent).sum() if with_entropy else 0.0)
        loss.backward()
        out.append((logp, ent))
        grads.append(x.grad)
    torch.testing.assert_close(out[0][0], out[1][0], rtol=1e-4, atol=1e-4)
    if with_entropy:
        torch.testing.assert_close(out[0][1], out[1][1], rtol=1e-4, atol=1e-4)
    scale = grads[1].float().abs().max().item()
    bound = 1e-5 if dtype == torch.float32 else 2 ** -8
    assert grads[0].dtype == dtype
    assert (grads[0].float() - grads[1].float()).abs().max().item() <= bound * scale
