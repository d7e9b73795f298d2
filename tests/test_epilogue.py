"""The O(S) formula that the loss does not cover: the group advantage (ftis_kernels.advantages)."""

from __future__ import annotations

import torch
from ftis_kernels import group_advantages


def test_group_advantages_match_the_formula_per_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.0, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2])
    adv = group_advantages(rewards, groups)
    for key in (0, 1):
        r = rewards[groups == key].double()
        expected = (r - r.mean()) / (r.std() + 1e-8)
        torch.testing.assert_close(adv[groups == key].double(), expected, rtol=1e-6, atol=1e-6)
    assert adv[groups == 2].item() == 0.0  # a group of one has no spread
    unscaled = group_advantages(rewards, groups, scale=False)
    torch.testing.assert_close(unscaled[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))
