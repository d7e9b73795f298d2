"""Opening a run: the one way for every entry point (`train`, `eval`, a torchrun rank, an elastic worker, an open
swarm's member), through trainer.build:

    swarm, start_step = open_run(config, Start(run_dir, resume=...), connection)   # wiring.connect_local / connect

checks what this machine allows, agrees with the other ranks on the run directory (a new run never writes into
another's), the tokenizers (a peer whose tokenizer differs sends text to re-encode), the training prompts and the
checkpoint to restore (restore.py reads it), then builds the task, the members, the schedule and the receivers.
Every problem is a ConfigError whose one-line message names the field or path.
"""

from __future__ import annotations

import logging
import pathlib
from dataclasses import dataclass, field

import torch
from ftis_kernels import LossConfig

from ..config import ConfigError, RunConfig
from ..data.context import check_context, foreign_limit, usable_prompts
from ..data.tasks import Task, load_task, prompt_ids
from ..exchange import Exchange, Silent
from ..exchange.admission import Admission
from ..exchange.pacer import warn_lead_beyond_staleness
from ..exchange.screen import LogProbs
from ..exchange.verify import RolloutChecker
from ..member.members import Member, build_member, check_warm_start, load_member_tokenizer, shard_member
from ..model.models import model_context, vocabulary_hash
from ..model.update import rollout_logprobs
from ..openswarm.schedule import OpenSchedule
from ..report.progress import Progress
from ..report.trackers import check_available as missing_tracker
from ..topology.layout import Role, check_processes
from ..topology.schedule import Schedule
from .preflight import (
    check_backend,
    check_generator_placement,
    check_members,
    check_model,
    check_threads,
    member_device,
)
from .restore import agree_checkpoint, restore_into, restore_shard, resume_screens
from .rundir import RunDirError, check_run_dir
from .wiring import Connection, connect_local

log = logging.getLogger("ftis_engine")


@dataclass(frozen=True)
class Swarm:
    """Everything one process needs to run its members' steps; built by open_run, its fields never reassigned
    (the receivers keep their intake, the prompt cache fills as prompts are met)."""

    config: RunConfig
    role: Role  # what this process is in the run (layout.Role): computed once, as it connected
    task: Task
    members: list[Member]  # the members this process holds (a sampler rank: the member it generates for)
    exchange: Exchange
    run_dir: pathlib.Path
    progress: Progress
    schedule: Schedule
    receivers: dict[int, Admission]  # local member -> its receiver
    loss_config: LossConfig
    start_step: int = 0  # the step the run (re)starts after: 0, or the restored checkpoint's
    prompt_cache: dict[tuple[int, int], list[int]] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        """Every member's name, by index."""
        return [m.name for m in self.config.members]

    def prompt(self, member: Member, index: int) -> list[int]:
        return cached_prompt(self.prompt_cache, self.task, member, index)

    def close(self) -> None:
        close_generators(self.members)


def cached_prompt(cache: dict[tuple[int, int], list[int]], task: Task, member: Member, index: int) -> list[int]:
    """Training prompt `index` in the member's tokens, encoded once."""
    key = (member.index, index)
    if key not in cache:
        cache[key] = prompt_ids(member.tokenizer, task, task.train[index].question)
    return cache[key]


def peer_logprobs(member: Member, task: Task, cache: dict, loss_config: LossConfig, config: RunConfig) -> LogProbs:
    """The member's own per-token log-probs of peer rollouts' completions (one no-grad forward, as the update's),
    for its receiver's model-reading defenses (Admission.screen_rollouts)."""
    train = config.train

    def logprobs(rollouts: list) -> list[torch.Tensor]:
        prompts = [cached_prompt(cache, task, member, r.prompt_index) for r in rollouts]
        return rollout_logprobs(member, rollouts, prompts, loss_config, train.micro_batch_tokens, train.backend)

    return logprobs


def close_generators(members: list[Member]) -> None:
    for member in members:
        member.generator.close()


class AgreedError(ConfigError):
    """A problem every rank finds alike (they decided it together): rank 0 alone reports it."""


def foreign_tokenizers(config: RunConfig, tokenizers: dict[int, object], hashes: dict[int, str]
                       ) -> dict[int, dict[int, object]]:
    """For every member, the other members whose tokenizer differs from its own (vocabulary_hash), with their
    tokenizers: their rollouts reach it as text, re-encoded and corrected at sequence level. hashes: what every
    member's own rank loaded; a rank whose copy of a member's tokenizer hashes otherwise stops (another version of
    the tokenizer on another node would re-encode differently)."""
    for i, tokenizer in tokenizers.items():
        if vocabulary_hash(tokenizer) != hashes[i]:
            field_name = "tokenizer" if config.members[i].tokenizer else "model"
            raise ConfigError(f"members.{i}.{field_name}: this rank's copy of its tokenizer differs from the one its "
                              "own rank loaded (another version on another node?)")
    return {m: {i: t for i, t in tokenizers.items() if i != m and hashes[i] != hashes[m]} for m in tokenizers}


