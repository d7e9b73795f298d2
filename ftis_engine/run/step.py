"""One step of the members this process holds, verb by verb (the paper's algorithm box), in both modes:

    deal        the step's prompts to the members (vertical: round-robin, each generates a prompt's whole group;
                horizontal: each its share of every prompt's group), schedule.py
    generate    each member's completions of its dealt prompts, scored, generation/sample.py
    send        its rollouts (token ids + generation log-probs) to its peers, exchange/
    receive     the peers' parcels: sync, this step's (everybody waits for everybody); async, what has arrived
                and is due, waiting only for a peer beyond the lead bound (exchange/pacer.py)
    admit       validated, re-scored, not stale, at most the intake budget, exchange/admission.py
    advantages  A_i = (r_i - mean r) / (std r + 1e-8) over each prompt's group (hacpo: capability-weighted,
                capability.py)
    update      one F-TIS step on its own rollouts (on-policy) and its peers' (off-policy), update.py
    sync        the new weights to its generator (and every weight_sync_every steps to its samplers)
"""

from __future__ import annotations

import collections
import logging
import math
import time

import torch
from ftis_kernels import group_advantages

from ..data.rewards import WeightedValue
from ..data.rollouts import Rollout, buffer_digest, encode
from ..exchange.adversary import wire_copy
from ..exchange.capability import hacpo_advantages
from ..member.members import Member
from ..model import precision
from ..model.batch import TrainItem, pack
from ..model.checkpoint import diverging
from ..model.update import batch_loss, update_member
from ..report.metrics import GpuMemory, Stopwatch, resident_mib, return_freed_memory, train_record
from ..topology.layout import sampler_endpoints
from ..topology.schedule import learner_version, learning_rate
from . import sampling as sample
from .samplers import flatten_weights
from .session import Swarm

log = logging.getLogger("ftis_engine")


def run_step(swarm: Swarm, step: int) -> list[dict]:
    """One step of every member this process holds; returns their `kind: train` records."""
    dealt = swarm.schedule.deal(step)
    memory = {m.index: GpuMemory(m.device) for m in swarm.members}
    own, watches = generate_all(swarm, step, dealt, memory)
    wire, forged = {}, {}
    for member in swarm.members:  # an adversary member (studies, tests) lies in what it sends, never to itself
        wire[member.index], forged[member.index] = wire_copy(swarm, member, own[member.index], step)
    buffers = {m: encode(rollouts) for m, rollouts in wire.items()}
    sent = swarm.exchange.send(buffers, step)
    records = []
    for member in swarm.members:
        index, watch = member.index, watches[member.index]
        arrivals = swarm.exchange.receive(index, step)
        with diverging(swarm.run_dir, member, step):  # the screen's forward
            got = swarm.receivers[index].receive(arrivals.parcels, step, arrivals.dropped_sequences,
                                                 own_sequences=len(own[index]),  # every shard's: gathered
                                                 own_lengths=[r.num_tokens for r in own[index]],
                                                 peers=arrivals.peers)
        watch.seconds["screen_seconds"] += got.screen_seconds
        peers, screened = got.rollouts, got.screened
        scored, unscored = drop_unscored(own[index])
        trained, incomplete = whole_groups(scored + peers, swarm.config.collaboration,
                                           swarm.config.rollout.group_size)
        items = training_items(swarm, member, trained)
        with diverging(swarm.run_dir, member, step):
            samples = completion_records(swarm, member, items, step) if swarm.config.logging.completions else []
        with watch("train_seconds"), diverging(swarm.run_dir, member, step):
            stats = update(swarm, member, items, step)
            return_freed_memory()  # the update's activations, before the next phase allocates elsewhere
        updated_at = time.time()  # version `step` exists from here on; ended_at comes after its sync and push
        memory[index].note()
        with watch("sync_seconds"):  # an engine loads the weights at its next wake-up: counted there (generate_all)
            member.generator.sync(member.model)
            push_to_samplers(swarm, member, step)
        if not swarm.role.reports:  # a further shard: its leader reports the member
            continue
        watch.seconds["exchange_wait_seconds"] += arrivals.wait_seconds
        watch.seconds["lead_wait_seconds"] += arrivals.lead_wait_seconds
        watch.seconds["exchange_seconds"] += arrivals.seconds
        record = train_record(step, member.name, own[index], trained, stats, watch,
                              precision.get_lr(member.optimizer), sent[index], buffer_digest(buffers[index]))
        record.update(reward_terms(swarm, member, own[index]))
        record.update(got.metrics(), **screened.metrics(), screen_seconds=watch.seconds["screen_seconds"],
                      unscored_dropped=unscored, partial_group_dropped=incomplete, in_flight=arrivals.waiting,
                      outbox_dropped=arrivals.outbox_dropped, link_refused=arrivals.link_refused,
                      link_reconnects=arrivals.link_reconnects, forged_sent=forged[index],
                      lead_steps=arrivals.lead_steps, rss_mib=resident_mib(), updated_at=updated_at,
                      **memory[index].record())
        record["foreign_refused"] += arrivals.foreign_refused  # the open swarm refuses them before admission
        records.append(record)
        records += samples
    return records


