"""The step loop. Per step, every member:

    1. is dealt its prompts (vertical: its share of the step's prompts; horizontal: its share of every prompt's
       group) and generates and scores G completions of each,
    2. shares them (token ids + generation log-probs) and receives its peers' (validated and re-scored),
    3. computes group advantages A_i = (r_i - mean r) / (std r + 1e-8) over each prompt's group,
    4. takes one F-TIS step on all of them (its own on-policy, its peers' off-policy), and syncs its generator.
Evaluation (greedy pass@1) at step 0, every eval.every steps and at the end; checkpoints every checkpoint.every.
A Swarm is opened by session.open_run (train, eval, a torchrun rank, an elastic worker alike).

swarm.mode async (the HeteroRL setting) changes step 2 only: a member publishes its rollouts and trains on the
peers' that have arrived, dropping those more than swarm.max_staleness steps (or max_delay_s seconds) old. With
one member per process the ranks then never synchronise after the start: each logs its own records, stages its
own checkpoint (the last member to stage step N completes it) and leaves when done.
"""

from __future__ import annotations

import json
import logging
import pathlib
import random
import time
from dataclasses import dataclass, field

import torch
from ftis_kernels import LossConfig, group_advantages

from .batch import TrainItem
from .checkpoint import clear_staging, finalize_checkpoint, finalize_when_staged, latest_checkpoint, stage_members
from .config import RunConfig, rank_roles
from .evaluate import evaluate_member
from .async_exchange import DistributedAsyncExchange, Parcel
from .exchange import Delivery, Exchange, RolloutChecker, receive
from .generation import SamplingSettings
from .members import Member
from .metrics import MetricsLogger, Stopwatch, eval_record, resume_records, train_record, truncate_metrics
from .progress import LEGEND, Progress, summary_line
from .rollouts import Rollout, RolloutError, buffer_digest, decode, encode, max_buffer_words
from .samplers import flatten_weights, prompts_per_round, round_prompts, sampler_ranks
from .tasks import Task, prompt_ids
from .update import DivergenceError, update_member

log = logging.getLogger("ftis_engine")


@dataclass
class Swarm:
    """Everything one process needs to run its members' steps (built by session.open_run, then read-only)."""

    config: RunConfig
    task: Task
    members: list[Member]  # the members this process holds
    exchange: Exchange
    run_dir: pathlib.Path
    progress: Progress
    train_indices: list[int]  # training prompts that fit data.max_prompt_tokens, identical on every rank
    names: list[str]  # every member's name, by index
    checkers: dict[int, RolloutChecker]  # local member -> its receiver's checks
    loss_config: LossConfig
    start_step: int = 0  # the step the run (re)starts after: 0, or the restored checkpoint's
    prompt_cache: dict[tuple[int, int], list[int]] = field(default_factory=dict)

    @property
    def is_main(self) -> bool:
        return self.exchange.rank == 0

    @property
    def independent(self) -> bool:
        """Ranks that never synchronise after the start (async mode, one member per process)."""
        return isinstance(self.exchange, DistributedAsyncExchange)

    def prompt(self, member: Member, index: int) -> list[int]:
        key = (member.index, index)
        if key not in self.prompt_cache:
            self.prompt_cache[key] = prompt_ids(member.tokenizer, self.task, self.task.train[index].question)
        return self.prompt_cache[key]

    def close(self) -> None:
        for member in self.members:
            member.generator.close()


# ----------------------------------------------------------------------------------------------- who does what


def prompts_for_step(step: int, indices: list[int], per_step: int, seed: int, shuffle: bool) -> list[int]:
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


def deal_step(swarm: Swarm, step: int) -> dict[int, dict[int, int]]:
    """Every member's deal of the step (each process computes all of them: receivers check what peers send)."""
    config = swarm.config
    prompts = prompts_for_step(step, swarm.train_indices, config.rollout.prompts_per_step, config.seed,
                               config.data.shuffle)
    return {m: deal(prompts, m, len(swarm.names), config.collaboration, config.rollout.group_size)
            for m in range(len(swarm.names))}


def buffer_limits(swarm: Swarm, dealt: dict[int, dict[int, int]]) -> dict[int, int]:
    """The most words an honest buffer of each member can hold this step (what a receiver will allocate)."""
    return {m: max_buffer_words(sum(d.values()), swarm.config.rollout.max_new_tokens) for m, d in dealt.items()}


def sampling_seed(seed: int, step: int, member: int) -> int:
    return (seed * 1_000_003 + step * 7_919 + member * 104_729) % (2**31 - 1)