@dataclass(frozen=True)
class Start:
    """What the command asked of the run it opens."""

    run_dir: pathlib.Path  # eval: the checkpoint (it writes nothing)
    resume: bool = False  # continue from the newest complete checkpoint every rank has (train --resume)
    restarted: bool = False  # an elastic restart: resumes by design, so the fresh-run check is skipped
    checkpoint: pathlib.Path | None = None  # eval: restore exactly this checkpoint, without its optimizer
    progress: Progress | None = None  # the progress display (None: rank 0's own)


def open_run(config: RunConfig, start: Start, connection: Connection | None = None) -> tuple[Swarm, int]:
    """This process's Swarm and the step to start after (0: a fresh run), in the order below: what this machine
    and the process count allow, then the start's four agreements with the other ranks (the run directory, the
    tokenizers, the training prompts, the checkpoint), then the members (each built, checked, restored and sharded
    in one pass), the schedule and the receivers.

    connection: this process's transport and role (wiring.connect; None: every member in this process,
    wiring.connect_local); the members it holds are its seat's (a member's rank, or a sampler's) or all of them.
    """
    evaluating = start.checkpoint is not None
    if not evaluating:  # a tracker that is not installed: said before anything is written (--nproc: the launcher)
        problem = missing_tracker(config.logging.report_to)
        if problem:
            raise ConfigError(problem)
    if connection is None:
        connection = connect_local(config, evaluating=evaluating)
    role, collectives = connection.role, connection.exchange.collectives
    if role.evaluating != evaluating:  # what the members are built for and what Trainer.run does must agree
        raise ValueError(f"open_run: Start.checkpoint says evaluating={evaluating}, the connection's role says "
                         f"{role.evaluating}")
    if role.seat is None:  # a world's count was checked as it started (launch.py)
        check_processes(config, None, evaluating=role.evaluating)
    # a rank holds its member: a learner's, or the one a sampler rank generates for
    local = [role.seat.member] if role.seat is not None else list(range(len(config.members)))
    devices = prepare_machine(config, local, connection)
    if not evaluating and not start.restarted:
        agree_run_dir(config, start, role, collectives)
    tokenizers, everyone, hashes, foreign = agree_tokenizers(config, local, collectives)
    task = load_task(config.data, config.seed, config.eval.datasets, with_train=not evaluating,
                     eval_reward=config.eval.reward)
    for i in local:
        check_warm_start(i, config.members[i], task)
    # one per vocabulary and chat template (prompt lengths depend on both)
    distinct = list({(hashes[i], getattr(everyone[i], "chat_template", None)): everyone[i]
                     for i in everyone}.values())
    train_indices, longest_prompt = usable_prompts(config, task, distinct, collectives)
    source, what, start_step = agree_checkpoint(config, start.run_dir, start.checkpoint,
                                                start.resume or start.restarted, collectives)
    shard, trains = connection.shard, not evaluating and role.sampler is None
    members: list[Member] = []
    opened = False
    try:  # a member, checkpoint or receiver state that fails (or a Ctrl-C) closes the generators built: a vLLM
        # engine holds a GPU
        for i in local:  # each member finished (checked, restored, sharded) before the next is built
            member = build_member(i, config, tokenizers[i], devices[i], task, trains=trains, sharded=shard.sharded)
            members.append(member)
            finish_member(member, config, longest_prompt, source, what, shard, evaluating=evaluating)
        schedule = make_schedule(config, train_indices, connection.open_peers)
        loss_config = config.algorithm.loss_config(config.rollout.temperature)
        prompt_cache: dict[tuple[int, int], list[int]] = {}
        receivers = {m.index: make_receiver(config, m, task, schedule, foreign[m.index], longest_prompt, start_step,
                                            peer_logprobs(m, task, prompt_cache, loss_config, config))
                     for m in members}
        if source is not None and not evaluating:
            resume_screens(receivers, members, source, config)
        if role.independent and role.writes_run:
            warn_lead_beyond_staleness(config)
        swarm = Swarm(
            config=config, role=role, task=task, members=members,
            exchange=Silent.alone(connection.exchange) if config.collaboration == "alone" else connection.exchange,
            run_dir=start.run_dir, progress=start.progress or Progress(enabled=role.writes_run), schedule=schedule,
            receivers=receivers, loss_config=loss_config, start_step=start_step, prompt_cache=prompt_cache,
        )
        if connection.opened is not None:  # an open swarm's transport: the tokenizer and dataset it announces
            connection.opened(swarm)
        opened = True
    finally:
        if not opened:
            close_generators(members)
    return swarm, start_step


