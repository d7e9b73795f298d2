"""HACPO's capability ratio and capability-weighted baseline (ftis_engine/exchange/capability.py), held against a float64
oracle written from the paper's equations 5-6 and its authors' defaults (zzx-peter/HACRL-code at 81e6c64,
recipe/hacpo/config/hacpo_trainer.yaml: capability window 5, minimum 1e-8, ratio in [0.1, 10]; advantage epsilon
1e-6, uniform groups unweighted, the binary guard), and the engine passing each sender's ratio to the op."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from ftis_engine.exchange.capability import CapabilityTracker, hacpo_advantages


def oracle_capability(steps: list[dict[int, list[float]]], source: int) -> float:
    """P_s: the mean over the last 5 steps that held s's rewards of max(share of rewards > 0, 1e-8); 1 if none."""
    shares = [max(sum(r > 0 for r in step[source]) / len(step[source]), 1e-8) for step in steps if source in step]
    return max(statistics.fmean(shares[-5:]), 1e-8) if shares else 1.0


def oracle_ratio(steps: list[dict[int, list[float]]], source: int, learner: int) -> float:
    return min(max(oracle_capability(steps, source) / oracle_capability(steps, learner), 0.1), 10.0)


def oracle_advantages(rewards, groups, sources, learner, ratio, scale=True) -> list[float]:
    """Equations 5-6 per group: b = mean_i r_i * P_l / P_s(i) (the plain mean when all rewards are equal; the
    learner's own mean when b > 1), A_i = (r_i - b) / (std_j r_j + 1e-6) (unbiased std; 1 + 1e-6 for one)."""
    out = [0.0] * len(rewards)
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        r = [float(rewards[i]) for i in idx]
        if len(set(r)) == 1:
            b = statistics.fmean(r)
        else:
            b = statistics.fmean(r[k] / ratio.get(sources[i], 1.0) for k, i in enumerate(idx))
            if b > 1.0:
                own = [r[k] for k, i in enumerate(idx) if sources[i] == learner]
                b = statistics.fmean(own) if own else statistics.fmean(r)
        d = ((statistics.stdev(r) if len(r) > 1 else 1.0) + 1e-6) if scale else 1.0
        for k, i in enumerate(idx):
            out[i] = (r[k] - b) / d
    return out


def random_steps(seed: int, n_steps: int = 9) -> list[dict[int, list[float]]]:
    """Steps of rewards by sender (0 the learner, 1-2 peers), a peer sometimes absent, rewards binary or graded."""
    rng = random.Random(seed)
    steps = []
    for _ in range(n_steps):
        step = {}
        for source, skill in ((0, 0.4), (1, 0.8), (2, 0.05)):
            if source and rng.random() < 0.25:
                continue  # late, refused or gone this step
            step[source] = [float(rng.random() < skill) * rng.choice([1.0, 0.5, 1.0]) for _ in range(rng.randint(1, 6))]
        steps.append(step)
    return steps


@pytest.mark.parametrize("seed", range(6))
def test_the_tracker_equals_the_window_average_of_positive_shares(seed):
    steps = random_steps(seed)
    tracker = CapabilityTracker(learner=0)
    for k, step in enumerate(steps):
        sources = [s for s, rs in step.items() for _ in rs]
        tracker.update(sources, [r for rs in step.values() for r in rs])
        seen = steps[: k + 1]
        for source in (0, 1, 2, 7):  # 7: never seen
            assert tracker.capability(source) == pytest.approx(oracle_capability(seen, source), rel=1e-15)
            assert tracker.ratio(source) == pytest.approx(oracle_ratio(seen, source, 0), rel=1e-15)


def test_ratios_are_clamped_and_a_never_successful_source_has_a_finite_one():
    tracker = CapabilityTracker(learner=0)
    tracker.update([0, 0, 1, 1, 2, 2], [1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    assert tracker.capability(1) == 1e-8 and tracker.ratio(1) == 0.1  # 1e-8 / 0.5 clamped up
    assert tracker.ratio(2) == 2.0 and tracker.ratio(0) == 1.0 and tracker.ratio(9) == 2.0  # unseen: P = 1
    for _ in range(5):
        tracker.update([0, 2], [0.0, 1.0])
    assert tracker.ratio(2) == 10.0  # 1 / 1e-8 clamped down


@pytest.mark.parametrize("seed", range(8))
def test_the_weighted_advantages_equal_the_float64_oracle(seed):
    g = torch.Generator().manual_seed(seed)
    n = 24
    groups = torch.randint(0, 5, (n,), generator=g)
    sources = torch.randint(0, 3, (n,), generator=g)
    rewards = (torch.rand(n, generator=g) < 0.5).float() * torch.tensor([1.0, 2.0])[torch.randint(0, 2, (n,),
                                                                                                 generator=g)]
    ratio = {0: 1.0, 1: 10 ** (2 * torch.rand(1, generator=g).item() - 1), 2: 10 ** (2 * torch.rand(1, generator=g)
                                                                                     .item() - 1)}
    for scale in (True, False):
        ours = hacpo_advantages(rewards, groups, sources, 0, ratio, scale)
        theirs = oracle_advantages(rewards.tolist(), groups.tolist(), sources.tolist(), 0, ratio, scale)
        assert ours.dtype == torch.float32
        assert torch.allclose(ours.double(), torch.tensor(theirs, dtype=torch.float64), rtol=1e-6, atol=1e-7)


def test_each_rule_of_the_baseline():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 3, 3])
    sources = torch.tensor([0, 0, 1, 1, 0, 1, 0, 1, 1, 1])
    ratio = {1: 0.25}  # the peer is a quarter as able: its rewards weigh 4 in the learner's baseline
    got = hacpo_advantages(rewards, groups, sources, 0, ratio).tolist()
    # group 0: (1 + 0 + 4 + 4) / 4 = 2.25 > 1, the binary guard: the learner's own mean 0.5
    assert got[:4] == pytest.approx([(r - 0.5) / (statistics.stdev([1, 0, 1, 1]) + 1e-6) for r in (1, 0, 1, 1)])
    assert got[4:6] == [0.0, 0.0]  # all equal: the plain mean, no signal created by the weights
    # group 2: (0 + 4) / 2 = 2 > 1, its learner's own mean 0 (its one own reward)
    assert got[6:8] == pytest.approx([(r - 0.0) / (math.sqrt(0.5) + 1e-6) for r in (0, 1)])
    assert got[8:] == [0.0, 0.0]
    ratio = {1: 4.0}  # four times as able: its rewards weigh 1/4
    got = hacpo_advantages(rewards[:4], groups[:4], sources[:4], 0, ratio).tolist()
    b = (1 + 0 + 0.25 + 0.25) / 4
    assert got == pytest.approx([(r - b) / (statistics.stdev([1, 0, 1, 1]) + 1e-6) for r in (1, 0, 1, 1)])


