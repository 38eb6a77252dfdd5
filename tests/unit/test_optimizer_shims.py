"""The optimizer pieces vlmrl swaps in where TransformerEngine and apex are absent: the
foreach grad norm and scale behind megatron's multi-tensor calls, and torch's fused Adam."""

from __future__ import annotations

import torch

from vlmrl.models import compat
from vlmrl.training.trainer import use_fused_adam


def _tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in [(7,), (3, 5), (2, 2, 4), (1,)]]


def test_foreach_l2_norm_is_the_norm_of_all_tensors():
    ts = _tensors(0)
    got, _ = compat.foreach_l2_norm(0, None, [ts], False)
    assert got.shape == (1,) and got.dtype == torch.float32
    assert torch.allclose(got[0], torch.linalg.vector_norm(torch.cat([t.flatten() for t in ts])), rtol=1e-6)


def test_foreach_scale_copies_casts_and_scales_in_place():
    src = _tensors(1)
    dst = [torch.empty_like(t, dtype=torch.bfloat16) for t in src]
    compat.foreach_scale(0, None, [src, dst], 1.0)
    for s, d in zip(src, dst):
        assert torch.equal(d, s.to(torch.bfloat16))
    compat.foreach_scale(0, None, [src, dst], 0.5)
    for s, d in zip(src, dst):
        assert torch.equal(d, (s * 0.5).to(torch.bfloat16))
    same = _tensors(2)
    before = [t.clone() for t in same]
    compat.foreach_scale(0, None, [same, same], 0.25)
    for a, b in zip(same, before):
        assert torch.equal(a, b * 0.25)


def test_megatron_uses_the_foreach_versions_after_apply():
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as moptimizer

    compat.apply()
    assert clip_grads.l2_norm_impl is compat.foreach_l2_norm
    assert clip_grads.multi_tensor_scale_impl is compat.foreach_scale
    assert moptimizer.multi_tensor_scale_impl is compat.foreach_scale


class _Wrapped:  # megatron's optimizers hold the torch one as `.optimizer`
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer


def test_fused_adam_takes_the_steps_foreach_takes():
    params = [[torch.nn.Parameter(t.clone()) for t in _tensors(3)] for _ in range(2)]
    opts = [torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1) for p in params]
    for step in range(3):
        for i, (p, o) in enumerate(zip(params, opts)):
            for t, g in zip(p, _tensors(10 + step)):
                t.grad = g
            o.step()
            if step == 0 and i == 1:  # switch after the first step: existing state carries over
                assert use_fused_adam(_Wrapped(o)) == 1
                assert all(grp["fused"] and not grp["foreach"] for grp in o.param_groups)
    for a, b in zip(*params):
        assert torch.allclose(a, b, atol=1e-6)
    assert use_fused_adam(_Wrapped(torch.optim.SGD(params[0], lr=0.1))) == 0


def test_distributed_optimizer_places_follow_its_groups():
    """megatron-core's DistributedOptimizer holds each group as [float32 params, float32 copies
    of the 16-bit ones]; the places it records follow the gradient buffer's order, so in a group
    that mixes the two they name other parameters. The fix points each parameter at its own."""
    from types import SimpleNamespace

    from vlmrl.training.trainer import fix_param_group_index_map

    fp32 = [torch.zeros(32), torch.zeros(4)]  # e.g. a Gated DeltaNet's A_log and norm weight
    half = [torch.zeros(256, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16)]
    buffer_order = [half[0], fp32[0], half[1], fp32[1]]
    opt = SimpleNamespace(model_fp32_groups=[fp32], model_float16_groups=[half],
                          model_param_group_index_map={p: (0, i) for i, p in enumerate(buffer_order)})
    held = [*fp32, *(p.float() for p in half)]  # the group as the optimizer steps it
    assert fix_param_group_index_map(SimpleNamespace(chained_optimizers=[opt, SimpleNamespace()])) == 4
    for p in buffer_order:
        g, order = opt.model_param_group_index_map[p]
        assert held[order].numel() == p.numel()
    assert fix_param_group_index_map(opt) == 0  # already right: nothing changes


def test_reshardable_state_loads_into_torch_adam_and_keeps_its_step():
    """megatron-core 0.16's own setter, as its DistributedOptimizer calls it while loading a
    reshardable checkpoint into torch's Adam: it asks the saved tensors for the "step" counter
    the live state carries and fails; patched, it copies the saved moments and parameter and
    leaves the counter as the loaded param groups set it."""
    import types

    import pytest
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from vlmrl.training.trainer import fix_torch_adam_state_load

    main = torch.nn.Parameter(torch.zeros(6))
    adam = torch.optim.Adam([main], lr=0.1)
    main.grad = torch.ones(6)
    adam.step()
    model_param = torch.zeros(6, dtype=torch.bfloat16)
    opt = types.SimpleNamespace(config=types.SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False),
                                model_param_group_index_map={model_param: (0, 0)}, optimizer=adam)
    opt._set_main_param_and_optimizer_states = types.MethodType(
        DistributedOptimizer._set_main_param_and_optimizer_states, opt)
    saved = {"param": torch.full((6,), 2.0), "exp_avg": torch.full((6,), 3.0), "exp_avg_sq": torch.full((6,), 4.0)}
    with pytest.raises(KeyError, match="step"), torch.no_grad():  # megatron loads under no_grad
        opt._set_main_param_and_optimizer_states(model_param, saved)
    adam.state[main]["step"] = torch.tensor(7.0)  # as load_state_dict sets it from the param groups
    assert fix_torch_adam_state_load(types.SimpleNamespace(chained_optimizers=[opt])) == 1
    assert fix_torch_adam_state_load(opt) == 0  # once per optimizer
    with torch.no_grad():
        opt._set_main_param_and_optimizer_states(model_param, saved)
    state = adam.state[main]
    assert torch.equal(main.detach(), saved["param"]) and float(state["step"]) == 7.0
    assert torch.equal(state["exp_avg"], saved["exp_avg"]) and torch.equal(state["exp_avg_sq"], saved["exp_avg_sq"])
