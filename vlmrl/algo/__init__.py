"""The RL maths as pure tensor functions: advantages, policy losses, KL, entropy."""

from vlmrl.algo.advantages import (
    GroupRewardStats,
    compute_advantages,
    dr_grpo_advantages,
    group_reward_stats,
    grpo_advantages,
)
from vlmrl.algo.losses import (
    AGG_MODES,
    KL_TYPES,
    POLICY_LOSSES,
    aggregate,
    broadcast_to_tokens,
    entropy_from_logits,
    gspo_loss,
    kl_penalty,
    loss_normaliser,
    policy_loss,
    ppo_clip_loss,
    sft_loss,
    tis_weights,
    token_logprobs_from_logits,
)

__all__ = [
    "AGG_MODES",
    "KL_TYPES",
    "POLICY_LOSSES",
    "GroupRewardStats",
    "aggregate",
    "broadcast_to_tokens",
    "compute_advantages",
    "dr_grpo_advantages",
    "entropy_from_logits",
    "group_reward_stats",
    "grpo_advantages",
    "gspo_loss",
    "kl_penalty",
    "loss_normaliser",
    "policy_loss",
    "ppo_clip_loss",
    "sft_loss",
    "tis_weights",
    "token_logprobs_from_logits",
]
