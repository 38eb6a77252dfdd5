"""`hardware.fused_grad_accumulation`'s kernel (`vlmrl.training.grad_accumulation`): a
micro-batch's bf16 / fp16 gradient added into a float32 main gradient gives the very bits
torch's `main_grad.add_(grad)` (Megatron's hook) gives, for lengths around its block size; a
pair it does not take is left to the caller, untouched."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 4095, 4096, 4097, 3 * 4096 + 5, 2**21 + 7])
def test_accumulate_gives_torchs_sum_bit_for_bit(n, dtype):
    from vlmrl.training.grad_accumulation import accumulate

    gen = torch.Generator().manual_seed(n)
    main = (1e-3 * torch.randn(n, generator=gen)).cuda()
    ref = main.clone()
    for scale in (1.0, 1e-4, 30.0):  # three micro-batches, gradients of other magnitudes
        grad = (scale * torch.randn(n, generator=gen)).to("cuda", dtype)
        ref.add_(grad)
        assert accumulate(main, grad)
    assert torch.equal(main, ref)


def test_pairs_it_does_not_take_are_left_to_the_caller():
    from vlmrl.training.grad_accumulation import accumulate

    main = torch.zeros(64, 32, device="cuda")
    strided = torch.ones(32, 64, device="cuda", dtype=torch.bfloat16).t()  # a transposed gradient
    assert not accumulate(main, strided) and not accumulate(main, torch.ones(64, 32, device="cuda"))
    assert not accumulate(main.cpu(), torch.ones(64, 32, dtype=torch.bfloat16))
    assert torch.count_nonzero(main) == 0
