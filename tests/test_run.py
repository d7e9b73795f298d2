"""The training loop's pieces: which prompts a step uses, who generates what, and how groups form."""

from __future__ import annotations

import pytest
import torch

from ftis_engine.rollouts import Rollout
from ftis_engine.run import deal, prompts_for_step, training_items
from ftis_engine.session import open_run

from .helpers import short_config


def test_vertical_deals_whole_groups_round_robin_and_horizontal_splits_each_group():
    prompts = [11, 12, 13, 14, 15]
    vertical = [deal(prompts, m, 2, "vertical", 12) for m in range(2)]
    assert vertical[0] == {11: 12, 13: 12, 15: 12} and vertical[1] == {12: 12, 14: 12}
    horizontal = [deal(prompts, m, 3, "horizontal", 8) for m in range(3)]
    assert [h[11] for h in horizontal] == [3, 3, 2]  # 8 completions of each prompt split 3 + 3 + 2
    assert all(list(h) == prompts for h in horizontal)
    assert deal(prompts, 0, 2, "alone", 12) == vertical[0]  # alone: what vertical deals, never shared
    assert deal(prompts, 2, 3, "horizontal", 2) == {}  # a group smaller than the swarm: the third member idles


def test_prompts_never_repeat_within_a_step_and_an_epoch_covers_distinct_prompts():
    indices = list(range(100, 150))  # 50 usable prompts, 24 a step: 2 steps an epoch
    seen_in_epoch = set()
    for step in range(1, 41):
        prompts = prompts_for_step(step, indices, 24, seed=0, shuffle=True)
        assert len(prompts) == 24 and len(set(prompts)) == 24 and set(prompts) <= set(indices)
        if step % 2 == 1:
            seen_in_epoch = set()
        assert not seen_in_epoch & set(prompts)
        seen_in_epoch |= set(prompts)
    assert prompts_for_step(3, indices, 24, 0, True) == prompts_for_step(3, indices, 24, 0, True)
    with pytest.raises(ValueError, match="prompts_per_step"):
        prompts_for_step(1, indices[:10], 24, 0, True)


def test_horizontal_groups_span_members_and_vertical_groups_do_not(tmp_path):
    swarm, _ = open_run(short_config("collaboration=horizontal"), tmp_path / "run")
    member = swarm.members[0]

    def rollout(who, prompt, reward):
        return Rollout(who, prompt, torch.tensor([5], dtype=torch.int32), torch.tensor([-1.0]), reward, "stop", 0)

    # prompt 3: member 0 scored 1, 0 and member 1 scored 1, 1 -> one group of four
    mixed = [rollout(0, 3, 1.0), rollout(0, 3, 0.0), rollout(1, 3, 1.0), rollout(1, 3, 1.0)]
    adv = [it.advantage for it in training_items(swarm, member, mixed)]
    r = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    expected = ((r - r.mean()) / (r.std() + 1e-8)).tolist()
    assert adv == pytest.approx(expected, abs=1e-6)
    # vertical: each prompt's group comes from one member and is normalised on its own
    vertical = [rollout(0, 3, 1.0), rollout(0, 3, 0.0), rollout(1, 4, 1.0), rollout(1, 4, 1.0)]
    adv = [it.advantage for it in training_items(swarm, member, vertical)]
    assert adv[:2] == pytest.approx([0.7071, -0.7071], abs=1e-4) and adv[2:] == [0.0, 0.0]
    swarm.close()
