"""The RL maths as pure tensor functions: advantages (and, alongside, losses and KL)."""

from vlmrl.algo.advantages import (
    GroupRewardStats,
    compute_advantages,
    dr_grpo_advantages,
    group_reward_stats,
    grpo_advantages,
)

__all__ = [
    "GroupRewardStats",
    "compute_advantages",
    "dr_grpo_advantages",
    "grpo_advantages",
    "group_reward_stats",
]