def generate_all(swarm: Swarm, step: int, dealt: dict[int, dict[int, int]], memory: dict[int, GpuMemory]
                 ) -> tuple[dict[int, list[Rollout]], dict[int, Stopwatch]]:
    """Every local member generates and scores its dealt completions (policy version step - 1); returns them and
    each member's stopwatch. The time an engine spends loading new weights as it wakes counts as sync_seconds,
    not gen_seconds."""
    watches = {m.index: Stopwatch() for m in swarm.members}
    own = {}
    for member in swarm.members:
        shard = member.shard
        mine = dealt[member.index]
        if shard.sharded:  # each shard its share of the prompts, with a seed of its own
            prompts = sorted(mine)
            mine = {prompts[k]: mine[prompts[k]] for k in shard.share(len(prompts))}
        seed = swarm.schedule.sampling_seed(step, member.index, shard.index)
        watch, pushed = watches[member.index], member.generator.push_seconds
        with watch("gen_seconds"), member.generator.awake(), diverging(swarm.run_dir, member, step):
            own[member.index] = sample.generate_rollouts(swarm, member, mine, learner_version(step), seed)
            memory[member.index].note()  # the engine is awake: its weights and KV cache are on the GPU
            return_freed_memory()  # generation's KV cache
        pushed = member.generator.push_seconds - pushed
        watch.seconds["gen_seconds"] -= pushed
        watch.seconds["sync_seconds"] += pushed
        own[member.index] = [r for part in shard.all_gather(own[member.index]) for r in part]  # in shard order
    return own, watches


def reward_terms(swarm: Swarm, member: Member, rollouts: list[Rollout]) -> dict[str, float]:
    """data.rewards: each term's mean over the member's own scored rollouts, as reward/<function>, from the values
    their one scoring pass recorded (Task.score: bounded, errors named; a WeightedValue reward carries them)."""
    terms = getattr(swarm.task.reward, "terms", None)
    recorded = [r.reward.terms for r in rollouts if isinstance(r.reward, WeightedValue)]  # an unscored one: NaN
    if not terms or not recorded:
        return {}
    names = dict.fromkeys(name for name, _, _ in terms)
    return {f"reward/{name}": sum(values[name] for values in recorded) / len(recorded) for name in names}


@torch.no_grad()
def completion_records(swarm: Swarm, member: Member, items: list[TrainItem], step: int) -> list[dict]:
    """`kind: completion` records of logging.completions of the items the member is about to train on (its own
    first, then its peers'), with what the update sees of each: reward, advantage, the mean IS weight, KL and the
    filter's verdict (the op's per-sequence values, from one forward before the update)."""
    chosen = sorted(items, key=lambda it: it.rollout.member != member.index)[: swarm.config.logging.completions]
    if not chosen:
        return []
    out = batch_loss(member, pack(chosen, member.shared_prompt), swarm.loss_config, swarm.config.train.backend)
    decode = member.tokenizer.decode
    return [{"step": step, "member": member.name, "kind": "completion",
             "from": swarm.names[it.rollout.member] if 0 <= it.rollout.member < len(swarm.names) else "?",
             "policy_version": it.rollout.policy_version, "prompt": decode(it.prompt_ids),
             "completion": decode(it.rollout.completion_ids.tolist()), "reward": it.rollout.reward,
             "advantage": it.advantage, "is_weight": float(out.sequences["is_weight"][k]),
             "kl": float(out.sequences["kl"][k]), "filtered": bool(out.sequences["filtered"][k])}
            for k, it in enumerate(chosen)]


def drop_unscored(rollouts: list[Rollout]) -> tuple[list[Rollout], int]:
    """A member's own rollouts without the prompt groups that hold an unscored one (NaN reward: its scoring timed
    out): group advantages need every reward of a group, and its receivers leave the group out alike. Returns
    them and how many were left out."""
    unscored = {r.prompt_index for r in rollouts if math.isnan(r.reward)}
    kept = [r for r in rollouts if r.prompt_index not in unscored]
    return kept, len(rollouts) - len(kept)


