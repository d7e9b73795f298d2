"""HACPO's capability ratio and capability-weighted baseline (arXiv 2603.02604, equations 5-6), as its authors
estimate and use them (zzx-peter/HACRL-code at 81e6c64, recipe/hacpo/hacpo_core_algos.py: CapabilityTracker and
compute_hacpo_advantages; hacpo_ray_trainer.py, _update_target, for what each is given), for one learner that sees
its own rollouts and its peers'.

Each member (its receiver, exchange/admission.py) keeps a CapabilityTracker of the sources it trains on, itself
included: a source's capability P_s is the share of its rollouts with a positive reward, one share per step in
which the learner trained on its rollouts, averaged over the last WINDOW such steps (at least MINIMUM; a source
never seen: 1). A peer's capability ratio for learner l is

    c_s = clamp(P_s / P_l, RATIO_MIN, RATIO_MAX)

the weight of its cross term in the loss (the op's capability_ratio), and the weight of its rewards in the baseline
of a group that holds several sources' rollouts (collaboration: horizontal, the authors' setting: every member
samples a share of every prompt's group):

    b = mean_i r_i / c_{s(i)}          (equation 6: omega = P_l / P_s)
    A_i = (r_i - b) / (std_j r_j + EPSILON)     (std over the group, unbiased; scale_rewards: none drops it)

with the authors' two guards: a group whose rewards are all equal has the plain mean as its baseline (no weight
creates a signal there), and a weighted baseline above 1 (a binary reward's bound) is replaced by the mean of the
learner's own rewards in the group (the plain mean when it has none there). Where the authors' code differs:
every agent samples every prompt in their step, so each tracker's window holds one share per agent per step; here a
source the learner trained on nothing of in a step adds no share that step (a peer that was late, left or was
refused keeps its last estimate instead of failing the step).
"""

from __future__ import annotations

import collections
import math

import torch

WINDOW = 5  # steps each source's capability is averaged over (the authors' capability.window_size)
MINIMUM = 1e-8  # the least capability (capability.minimum): a source that never succeeded has a finite ratio
RATIO_MIN, RATIO_MAX = 0.1, 10.0  # capability.ratio_min, ratio_max
EPSILON = 1e-6  # the advantage's denominator (advantage.epsilon)


class CapabilityTracker:
    """One learner's running estimate of each source's capability (see the module). Sources are the member numbers
    its rollouts carry (Rollout.member: the learner's own index, its peers' as its receiver numbers them)."""

    def __init__(self, learner: int):
        self.learner = learner
        self.history: dict[int, collections.deque[float]] = {}

    def update(self, sources: list[int], rewards: list[float]) -> None:
        """One step's rollouts the learner trains on: their senders and (finite) rewards. Each source among them
        adds its share of positive rewards to its window."""
        seen: dict[int, list[float]] = collections.defaultdict(list)
        for source, reward in zip(sources, rewards, strict=True):
            seen[source].append(reward)
        for source, values in seen.items():
            share = sum(1 for r in values if r > 0) / len(values)
            self.history.setdefault(source, collections.deque(maxlen=WINDOW)).append(max(share, MINIMUM))

    def capability(self, source: int) -> float:
        """P_s: the mean of its window (at least MINIMUM); 1 for a source with none."""
        window = self.history.get(source)
        return max(sum(window) / len(window), MINIMUM) if window else 1.0

    def ratio(self, source: int) -> float:
        """c_s = clamp(P_s / P_learner, RATIO_MIN, RATIO_MAX): source's capability relative to the learner's."""
        return min(max(self.capability(source) / self.capability(self.learner), RATIO_MIN), RATIO_MAX)

    def state(self) -> dict:
        """For the member's checkpoint (JSON): each source's window, oldest first."""
        return {"history": {str(source): list(window) for source, window in self.history.items()}}

    def load_state(self, state: dict, where: str) -> None:
        """A checkpoint's state(); ValueError naming `where` when it is not one."""
        history = state.get("history") if isinstance(state, dict) else None
        if not isinstance(history, dict):
            raise ValueError(f"{where}: not a capability state (an object with history)")
        loaded = {}
        for source, window in history.items():
            if not (isinstance(source, str) and source.isdigit() and isinstance(window, list)
                    and len(window) <= WINDOW and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                      and math.isfinite(v) and MINIMUM <= v <= 1 for v in window)):
                raise ValueError(f"{where}: history.{source} is not a window of at most {WINDOW} shares in "
                                 f"[{MINIMUM:g}, 1]")
            loaded[int(source)] = collections.deque((float(v) for v in window), maxlen=WINDOW)
        self.history = loaded


def hacpo_advantages(rewards: torch.Tensor, groups: torch.Tensor, sources: torch.Tensor, learner: int,
                     ratios: dict[int, float], scale: bool = True) -> torch.Tensor:
    """The capability-weighted group advantage (see the module), computed in float64 and returned as float32.
    rewards: [S] finite; groups, sources: [S] integer labels (a rollout's group and its sender); learner: the
    sender number of the learner's own rollouts; ratios: c_s of each sender (1 where absent: an unweighted
    baseline); scale: divide by the group's std + EPSILON (algorithm.scale_rewards: group)."""
    rewards = rewards.double()
    weights = torch.tensor([1.0 / ratios.get(int(s), 1.0) for s in sources], dtype=torch.float64)
    advantages = torch.empty_like(rewards)
    for key in torch.unique(groups):
        members = groups == key
        r = rewards[members]
        if torch.unique(r).numel() == 1:
            baseline = r.mean()
        else:
            baseline = (r * weights[members]).mean()
            if baseline > 1.0:
                own = r[sources[members] == learner]
                baseline = own.mean() if own.numel() else r.mean()
        spread = (r.std() if r.numel() > 1 else r.new_tensor(1.0)) + EPSILON if scale else r.new_tensor(1.0)
        advantages[members] = (r - baseline) / spread
    return advantages.float()
