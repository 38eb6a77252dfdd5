"""Which of a trainer rank's storages stay on the GPU while the engines generate, and where the
rest sit in the pinned host copy (the pure part of `vlmrl.training.offload`; the moves
themselves need a GPU: tests/gpu/test_offload_gpu.py)."""

from __future__ import annotations

from vlmrl.training.offload import choose_resident, host_layout, storage_kind


def test_each_storage_is_weights_optimizer_state_or_gradients():
    assert storage_kind(keep=False, fixed=False, optimizer=False) == "grads"
    assert storage_kind(keep=True, fixed=True, optimizer=False) == "weights"
    assert storage_kind(keep=True, fixed=False, optimizer=True) == "optimizer"
    # a parameter the optimizer updates in place (fp32 training: no main copy) is read by the
    # forward too: it moves with the weights, never behind the backward
    assert storage_kind(keep=True, fixed=True, optimizer=True) == "weights"
    assert storage_kind(keep=True, fixed=False, optimizer=False) == "weights"


def test_weights_stay_whole_and_optimizer_state_in_order_up_to_the_budget():
    storages = [(1, 100, "weights"), (2, 50, "grads"), (3, 40, "optimizer"), (4, 40, "optimizer"),
                (5, 30, "optimizer"), (6, 10, "optimizer"), (7, 20, "weights")]
    assert choose_resident(storages, resident_weights=True, optimizer_budget=0) == {1, 7}
    # 40 fits, the next 40 does not (80 > 75), 30 still does (70), then 10 does not (80)
    assert choose_resident(storages, resident_weights=False, optimizer_budget=75) == {3, 5}
    # what is already resident counts against the budget (storages adopted later: a load's)
    assert choose_resident(storages, resident_weights=False, optimizer_budget=75, optimizer_kept=40) == {5}
    assert choose_resident(storages, resident_weights=False, optimizer_budget=1e12) == {3, 4, 5, 6}
    # gradients never stay: every step zeroes them, so dropping them costs nothing
    assert 2 not in choose_resident(storages, resident_weights=True, optimizer_budget=1e12)


def test_host_layout_aligns_each_storage():
    offsets, total = host_layout([(10, 1), (11, 512), (12, 513), (13, 0)])
    assert offsets == {10: 0, 11: 512, 12: 1024, 13: 2048} and total == 2048
    assert host_layout([]) == ({}, 0)
    offsets, total = host_layout([(1, 4096), (2, 100)], align=4096)
    assert offsets == {1: 0, 2: 4096} and total == 8192