def whole_groups(rollouts: list[Rollout], collaboration: str, group_size: int) -> tuple[list[Rollout], int]:
    """horizontal: the rollouts of the prompts whose swarm group is whole (all group_size completions here), and how
    many were left out. A share left out anywhere (unscored by its sender, a refused parcel, the screen, a foreign
    text that did not survive re-encoding) would otherwise leave the rest normalised as a smaller group: out of the
    update alike on every member, as a vertical group is. Vertical and alone groups are one sender's, whole or
    absent already."""
    if collaboration != "horizontal":
        return rollouts, 0
    counts = collections.Counter(r.prompt_index for r in rollouts)
    kept = [r for r in rollouts if counts[r.prompt_index] == group_size]
    return kept, len(rollouts) - len(kept)


def training_items(swarm: Swarm, member: Member, rollouts: list[Rollout]) -> list[TrainItem]:
    """Advantages over each prompt's group (vertical: one member's G; horizontal: the swarm's G). hacpo: each
    sender's capability ratio, from the member's tracker updated with these rollouts' rewards, weighs its cross
    term and, in groups that hold several senders' rollouts (horizontal), its rewards in the baseline
    (capability.py)."""
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
    groups = torch.tensor(group_ids(rollouts, swarm.config.collaboration), dtype=torch.long)  # none: still ids
    scale = swarm.config.algorithm.scale_rewards == "group"
    ratios: dict[int, float] = {}  # hacpo: each sender's c; the other methods have none
    if swarm.config.algorithm.method != "hacpo":
        advantages = group_advantages(rewards, groups, scale=scale)
    else:
        tracker = swarm.receivers[member.index].capability
        tracker.update([r.member for r in rollouts], [r.reward for r in rollouts])
        ratios = {source: tracker.ratio(source) for source in {r.member for r in rollouts}}
        weighted = ratios if swarm.config.collaboration == "horizontal" else {}  # vertical: a group is one sender's
        sources = torch.tensor([r.member for r in rollouts], dtype=torch.long)
        advantages = hacpo_advantages(rewards, groups, sources, member.index, weighted, scale)
    return [TrainItem(r, swarm.prompt(member, r.prompt_index), float(a), int(g), capability=ratios.get(r.member, 1.0))
            for r, a, g in zip(rollouts, advantages, groups)]


def group_ids(rollouts: list[Rollout], collaboration: str) -> list[int]:
    """A group id per rollout. horizontal: its prompt (the swarm shares each prompt's group); else one member's
    completions of one prompt at one policy version (in async mode a batch may hold the same prompt twice, from
    different steps). Ids follow the prompt order, so micro-batches split alike in both cases."""
    if collaboration == "horizontal":
        return [r.prompt_index for r in rollouts]
    keys = [(r.prompt_index, r.member, r.policy_version) for r in rollouts]
    index = {key: i for i, key in enumerate(sorted(set(keys)))}
    return [index[key] for key in keys]


def update(swarm: Swarm, member: Member, items: list[TrainItem], step: int) -> dict[str, float]:
    train = swarm.config.train
    passes = train.epochs * train.mini_batches
    bar = swarm.progress.start(f"{member.name}: update", passes * sum(it.rollout.num_tokens for it in items))
    # the schedule's rate for this step (a pure function of it)
    precision.set_lr(member.optimizer, learning_rate(swarm.config, member.index, step))
    stats = update_member(member, items, swarm.loss_config, train.micro_batch_tokens, train.backend,
                          on_micro_batch=lambda k: swarm.progress.advance(bar, k), epochs=train.epochs,
                          parts=train.mini_batches)
    swarm.progress.finish(bar)
    return stats


def push_to_samplers(swarm: Swarm, member: Member, step: int) -> None:
    """Every members.N.weight_sync_every steps, queue the member's new weights (version `step`) to its samplers."""
    settings = swarm.config.members[member.index]
    if settings.samplers and step % settings.weight_sync_every == 0 and step < swarm.config.train.steps:
        # a sharded member: gathered by every shard, kept and pushed by its leader alone; a broadcast takes its
        # dtype and device
        flat = flatten_weights(member.model, *swarm.exchange.weights_format(), keep=member.leads)
        if member.leads:
            swarm.exchange.push_weights(sampler_endpoints(swarm.config, member.index), flat, step)