def test_without_ratios_it_is_the_group_advantage_up_to_its_epsilon():
    from ftis_kernels import group_advantages

    g = torch.Generator().manual_seed(3)
    rewards, groups = torch.rand(32, generator=g), torch.randint(0, 6, (32,), generator=g)
    sources = torch.randint(0, 3, (32,), generator=g)
    assert torch.allclose(hacpo_advantages(rewards, groups, sources, 0, {}), group_advantages(rewards, groups),
                          rtol=1e-4, atol=1e-5)


def test_the_trackers_state_round_trips_and_a_damaged_one_is_refused_naming_its_file():
    tracker = CapabilityTracker(learner=0)
    for step in random_steps(4):
        tracker.update([s for s, rs in step.items() for _ in rs], [r for rs in step.values() for r in rs])
    again = CapabilityTracker(learner=0)
    again.load_state(tracker.state(), "capability.json")
    assert {s: list(w) for s, w in again.history.items()} == {s: list(w) for s, w in tracker.history.items()}
    assert all(again.ratio(s) == tracker.ratio(s) for s in (0, 1, 2))
    for bad in ({"history": {"1": [2.0]}}, {"history": {"x": [0.5]}}, {"history": {"1": [0.5] * 6}}, [],
                {"history": {"1": [float("nan")]}}):
        with pytest.raises(ValueError, match="^ckpt/capability.json: "):
            CapabilityTracker(learner=0).load_state(bad, "ckpt/capability.json")


def test_the_engine_passes_each_senders_ratio_to_the_op_and_keeps_the_tracker_in_the_checkpoint(monkeypatch):
    """training_items updates the learner's tracker with the rewards it trains on and gives each item its sender's
    c; pack carries them as the op's capability_ratio; the receiver keeps the tracker as capability.json."""
    from types import SimpleNamespace

    from ftis_engine.model.batch import pack
    from ftis_engine.data.rollouts import Rollout
    from ftis_engine.run.step import training_items

    from .helpers import short_config

    def rollout(member, prompt, reward):
        return Rollout(member=member, prompt_index=prompt, completion_ids=torch.tensor([5, 6], dtype=torch.int32),
                       gen_logprobs=torch.tensor([-1.0, -1.0]), reward=reward, finish_reason="stop", policy_version=0)

    config = short_config("algorithm.method=hacpo", "collaboration=horizontal")
    tracker = CapabilityTracker(learner=0)
    receiver = SimpleNamespace(capability=tracker)
    swarm = SimpleNamespace(config=config, receivers={0: receiver}, prompt=lambda member, index: [1, 2, 3])
    rollouts = [rollout(0, 0, 1.0), rollout(0, 0, 0.0), rollout(1, 0, 1.0), rollout(1, 0, 1.0),
                rollout(0, 1, 0.0), rollout(0, 1, 0.0), rollout(1, 1, 1.0), rollout(1, 1, 0.0)]
    items = training_items(swarm, SimpleNamespace(index=0), rollouts)
    # the learner: 1 of 4 positive (0.25); its peer 3 of 4 (0.75): c = 3 for the peer, 1 for its own
    assert [it.capability for it in items] == [1.0, 1.0, 3.0, 3.0, 1.0, 1.0, 3.0, 3.0]
    theirs = oracle_advantages([r.reward for r in rollouts], [0, 0, 0, 0, 1, 1, 1, 1], [r.member for r in rollouts],
                               0, {0: 1.0, 1: 3.0})
    assert [it.advantage for it in items] == pytest.approx(theirs, rel=1e-6)
    assert pack(items).capability_ratio.tolist() == [1.0, 1.0, 3.0, 3.0, 1.0, 1.0, 3.0, 3.0]
    vertical = SimpleNamespace(config=short_config("algorithm.method=hacpo"), receivers={0: receiver},
                               prompt=swarm.prompt)
    items = training_items(vertical, SimpleNamespace(index=0), rollouts[:4])
    assert [it.capability for it in items][2:] == [pytest.approx(tracker.ratio(1))] * 2  # the cross term's c


def test_a_hacpo_receiver_keeps_its_tracker_as_a_checkpoint_state():
    from ftis_engine.exchange.admission import Admission

    from .helpers import short_config

    for method, kept in (("hacpo", True), ("f-tis", False)):
        config = short_config(f"algorithm.method={method}")
        receiver = Admission(config, None, None, 0)
        states = receiver.kept_states()
        assert ("capability.json" in states) == kept
        if kept:
            assert states["capability.json"].target is receiver.capability
