"""Who does what at which step: pure functions of the config and the agreed training prompts.

Every process computes the same schedule without talking to the others, and a receiver checks what a peer sends
against it: the step's prompts, each member's deal (the prompts it generates and how many completions each), a
sampler's rounds, the sampling seeds, the most words an honest parcel can hold, and how many peer sequences an
update takes (its intake budget). Nothing here holds state or touches a model, a file or the network.
"""

from __future__ import annotations

import math

import random
from dataclasses import dataclass

from ..config import RunConfig
from .layout import endpoint_roles
from ..core.limits import max_buffer_words

_SEED_MODULUS = 2**31 - 1


def learner_version(step: int) -> int:
    """The policy version a learner's rollouts of `step` carry: its weights after step - 1 (0: the start's)."""
    return step - 1


def staleness(step: int, version: int) -> int:
    """How many steps behind a receiver at `step` (whose own rollouts are learner_version(step)) a rollout of
    policy `version` is: 0 on-policy, negative for one ahead of it."""
    return learner_version(step) - version


def mix_seed(*parts: int) -> int:
    """One seed from several integers (the run seed, a step, a member, a rank), in [0, 2^31 - 1)."""
    value = 0
    for factor, part in zip((1_000_003, 7_919, 104_729, 15_485_863), parts):
        value += factor * part
    return value % _SEED_MODULUS