def prepare_machine(config: RunConfig, local: list[int], connection: Connection) -> dict[int, torch.device]:
    """What this machine allows the members this process holds (threads, generator placement, backend), and
    each one's device."""
    if config.train.threads:
        check_threads(config.train.threads)
        torch.set_num_threads(config.train.threads)
    check_generator_placement(config, distributed=connection.role.seat is not None)
    devices = {i: member_device(config, i, connection.local_rank) for i in local}
    for i in local:
        check_backend(config, devices[i])
    return devices


def agree_run_dir(config: RunConfig, start: Start, role: Role, collectives) -> None:
    """A first start never writes into another run: rank 0 checks the run directory and every rank takes its
    finding (a collective), so all stop alike (AgreedError: rank 0 alone says it)."""
    problem = None
    if role.writes_run:
        try:
            check_run_dir(start.run_dir, config, start.resume)
        except RunDirError as exc:
            problem = str(exc)
    problem = collectives.all_gather_object(problem)[0]
    if problem:
        raise AgreedError(problem)


def agree_tokenizers(config: RunConfig, local: list[int], collectives
                     ) -> tuple[dict[int, object], dict[int, object], dict[int, str], dict[int, dict[int, object]]]:
    """The local members' tokenizers (loaded and checked), every member's (a peer whose tokenizer differs sends text
    this rank decodes with it), every member's vocabulary hash as its own rank loaded it (a collective), and for
    each member the peers that tokenise otherwise (foreign_tokenizers: a rank whose copy differs stops here, before
    anything is built)."""
    tokenizers = check_members(config, members=local)
    hashes: dict[int, str] = {}
    for part in collectives.all_gather_object({i: vocabulary_hash(tokenizers[i]) for i in local}):
        hashes.update(part)
    everyone = {i: tokenizers[i] if i in local else load_member_tokenizer(config, i)
                for i in range(len(config.members))}
    return tokenizers, everyone, hashes, foreign_tokenizers(config, everyone, hashes)


def make_schedule(config: RunConfig, train_indices, open_peers) -> Schedule:
    """One world's schedule, or an open swarm member's by name (open_peers: its openswarm.schedule.PeerBook)."""
    if open_peers is None:
        return Schedule(config, tuple(train_indices))
    return OpenSchedule(config, tuple(train_indices), open_peers)


def make_receiver(config: RunConfig, member: Member, task: Task, schedule: Schedule, foreign: dict, longest_prompt: int,
                  start_step: int, logprobs: LogProbs) -> Admission:
    """A local member's receiver: its checks of what peers send (RolloutChecker, with the tokenizers of peers that
    tokenise otherwise), its screen's log-prob function and its shard."""
    checker = RolloutChecker(task, member.tokenizer, member.vocab_size, config.rollout.max_new_tokens, foreign,
                             foreign_limit(config, model_context(member.causal_lm.config), longest_prompt),
                             config.defense.check_claims, config.rollout.top_k is None and config.rollout.top_p == 1.0)
    return Admission(config, schedule, checker, member.index, start_step, logprobs=logprobs, shard=member.shard)


def finish_member(member: Member, config: RunConfig, longest_prompt: int, source: pathlib.Path | None, what: str,
                  shard, evaluating: bool) -> None:
    """A member just built (build_member, for `shard` when it has several ranks), finished in one pass: checked
    against the fused path and its context, restored from `source` (weights; optimizer and RNG unless
    evaluating), then sharded over its ranks (shard: this rank's part, fsdp.Shard), its optimizer built once."""
    if not evaluating:  # eval (--checkpoint) only generates: the update's checks (and compiles) are moot
        check_model(member)
    check_context(config, member.index, model_context(member.causal_lm.config), longest_prompt)
    optimizer = not evaluating and config.checkpoint.save_optimizer
    if source is not None:  # a sharded member restores its weights whole, then shards them
        restore_into(member, source, what, load_optimizer=optimizer and not shard.sharded, load_rng=not evaluating)
    if shard.sharded:
        shard_member(member, shard, config)
        if source is not None and optimizer:
            restore_shard(member, source, what)