# ----------------------------------------------------------------------------------------------- one step


def run_step(swarm: Swarm, step: int) -> list[dict]:
    """One step of the members this process holds: the paper's algorithm box, verb by verb."""
    if swarm.config.swarm.mode == "async":
        return run_async_step(swarm, step)
    dealt = deal_step(swarm, step)
    own, watches = generate_all(swarm, step, dealt)
    delivery = swarm.exchange.share({m: encode(r) for m, r in own.items()}, buffer_limits(swarm, dealt))
    records = []
    for member in swarm.members:
        got = receive(delivery.inbox[member.index], member.index, own[member.index], swarm.checkers[member.index],
                      dealt, swarm.names)
        items = training_items(swarm, member, got.rollouts)
        with watches[member.index]("train_seconds"):
            stats = update(swarm, member, items, step)
        member.generator.sync(member.model)
        records.append(train_record(step, member.index, swarm.names, own[member.index], got.rollouts,
                                    len(got.rejected), stats, watches[member.index], delivery,
                                    member.optimizer.param_groups[0]["lr"]))
    return records


def generate_all(swarm: Swarm, step: int, dealt: dict[int, dict[int, int]]
                 ) -> tuple[dict[int, list[Rollout]], dict[int, Stopwatch]]:
    """Every local member generates and scores its dealt completions; returns them and each member's stopwatch."""
    watches = {m.index: Stopwatch() for m in swarm.members}
    own = {}
    for member in swarm.members:
        with watches[member.index]("gen_seconds"), member.generator.awake():
            own[member.index] = generate_rollouts(swarm, member, step, dealt[member.index])
    return own, watches


def run_async_step(swarm: Swarm, step: int) -> list[dict]:
    """One step in swarm.mode async: publish as soon as scored, train on the fresh peer rollouts that have arrived
    (nobody waits). With every member in one process and no latency this is exactly the sync step."""
    dealt = deal_step(swarm, step)
    own, watches = generate_all(swarm, step, dealt)
    buffers = {m: encode(r) for m, r in own.items()}
    start = time.perf_counter()
    collaborating = swarm.config.collaboration != "alone"
    sent = swarm.exchange.publish(buffers, step) if collaborating else {m: 0 for m in buffers}
    published = time.perf_counter() - start
    records = []
    for member in swarm.members:
        with watches[member.index]("exchange_wait_seconds"):
            parcels = swarm.exchange.collect(member.index, step) if collaborating else []
        got = receive_parcels(swarm, member.index, step, parcels)
        items = training_items(swarm, member, own[member.index] + got.rollouts)
        with watches[member.index]("train_seconds"):
            stats = update(swarm, member, items, step)
        member.generator.sync(member.model)
        push_to_samplers(swarm, member, step)
        delivery = Delivery({member.index: {member.index: buffers[member.index]}}, sent,
                            watches[member.index].seconds["exchange_wait_seconds"], published)
        record = train_record(step, member.index, swarm.names, own[member.index], own[member.index] + got.rollouts,
                              len(got.rejected), stats, watches[member.index], delivery,
                              member.optimizer.param_groups[0]["lr"])
        record.update(got.metrics(), in_flight=swarm.exchange.in_flight(member.index) if collaborating else 0)
        records.append(record)
    return records


def push_to_samplers(swarm: Swarm, member: Member, step: int) -> None:
    """Every members.N.weight_sync_every steps, queue the member's new weights (version `step`) to its samplers."""
    settings = swarm.config.members[member.index]
    if settings.samplers and step % settings.weight_sync_every == 0 and step < swarm.config.train.steps:
        swarm.exchange.push_weights(sampler_ranks(swarm.config, member.index), flatten_weights(member.model), step)


FUTURE_TOLERANCE_S = 600.0  # clocks of different nodes may differ by this much


@dataclass
class ReceivedParcels:
    """What a receiver made of the parcels it collected: the peer rollouts it trains on, and what it did not."""

    rollouts: list[Rollout] = field(default_factory=list)
    rejected: list[tuple[int, str]] = field(default_factory=list)  # (sender, reason): failed the checks
    stale_dropped: int = 0  # rollouts older than swarm.max_staleness steps or max_delay_s seconds
    staleness: list[int] = field(default_factory=list)  # per peer rollout trained on, in the receiver's steps
    age_seconds: list[float] = field(default_factory=list)  # per peer rollout trained on, made -> collected
    digests: dict[str, str] = field(default_factory=dict)  # "sender@step" -> buffer digest

    def metrics(self) -> dict:
        def spread(name: str, values: list) -> dict:
            if not values:
                return {f"{name}_min": None, f"{name}_mean": None, f"{name}_max": None}
            return {f"{name}_min": min(values), f"{name}_mean": sum(values) / len(values), f"{name}_max": max(values)}

        return {**spread("staleness", self.staleness), **spread("staleness_seconds", self.age_seconds),
                "stale_dropped": self.stale_dropped, "peer_sequences": len(self.rollouts),
                "received_sha256": self.digests}


