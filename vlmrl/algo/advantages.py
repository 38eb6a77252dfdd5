"""Group-relative advantages (GRPO, Dr.GRPO) from per-sample rewards.

Rewards arrive flat, ``num_groups * group_size`` long, with the samples of one prompt
contiguous. Group statistics are computed in float64 and groups whose rewards are all
equal get advantages of exactly zero.

Why exactness needs care: 0.9 is not representable in binary, so the float32 mean of
a group of eight 0.9 rewards is rounded and ``reward - mean`` leaves a residue of about
6e-8 although every reward is the same. The group's std is of the same tiny size, and
dividing by ``std + eps`` (eps = 1e-6) turns the residue into advantages of about 0.06;
with a smaller eps, or a leave-one-out std, into advantages of order one: the policy is
pushed on samples that carry no signal. float64 shrinks the residue (to about 1e-10
after normalisation) without removing it, so all-equal groups are detected by exact
comparison and set to zero explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

RewardsLike = torch.Tensor | np.ndarray | Sequence[float]

_REWARD_DTYPES = {"float64": torch.float64, "float32": torch.float32}


@dataclass(frozen=True)
class GroupRewardStats:
    """Per-group reward statistics, for logging.

    Attributes:
        mean: ``[num_groups]`` group means.
        std: ``[num_groups]`` unbiased group standard deviations (0 for groups of one).
        zero_advantage_fraction: share of groups whose rewards are all equal, which
            therefore contribute no policy gradient.
    """

    mean: torch.Tensor
    std: torch.Tensor
    zero_advantage_fraction: float


def grpo_advantages(
    rewards: RewardsLike,
    group_size: int,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Advantages ``(r - mean_g) / (std_g + eps)`` per group, flat, in ``dtype``.

    The std is the unbiased one (``torch.std``'s default, Bessel-corrected), as in the
    GRPO paper's formulation. Groups whose rewards are all equal, including every group
    of size one, get exactly 0. With ``normalize_std=False`` the result is the
    mean-centred reward of Dr.GRPO.

    Raises:
        ValueError: ``rewards`` is not 1-D or its length is not a multiple of ``group_size``.
    """
    grouped = _grouped(rewards, group_size, dtype)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        advantages = advantages / (_group_std(grouped) + eps)
    advantages = torch.where(_all_equal(grouped), torch.zeros_like(advantages), advantages)
    return advantages.reshape(-1)


def dr_grpo_advantages(
    rewards: RewardsLike, group_size: int, *, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """Dr.GRPO advantages: the reward minus its group mean, without std normalisation."""
    return grpo_advantages(rewards, group_size, normalize_std=False, dtype=dtype)


def compute_advantages(
    estimator: str,
    rewards: RewardsLike,
    group_size: int,
    reward_dtype: str = "float64",
    *,
    eps: float = 1e-6,
) -> torch.Tensor:
    """float32 advantages for the trainer, with the group statistics in ``reward_dtype``.

    Args:
        estimator: ``"grpo"`` (mean and std normalised) or ``"dr_grpo"`` (mean only).
        reward_dtype: ``"float64"`` (default) or ``"float32"``.
    """
    if reward_dtype not in _REWARD_DTYPES:
        raise ValueError(f"unknown reward_dtype {reward_dtype!r}; valid: {', '.join(_REWARD_DTYPES)}")
    dtype = _REWARD_DTYPES[reward_dtype]
    if estimator == "grpo":
        advantages = grpo_advantages(rewards, group_size, eps=eps, dtype=dtype)
    elif estimator == "dr_grpo":
        advantages = dr_grpo_advantages(rewards, group_size, dtype=dtype)
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}; valid: grpo, dr_grpo")
    return advantages.to(torch.float32)


def group_reward_stats(rewards: RewardsLike, group_size: int) -> GroupRewardStats:
    """Group means, stds and the fraction of all-equal ("zero-advantage") groups."""
    grouped = _grouped(rewards, group_size, torch.float64)
    num_groups = grouped.shape[0]
    zero_groups = int(_all_equal(grouped).sum())
    return GroupRewardStats(
        mean=grouped.mean(dim=1),
        std=_group_std(grouped).reshape(-1),
        zero_advantage_fraction=zero_groups / num_groups if num_groups else 0.0,
    )


def _grouped(rewards: RewardsLike, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Rewards as a ``[num_groups, group_size]`` tensor of ``dtype``, after validation."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    flat = torch.as_tensor(rewards, dtype=dtype)
    if flat.dim() != 1:
        raise ValueError(f"rewards must be 1-D (num_groups * group_size), got shape {tuple(flat.shape)}")
    if not bool(torch.isfinite(flat).all()):
        raise ValueError("rewards contain NaN or infinity")
    if flat.numel() % group_size:
        raise ValueError(f"{flat.numel()} rewards do not split into groups of group_size={group_size}")
    return flat.reshape(-1, group_size)


def _group_std(grouped: torch.Tensor) -> torch.Tensor:
    """``[num_groups, 1]`` unbiased std; zero for groups of one (where it is undefined)."""
    if grouped.shape[1] == 1 or grouped.shape[0] == 0:
        return torch.zeros_like(grouped[:, :1])
    return grouped.std(dim=1, keepdim=True)


def _all_equal(grouped: torch.Tensor) -> torch.Tensor:
    """``[num_groups, 1]`` mask of groups whose rewards are all equal."""
    return (grouped == grouped[:, :1]).all(dim=1, keepdim=True)


GROUP_FILTERS = ("none", "equal_reward")


def keeps_group(rewards: RewardsLike, rule: str) -> bool:
    """Whether a group with these rewards takes part in training under `algo.filter_groups`:
    `none` keeps every group; `equal_reward` (DAPO's dynamic sampling) drops a group whose
    rewards are all equal (compared exactly, as the advantages do): GRPO gives it zero
    advantage everywhere, so it carries no policy gradient and only dilutes the step."""
    if rule == "none":
        return True
    if rule == "equal_reward":
        grouped = _grouped(rewards, len(rewards), torch.float64) if len(rewards) else None
        return grouped is not None and not bool(_all_equal(grouped).item())
    raise ValueError(f"unknown algo.filter_groups {rule!r}; one of {GROUP_FILTERS}")
