"""GRPO / Dr.GRPO advantages: exact zeros for all-equal groups, known values, validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vlmrl.algo import (
    compute_advantages,
    dr_grpo_advantages,
    group_reward_stats,
    grpo_advantages,
)

EQUAL_VALUES = [0.0, 1.0, 0.9, 0.1, 0.7, 0.3, 1e-8, -2.5, 123.456]


@pytest.mark.parametrize("value", EQUAL_VALUES)
@pytest.mark.parametrize("group_size", [2, 3, 5, 7, 8, 12, 16])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.float64])
def test_all_equal_group_gives_exact_zero(value: float, group_size: int, input_dtype: torch.dtype) -> None:
    rewards = torch.full((3 * group_size,), value, dtype=input_dtype)
    for estimator in ("grpo", "dr_grpo"):
        for reward_dtype in ("float64", "float32"):
            advantages = compute_advantages(estimator, rewards, group_size, reward_dtype)
            assert (advantages == 0).all()
    assert (grpo_advantages(rewards, group_size, eps=1e-12) == 0).all()


def test_all_equal_random_groups_are_zero_next_to_informative_ones() -> None:
    generator = torch.Generator().manual_seed(0)
    group_size = 8
    constant = torch.rand(64, 1, generator=generator).expand(64, group_size)
    varied = torch.rand(64, group_size, generator=generator)
    rewards = torch.cat([constant, varied]).reshape(-1).to(torch.float32)
    advantages = compute_advantages("grpo", rewards, group_size).reshape(128, group_size)
    assert (advantages[:64] == 0).all()
    assert (advantages[64:].abs().sum(dim=1) > 0).all()


def test_naive_float32_statistics_leave_residue() -> None:
    """The failure this module guards against: documents why the masking is needed."""
    rewards = torch.full((8,), 0.9, dtype=torch.float32)
    naive = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    assert naive.abs().max() > 1e-3
    assert (grpo_advantages(rewards, 8) == 0).all()


def test_known_values() -> None:
    advantages = grpo_advantages([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 1.5], 4, eps=0.0)
    # group 1: mean 0.25, unbiased std 0.5; group 2: mean 0.75, unbiased std 0.5
    expected = torch.tensor([1.5, -0.5, -0.5, -0.5, -0.5, -0.5, -0.5, 1.5], dtype=torch.float64)
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-12)
    with_eps = grpo_advantages([1.0, 0.0], 2)
    torch.testing.assert_close(with_eps, torch.tensor([0.5, -0.5], dtype=torch.float64) / (2**-0.5 + 1e-6))


def test_dr_grpo_is_mean_centred() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.9, 0.2])
    expected = rewards.double().reshape(2, 3)
    expected = (expected - expected.mean(dim=1, keepdim=True)).reshape(-1)
    torch.testing.assert_close(dr_grpo_advantages(rewards, 3), expected)
    torch.testing.assert_close(grpo_advantages(rewards, 3, normalize_std=False), expected)
    torch.testing.assert_close(compute_advantages("dr_grpo", rewards, 3), expected.float())


def test_group_size_one_gives_zeros() -> None:
    rewards = [0.3, 1.0, 0.0, 0.9]
    for estimator in ("grpo", "dr_grpo"):
        advantages = compute_advantages(estimator, rewards, 1)
        assert (advantages == 0).all() and not advantages.isnan().any()
    stats = group_reward_stats(rewards, 1)
    assert (stats.std == 0).all() and stats.zero_advantage_fraction == 1.0


def test_shapes_and_dtypes() -> None:
    for rewards in ([0.0, 1.0, 1.0, 1.0], np.array([0.0, 1.0, 1.0, 1.0]), torch.tensor([0, 1, 1, 1])):
        assert grpo_advantages(rewards, 2).dtype == torch.float64
        assert grpo_advantages(rewards, 2, dtype=torch.float32).dtype == torch.float32
        advantages = compute_advantages("grpo", rewards, 2)
        assert advantages.shape == (4,) and advantages.dtype == torch.float32
    assert compute_advantages("grpo", torch.empty(0), 4).shape == (0,)


def test_group_reward_stats() -> None:
    stats = group_reward_stats([1.0, 1.0, 0.0, 1.0, 0.9, 0.9], 2)
    torch.testing.assert_close(stats.mean, torch.tensor([1.0, 0.5, 0.9], dtype=torch.float64))
    torch.testing.assert_close(stats.std, torch.tensor([0.0, 2**-0.5, 0.0], dtype=torch.float64))
    assert stats.zero_advantage_fraction == pytest.approx(2 / 3)
    assert group_reward_stats([], 4).zero_advantage_fraction == 0.0


def test_validation_errors() -> None:
    with pytest.raises(ValueError, match=r"5 rewards do not split into groups of group_size=2"):
        grpo_advantages([0.0] * 5, 2)
    with pytest.raises(ValueError, match="7 rewards .* group_size=4"):
        compute_advantages("grpo", torch.zeros(7), 4)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        grpo_advantages([0.0], 0)
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(torch.zeros(2, 4), 4)
    with pytest.raises(ValueError, match="NaN"):
        grpo_advantages([0.0, float("nan")], 2)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        compute_advantages("ppo", [0.0, 1.0], 2)
    with pytest.raises(ValueError, match="unknown reward_dtype 'float16'"):
        compute_advantages("grpo", [0.0, 1.0], 2, reward_dtype="float16")


@pytest.mark.parametrize("group_size", [2, 5, 8, 16])
def test_groups_of_format_scores_give_exact_zero_advantages(group_size: int) -> None:
    """A batch where every answer is boxed but wrong: every reward is the verifier's format
    score 0.9, which float32 cannot represent. Each group carries no signal, so every
    advantage is exactly 0.0 (==, not approx): with std normalisation on (a residue over a
    residue-sized std would be of order one), from float32 and float64 rewards, with the
    statistics in either dtype."""
    from vlmrl.rewards import get_verifier

    verifier = get_verifier("geo3k_tol05", format_score=0.9)
    responses = [f"so \\boxed{{x = {8 + i % 3}}}" for i in range(4 * group_size)]
    scores = [verifier(response, "7") for response in responses]
    assert scores == [0.9] * len(scores)
    for rewards in (
        scores,
        torch.tensor(scores, dtype=torch.float32),
        torch.tensor(scores, dtype=torch.float64),
        np.asarray(scores, dtype=np.float32),
    ):
        for estimator in ("grpo", "dr_grpo"):
            for reward_dtype in ("float64", "float32"):
                advantages = compute_advantages(estimator, rewards, group_size, reward_dtype)
                assert advantages.tolist() == [0.0] * len(scores)
        for dtype in (torch.float64, torch.float32):
            for eps in (1e-6, 1e-12, 0.0):
                advantages = grpo_advantages(rewards, group_size, normalize_std=True, eps=eps, dtype=dtype)
                assert advantages.tolist() == [0.0] * len(scores)
                assert not advantages.isnan().any()
    # Next to a group that does carry signal (one right answer), the all-0.9 groups stay exactly
    # zero and the informative group is pushed towards the right answer.
    mixed = torch.tensor([*scores[group_size:], 1.0, *[0.9] * (group_size - 1)], dtype=torch.float32)
    advantages = compute_advantages("grpo", mixed, group_size).reshape(-1, group_size)
    assert (advantages[:-1] == 0.0).all()
    assert advantages[-1, 0] > 0 and (advantages[-1, 1:] < 0).all()