def receive_parcels(swarm: Swarm, receiver: int, step: int, parcels: list[Parcel]) -> ReceivedParcels:
    """Decode each parcel; drop it whole when too old (counted), else validate and re-score it against the deal
    of the sender's step, as in sync mode. Staleness = the receiver's policy version - the rollouts' version."""
    cfg, names, out = swarm.config.swarm, swarm.names, ReceivedParcels()
    roles = rank_roles(swarm.config)
    now = time.time()
    for parcel in parcels:
        member, sampler = roles[parcel.sender]  # a parcel's sender is a rank of this run (a member in one process)
        who = names[member] if sampler is None else f"{names[member]}/sampler-{sampler}"
        out.digests[f"{who}@{parcel.step}"] = buffer_digest(parcel.buffer)
        try:
            last = swarm.config.train.steps if sampler is None else 2**31 - 1  # a sampler's rounds are unbounded
            if not 1 <= parcel.step <= last:
                raise RolloutError(f"parcel of step {parcel.step}, outside 1..train.steps={swarm.config.train.steps}")
            rollouts = decode(parcel.buffer)
            # a learner's rollouts of step t are version t - 1; a sampler's carry the version of its weights
            version = parcel.step - 1 if sampler is None else (rollouts[0].policy_version if rollouts else 0)
            if any(r.policy_version != version for r in rollouts):
                raise RolloutError(f"a policy version differs from its parcel's step's ({version})")
            if sampler is not None:  # the versions an honest sampler can hold: its start, then its learner's pushes
                every = swarm.config.members[member].weight_sync_every
                newest = swarm.config.train.steps - 1 if member != receiver else step - 1
                if version > newest or (version % every and version != swarm.start_step):
                    raise RolloutError(f"policy version {version}: a sampler holds the resumed step "
                                       f"({swarm.start_step}) or a multiple of weight_sync_every={every} up to {newest}")
            if (parcel.sender, parcel.step) in swarm.checkers[receiver].seen:
                raise RolloutError(f"a second parcel of step {parcel.step} (a replay)")
            swarm.checkers[receiver].seen.add((parcel.sender, parcel.step))
            if any(r.made_at > now + FUTURE_TOLERANCE_S for r in rollouts):
                raise RolloutError(f"made more than {FUTURE_TOLERANCE_S:g} s in the future (a clock that far off "
                                   "would defeat max_delay_s)")
            staleness = (step - 1) - version
            age = max(0.0, now - min((r.made_at for r in rollouts), default=now))
            if staleness > cfg.max_staleness or (cfg.max_delay_s is not None and age > cfg.max_delay_s):
                out.stale_dropped += len(rollouts)
                continue
            dealt = (deal_step(swarm, parcel.step)[member] if sampler is None
                     else round_prompts(swarm, parcel.sender, parcel.step))
            out.rollouts += swarm.checkers[receiver].check(rollouts, member, dealt)
            out.staleness += [staleness] * len(rollouts)
            out.age_seconds += [max(0.0, now - r.made_at) for r in rollouts]
        except RolloutError as exc:
            out.rejected.append((parcel.sender, str(exc)))
            log.warning("%s: dropped the rollouts of peer %s (member %d) of its step %d: %s", names[receiver],
                        who, member, parcel.step, exc)
    return out


