"""The schedule (schedule.py): which prompts a step uses, who generates what, sampler rounds, seeds, the most words
an honest parcel holds, and an update's intake budget; all pure functions of the config."""

from __future__ import annotations

import pytest

from ftis_engine.config import load_config
from ftis_engine.data.rollouts import max_buffer_words
from ftis_engine.topology.schedule import Schedule, deal, mix_seed, prompts_for_step

from .helpers import SHORT, TINY, short_config


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


def test_the_schedule_deals_every_member_and_every_sampler_round_alike_in_every_process():
    config = short_config("swarm.mode=async", "members.0.samplers=2", "rollout.prompts_per_step=5")
    schedule = Schedule(config, tuple(range(40)))
    assert Schedule(config, tuple(range(40))).deal(3) == schedule.deal(3)  # no state: every process agrees
    dealt = schedule.deal(3)
    assert sorted(len(d) for d in dealt.values()) == [2, 3] and not set(dealt[0]) & set(dealt[1])
    assert schedule.roles == [(0, None), (1, None), (0, 0), (0, 1)]
    rounds = [schedule.round_deal(rank, 1) for rank in (2, 3)]
    assert [len(r) for r in rounds] == [3, 3] and rounds[0] != rounds[1]  # each sampler a stream of its own
    assert all(n == config.rollout.group_size for r in rounds for n in r.values())
    assert schedule.sampling_seed(3, 1) == mix_seed(config.seed, 3, 1, 0) != schedule.sampling_seed(3, 0)


def test_an_honest_parcel_size_is_bounded_by_its_senders_deal_and_nothing_outside_the_run_is():
    config = short_config("swarm.mode=async", "members.0.samplers=1")
    schedule = Schedule(config, tuple(range(40)))
    per_member = 2 * config.rollout.group_size  # 4 prompts over 2 members, whole groups
    assert schedule.parcel_limit(1, 3) == max_buffer_words(per_member, config.rollout.max_new_tokens)
    assert schedule.parcel_limit(2, 10_000) == schedule.parcel_limit(0, 1) > 0  # a sampler's rounds never end
    assert schedule.parcel_limit(0, 0) == schedule.parcel_limit(0, config.train.steps + 1) == 0
    assert schedule.parcel_limit(3, 1) == schedule.parcel_limit(-1, 1) == 0  # no such rank


def test_the_default_budget_is_one_step_of_every_peer_and_samplers_add_their_round(tmp_path):
    three = tmp_path / "three.yaml"
    three.write_text(TINY.read_text().replace(
        "algorithm:", "  - name: tiny-l\n    model: builtin:tiny-l\n    lr: 1.0e-3\nalgorithm:"))
    schedule = Schedule(load_config(three, [*SHORT, "rollout.prompts_per_step=5"]), tuple(range(40)))
    sizes = {m: sum(d.values()) for m, d in schedule.deal(1).items()}  # 2 + 2 + 1 prompts of 4
    assert sizes == {0: 8, 1: 8, 2: 4}
    assert [schedule.peer_budget(m) for m in range(3)] == [12, 12, 16]  # what a sync step gives each
    with_sampler = Schedule(short_config("swarm.mode=async", "members.1.samplers=1"), tuple(range(40)))
    assert with_sampler.senders(0) == [1, 2] and with_sampler.senders(1) == [0, 2]  # its own sampler included
    assert with_sampler.peer_budget(0) == with_sampler.peer_budget(1) == 16
    fixed = Schedule(short_config("swarm.mode=async", "swarm.max_peer_sequences=4"), tuple(range(40)))
    assert fixed.peer_budget(0) == 4
