"""GRPO's group advantage: the one formula the trainer applies to rewards before the loss."""

from __future__ import annotations

import torch

from .checks import check_rewards


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, scale: bool = True) -> torch.Tensor:
    """GRPO's group advantage of each completion, computed in float64 and returned as float32:

        A_i = (r_i - mean_{j in G(i)} r_j) / (std_{j in G(i)} r_j + 1e-8)

    over the completions j of i's group G(i) (groups[j] == groups[i]; std unbiased, as torch.std). scale=False
    drops the division (Dr. GRPO's `scale_rewards: none`). A group of one has no spread: its advantage is 0.
    rewards, groups: [S] (any numeric dtype; groups any integer labels), on one device; rewards finite (an unscored
    completion's NaN reward is the caller's to leave out), else ValueError naming the argument, as the loss does."""
    check_rewards(rewards, groups)
    rewards = rewards.double()
    advantages = torch.zeros_like(rewards)
    for key in torch.unique(groups):
        members = groups == key
        r = rewards[members]
        if r.numel() < 2:
            continue
        centred = r - r.mean()
        advantages[members] = centred / (r.std() + 1e-8) if scale else centred
    return advantages.float()