def generate_rollouts(swarm: Swarm, member: Member, step: int, dealt: dict[int, int],
                      seed: int | None = None) -> list[Rollout]:
    """The member's completions of its dealt prompts, scored, as Rollouts of policy version step - 1.
    seed: the sampling seed (default: the run's seed for this member and step)."""
    config, task = swarm.config.rollout, swarm.task
    by_n: dict[int, list[int]] = {}
    for prompt, n in dealt.items():
        by_n.setdefault(n, []).append(prompt)
    rollouts: list[Rollout] = []
    bar = swarm.progress.start(f"{member.name}: generate", sum(dealt.values()))
    for n, prompts in by_n.items():
        sampling = SamplingSettings(n=n, max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                                    top_p=config.top_p, top_k=config.top_k,
                                    seed=seed if seed is not None else sampling_seed(swarm.config.seed, step,
                                                                                     member.index))
        groups = member.generator.generate([swarm.prompt(member, p) for p in prompts], sampling,
                                           on_batch=lambda k: swarm.progress.advance(bar, k))
        completions = [(p, c) for p, group in zip(prompts, groups) for c in group]
        rewards = task.score(member.tokenizer, [c.token_ids for _, c in completions],
                             [task.train[p] for p, _ in completions])
        made_at = time.time()
        rollouts += [Rollout(member=member.index, prompt_index=p, completion_ids=c.token_ids, gen_logprobs=c.logprobs,
                             reward=reward, finish_reason=c.finish_reason, policy_version=step - 1, made_at=made_at)
                     for (p, c), reward in zip(completions, rewards)]
    swarm.progress.finish(bar)
    return rollouts


def training_items(swarm: Swarm, member: Member, rollouts: list[Rollout]) -> list[TrainItem]:
    """Advantages over each prompt's group (vertical: one member's G; horizontal: the swarm's G)."""
    rewards = torch.tensor([r.reward for r in rollouts])
    groups = torch.tensor(group_ids(rollouts, swarm.config.collaboration))
    advantages = group_advantages(rewards, groups, scale=swarm.config.algorithm.scale_rewards == "group")
    return [TrainItem(r, swarm.prompt(member, r.prompt_index), float(a), int(g))
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
    bar = swarm.progress.start(f"{member.name}: update", sum(it.rollout.num_tokens for it in items))
    try:
        stats = update_member(member, items, swarm.loss_config, swarm.config.train.micro_batch_tokens,
                              swarm.config.train.backend, on_micro_batch=lambda k: swarm.progress.advance(bar, k))
    except DivergenceError as exc:
        newest = latest_checkpoint(swarm.run_dir)
        kept = (f"the newest complete checkpoint, step-{newest[0]}, is kept" if newest
                else "no checkpoint was written before it")
        raise DivergenceError(f"step {step}: members.{member.index} ({member.name}) diverged: {exc}; {kept} (lower "
                              f"members.{member.index}.lr, then --resume)") from None
    swarm.progress.finish(bar)
    return stats


# ----------------------------------------------------------------------------------------------- eval, checkpoint


def evaluate_all(swarm: Swarm, step: int) -> list[dict]:
    """Greedy pass@1 of every local member on every eval set."""
    cfg = swarm.config.eval
    max_new = cfg.max_new_tokens or swarm.config.rollout.max_new_tokens
    records = []
    for member in swarm.members:
        with member.generator.awake():
            for name, examples in swarm.task.evals.items():
                examples = examples[: cfg.max_samples] if cfg.max_samples else examples
                bar = swarm.progress.start(f"{member.name}: eval {name}", len(examples))
                accuracy = evaluate_member(member, swarm.task, examples, max_new,
                                           on_batch=lambda k: swarm.progress.advance(bar, k))
                swarm.progress.finish(bar)
                records.append(eval_record(step, member.name, name, accuracy, len(examples)))
    return records


def save_checkpoint(swarm: Swarm, step: int) -> None:
    cfg = swarm.config.checkpoint
    state = {"data_position": step * swarm.config.rollout.prompts_per_step, "members": swarm.names}
    stage_members(swarm.run_dir, step, swarm.members, cfg.save_optimizer)
    if swarm.independent:  # no barrier: whoever stages step N last completes it
        finalize_when_staged(swarm.run_dir, step, state, cfg.keep_last)
        return
    swarm.exchange.barrier()  # every rank has staged its members
    if swarm.is_main:
        finalize_checkpoint(swarm.run_dir, step, state, cfg.keep_last)
    swarm.exchange.barrier()


# ----------------------------------------------------------------------------------------------- the run


def train(swarm: Swarm, start_step: int = 0) -> list[dict]:
    """Run the steps after `start_step` (0: a fresh run; else the restored checkpoint's step); returns the final
    eval records. Rank 0 writes config.yaml, metrics.jsonl, TensorBoard events, plots and final_eval.json."""
    config, run_dir = swarm.config, swarm.run_dir
    if swarm.is_main:
        from .config import dump_config

        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(config))
        dropped = truncate_metrics(run_dir / "metrics.jsonl", start_step if start_step else -1)  # step 0 anew
        clear_staging(run_dir)
    swarm.exchange.barrier()
    if swarm.independent:  # the exchange's threads start once every rank has opened the run
        start_exchange(swarm)
    # rank 0 writes what every rank reports (async ranks each write their own); TensorBoard forgets what the
    # truncated log dropped
    writes = swarm.is_main or swarm.independent
    logger = MetricsLogger(run_dir, purge_step=start_step + 1 if start_step else 0, shared=swarm.independent,
                           tensorboard_suffix=f".rank{swarm.exchange.rank}" if swarm.independent else "") \
        if writes else None
    if swarm.is_main and start_step:
        for record in resume_records(start_step, swarm.names, dropped):
            logger.log(record)
    steps = config.train.steps
    final: list[dict] = []
    try:
        with swarm.progress:
            if start_step == 0 and config.eval.at_start:
                final = _log(swarm, logger, 0, evaluate_all(swarm, 0))
            if swarm.is_main and start_step < steps:
                swarm.progress.print(LEGEND)
            started = time.perf_counter()
            for step in range(start_step + 1, steps + 1):
                step_start = time.perf_counter()
                records = run_step(swarm, step)
                last = step == steps
                evaluating = last or (config.eval.every and step % config.eval.every == 0)
                if evaluating:
                    records += evaluate_all(swarm, step)
                done = step - start_step
                timing = (time.perf_counter() - step_start, (time.perf_counter() - started) / done * (steps - step))
                logged = _log(swarm, logger, step, records, timing)
                if evaluating:
                    final = [r for r in logged if r["kind"] == "eval"]
                if last or (config.checkpoint.every and step % config.checkpoint.every == 0):
                    save_checkpoint(swarm, step)
            if start_step >= steps:  # nothing left to train: report the finished run's accuracy
                final = evaluate_all(swarm, steps)
                final = final if swarm.independent else swarm.exchange.gather_records(final)
            if swarm.config.swarm.mode == "async":
                swarm.exchange.finish()  # say DONE to the peers, drain their late buffers
    finally:
        swarm.close()
        if logger is not None:
            logger.close()
    if swarm.independent:
        write_final_shared(run_dir, final)
    elif swarm.is_main:
        from .plots import make_plots

        make_plots(run_dir)
        (run_dir / "final_eval.json").write_text(json.dumps(final, indent=2))
    return final