def prompts_for_step(step: int, indices: list[int], per_step: int, seed: int | str, shuffle: bool) -> list[int]:
    """The step's prompts (step >= 1): the next slice of this epoch's permutation of the training set, identical
    in every process (no communication needed). An epoch is floor(len / per_step) whole slices, so a step never
    holds a prompt twice (the few left over join the next epoch's shuffle)."""
    if len(indices) < per_step:
        raise ValueError(f"rollout.prompts_per_step={per_step} exceeds the {len(indices)} usable training prompts")
    epoch, slot = divmod(step - 1, len(indices) // per_step)
    order = list(indices)
    if shuffle:
        random.Random(f"{seed}-epoch-{epoch}").shuffle(order)
    return order[slot * per_step : (slot + 1) * per_step]


def deal(prompts: list[int], member: int, num_members: int, collaboration: str, group_size: int) -> dict[int, int]:
    """{prompt index: completions to generate} for one member. vertical/alone: prompts dealt round-robin, the
    whole group each; horizontal: every prompt, the member's share of its group."""
    if collaboration == "horizontal":
        share = group_size // num_members + (1 if member < group_size % num_members else 0)
        return {p: share for p in prompts} if share else {}
    return {p: group_size for i, p in enumerate(prompts) if i % num_members == member}


@dataclass(frozen=True)
class Schedule:
    """The run's schedule. train_indices: the training prompts every rank agreed on (those that fit
    data.max_prompt_tokens), in dataset order."""

    config: RunConfig
    train_indices: tuple[int, ...]

    @property
    def roles(self) -> list[tuple[int, int | None]]:
        """(member, sampler index or None) of every endpoint (layout.endpoint_roles): the schedule's ranks."""
        return endpoint_roles(self.config)

    def member_name(self, member: int) -> str:
        return self.config.members[member].name

    @property
    def has_peers(self) -> bool:
        """Whether a member of this run trains on others' rollouts: its config's other members (the open swarm's
        schedule: whoever is live in the swarm), unless collaboration is alone."""
        return self.config.collaboration != "alone" and len(self.config.members) > 1

    def sender_label(self, rank: int) -> str:
        """How records and warnings name a sender: its member's name, a sampler's with /sampler-k."""
        member, sampler = self.roles[rank]
        name = self.member_name(member)
        return name if sampler is None else f"{name}/sampler-{sampler}"

    def sampler_versions(self, member: int, receiver: int, step: int) -> tuple[int | None, int]:
        """What a receiver at `step` accepts as the policy version of a sampler of `member`: (the member's
        weight_sync_every, of which a version is a multiple unless it is the resumed step; None: not known here)
        and the newest version (its own member's: the receiver's last step; another's: the run's last)."""
        newest = learner_version(self.config.train.steps) if member != receiver else learner_version(step)
        return self.config.members[member].weight_sync_every, newest

    def wire_member(self, member: int) -> int:
        """The member index a member's rollouts carry on the wire: its index in the run's config (an open swarm's
        peer carries its own config's, 0)."""
        return member

    @property
    def num_members(self) -> int:
        return len(self.config.members)

    def deal(self, step: int) -> dict[int, dict[int, int]]:
        """Every member's deal of a step: member -> {prompt index: completions}."""
        config = self.config
        prompts = prompts_for_step(step, list(self.train_indices), config.rollout.prompts_per_step, config.seed,
                                   config.data.shuffle)
        return {m: deal(prompts, m, self.num_members, config.collaboration, config.rollout.group_size)
                for m in range(self.num_members)}

    def dealt_sizes(self, member: int) -> tuple[int, int]:
        """(prompts, completions) a member is dealt every step: deals differ between steps in which prompts,
        never in how many."""
        config = self.config
        dealt = deal(list(range(config.rollout.prompts_per_step)), member, self.num_members, config.collaboration,
                     config.rollout.group_size)
        return len(dealt), sum(dealt.values())

    def prompts_per_round(self, member: int) -> int:
        """A sampler's round holds as many prompts as its member is dealt in a step (whole groups each)."""
        return self.dealt_sizes(member)[0]

    def round_deal(self, rank: int, round_: int) -> dict[int, int]:
        """The deal of a sampler rank's round: prompts_per_round prompts, whole groups, from the sampler's own
        shuffle of the training prompts (its stream differs from every learner's and every other sampler's)."""
        member = self.roles[rank][0]
        seed = mix_seed(self.config.seed, 0, 0, rank + 1)
        prompts = prompts_for_step(round_, list(self.train_indices), self.prompts_per_round(member), seed, True)
        return {p: self.config.rollout.group_size for p in prompts}

    def sampling_seed(self, step: int, who: int, shard: int = 0) -> int:
        """A learner's (who = its member; a sharded member's further ranks by shard) or a sampler's (who = its
        rank, step = its round) sampling seed."""
        return mix_seed(self.config.seed, step, who, shard)

    def step_sequences(self, rank: int) -> int:
        """The sequences one step of a learner rank (or one round of a sampler rank) sends."""
        member, sampler = self.roles[rank]
        if sampler is not None:
            return self.prompts_per_round(member) * self.config.rollout.group_size
        return self.dealt_sizes(member)[1]

    def parcel_limit(self, sender: int, step: int) -> int:
        """The most words an honest parcel of rank `sender`'s step (a sampler's: round) holds; 0 when it cannot
        exist (an unknown rank, a step outside the run). What a receiver is willing to allocate."""
        roles = self.roles
        if not 0 <= sender < len(roles):
            return 0
        learner = roles[sender][1] is None
        if step < 1 or (learner and step > self.config.train.steps):
            return 0
        return max_buffer_words(self.step_sequences(sender), self.config.rollout.max_new_tokens)

    def observe(self, live: tuple[int, ...]) -> None:
        """Who is live as of a receive (exchange.Peers.live): one world's senders are the config's, so nothing
        changes (openswarm.schedule.OpenSchedule's change with it)."""

    def senders(self, receiver: int) -> list[int]:
        """The ranks whose rollouts member `receiver` takes: every other learner and every sampler (its own
        samplers included: their rollouts are the member's, made with weights a few steps old)."""
        return [rank for rank, (member, sampler) in enumerate(self.roles) if member != receiver or sampler is not None]

    def peer_budget(self, receiver: int) -> int:
        """swarm.max_peer_sequences, or by default what one step of every peer brings: the other members' share
        of a step (what a sync step gives) plus one round of every sampler."""
        configured = self.config.swarm.max_peer_sequences
        if configured is not None:
            return configured
        return sum(self.step_sequences(rank) for rank in self.senders(receiver))


def learning_rate(config, member: int, step: int) -> float:
    """members.N.lr at `step` (1..train.steps) under train.warmup_steps and train.lr_schedule: a linear rise over the
    warm-up (lr / warmup_steps at step 1), then constant, linear down to lr / (steps - warmup) at the last step, or
    a half cosine. A pure function of the step, so a resumed run continues it exactly."""
    train, lr = config.train, config.members[member].lr
    warmup, total = train.warmup_steps, train.steps
    if step <= warmup:
        return lr * step / warmup
    if train.lr_schedule == "constant":
        return lr
    left = max(1, total - warmup)  # steps after the warm-up
    done = min(step - warmup - 1, left - 1)  # 0 at the first of them
    if train.lr_schedule == "linear":
        return lr * (left - done) / left
    return lr * 0.5 * (1.0 + math.cos(math.pi * done / left))