def start_exchange(swarm: Swarm) -> None:
    """Start an async rank's exchange threads, which refuse parcels larger than parcel_limit."""
    swarm.exchange.start(lambda sender, step: parcel_limit(swarm, sender, step))


def parcel_limit(swarm: Swarm, sender: int, step: int) -> int:
    """The most words an honest parcel of rank `sender`'s `step` (a sampler's: round) holds (0: cannot exist)."""
    roles = rank_roles(swarm.config)
    if not 0 <= sender < len(roles):
        return 0
    member, sampler = roles[sender]
    if sampler is not None:
        sequences = prompts_per_round(swarm, member) * swarm.config.rollout.group_size
        return max_buffer_words(sequences, swarm.config.rollout.max_new_tokens) if step >= 1 else 0
    if not 1 <= step <= swarm.config.train.steps:
        return 0
    return buffer_limits(swarm, deal_step(swarm, step))[sender]


def write_final_shared(run_dir: pathlib.Path, final: list[dict]) -> None:
    """Async ranks finish at different times: each merges its members' final evals into final_eval.json and
    redraws the plots, under a lock (the last to finish leaves the complete picture)."""
    import contextlib
    import fcntl

    from .plots import NothingToPlot, make_plots

    with open(run_dir / ".final.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = run_dir / "final_eval.json"
        mine = {r["member"] for r in final}
        kept = [r for r in (json.loads(path.read_text()) if path.is_file() else []) if r["member"] not in mine]
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(kept + final, indent=2))
        tmp.replace(path)
        with contextlib.suppress(NothingToPlot):  # a rank that logged no record yet has nothing to draw
            make_plots(run_dir)


def _log(swarm: Swarm, logger: MetricsLogger | None, step: int, records: list[dict],
         timing: tuple[float, float] | None = None) -> list[dict]:
    """Gather every rank's records (async ranks: each its own); rank 0 writes them and prints the step's summary
    line (with the step's seconds and the time left, from the mean step so far)."""
    if not swarm.independent:
        records = swarm.exchange.gather_records(records)
    if logger is not None:
        for record in records:
            logger.log(record)
        swarm.progress.print(summary_line(step, swarm.config.train.steps, records, *(timing or ())))
    return records
