"""Opening a run: the one way for every entry point (`train`, `eval`, a torchrun rank, an elastic worker, an open
swarm's member), through trainer.build:

    swarm, start_step = open_run(config, Start(run_dir, resume=...), connection)   # wiring.connect_local / connect

checks the run directory (a new run never writes into another's), loads and checks every local member's model and
tokenizer (and every peer's tokenizer: a peer whose tokenizer differs sends text to re-encode), builds the task and the members, agrees
with the other ranks on the training prompts, and restores the newest complete checkpoint (or the one given).
Every problem is a ConfigError whose one-line message names the field or path.
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
from dataclasses import dataclass, field

import torch
from ftis_kernels import LossConfig

from .checkpoint import (
    READ_ERRORS,
    STEP_DIR,
    latest_checkpoint,
    member_dir,
    read_state,
    restore_member,
    restore_optimizer_shard,
)
from .config import ConfigError, RunConfig
from .context import check_context, foreign_limit, usable_prompts
from .errors import describe_load_error, first_line
from .exchange import Exchange, Silent
from .exchange.admission import Admission
from .exchange.pacer import warn_lead_beyond_staleness
from .exchange.screen import LogProbs
from .exchange.verify import RolloutChecker
from .layout import Role, check_processes
from .members import Member, build_member, check_warm_start, load_member_tokenizer, shard_member
from .models import model_context, vocabulary_hash
from .preflight import check_backend, check_generator_placement, check_members, check_model, check_threads, member_device
from .progress import Progress
from .rundir import RunDirError, check_run_dir
from .schedule import Schedule
from .tasks import Task, load_task, prompt_ids
from .trackers import check_available as missing_tracker
from .update import rollout_logprobs
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
    """This process's Swarm and the step to start after (0: a fresh run).

    connection: this process's transport and role (wiring.connect; None: every member in this process,
    wiring.connect_local); the members it holds are its seat's (a member's rank, or a sampler's) or all of them.
    """
    checkpoint, run_dir = start.checkpoint, start.run_dir
    resume = start.resume or start.restarted
    if checkpoint is None:  # a tracker that is not installed: said before anything is written (--nproc: the launcher)
        problem = missing_tracker(config.logging.report_to)
        if problem:
            raise ConfigError(problem)
    if connection is None:
        connection = connect_local(config, evaluating=checkpoint is not None)
    exchange, role, shard = connection.exchange, connection.role, connection.shard
    distributed = role.seat is not None
    if not distributed:  # a world's count was checked as it started (launch.py)
        check_processes(config, None, evaluating=role.evaluating)
    # a rank holds its member: a learner's, or the one a sampler rank generates for
    local = [role.seat.member] if distributed else list(range(len(config.members)))
    if config.train.threads:
        check_threads(config.train.threads)
        torch.set_num_threads(config.train.threads)
    check_generator_placement(config, distributed=distributed)
    devices = {i: member_device(config, i, connection.local_rank) for i in local}
    for i in local:
        check_backend(config, devices[i])
    if checkpoint is None and not start.restarted:
        problem = None
        if role.writes_run:
            try:
                check_run_dir(run_dir, config, resume)
            except RunDirError as exc:
                problem = str(exc)
        problem = exchange.collectives.all_gather_object(problem)[0]
        if problem:
            raise AgreedError(problem)
    tokenizers = check_members(config, members=local)
    hashes: dict[int, str] = {}
    for part in exchange.collectives.all_gather_object({i: vocabulary_hash(tokenizers[i]) for i in local}):
        hashes.update(part)
    # every member's tokenizer, here too: a peer whose tokenizer differs sends text this rank decodes with it
    everyone = {i: tokenizers[i] if i in local else load_member_tokenizer(config, i) for i in range(len(config.members))}
    foreign = foreign_tokenizers(config, everyone, hashes)

    task = load_task(config.data, config.seed, config.eval.datasets, with_train=checkpoint is None,
                     eval_reward=config.eval.reward)
    for i in local:
        check_warm_start(i, config.members[i], task)
    # one per vocabulary and chat template (prompt lengths depend on both)
    distinct = list({(hashes[i], getattr(everyone[i], "chat_template", None)): everyone[i]
                     for i in everyone}.values())
    train_indices, longest_prompt = usable_prompts(config, task, distinct, exchange.collectives)
    source, what = restore_source(config, run_dir, checkpoint, resume, exchange.collectives)
    start_step = checkpoint_step(config, source, what) if source is not None else 0
    if source is not None and checkpoint is None and not config.checkpoint.save_optimizer:
        log.warning("--resume: checkpoint.save_optimizer is false, so %s holds no optimizer state: Adam's "
                    "moments restart from zero (the resumed run is not the run that went through)", source)
    sampler = role.sampler is not None
    members: list[Member] = []
    built = False
    try:
        for i in local:  # each member finished (checked, restored, sharded) before the next is built
            member = build_member(i, config, tokenizers[i], devices[i], task,
                                  trains=checkpoint is None and not sampler, shard=shard)
            members.append(member)
            finish_member(member, config, longest_prompt, source, what, shard, evaluating=checkpoint is not None)
        built = True
    finally:  # a member or checkpoint that fails (or a Ctrl-C) closes the generators built (a vLLM engine holds a GPU)
        if not built:
            close_generators(members)
    if connection.open_peers is None:
        schedule = Schedule(config, tuple(train_indices))
    else:
        from .openswarm.schedule import OpenSchedule

        schedule = OpenSchedule(config, tuple(train_indices), connection.open_peers)
    loss_config = config.algorithm.loss_config(config.rollout.temperature)
    prompt_cache: dict[tuple[int, int], list[int]] = {}
    receivers = {m.index: Admission(config, schedule, RolloutChecker(
        task, m.tokenizer, m.vocab_size, config.rollout.max_new_tokens, foreign[m.index],
        foreign_limit(config, model_context(m.causal_lm.config), longest_prompt), config.defense.check_claims,
        config.rollout.top_k is None and config.rollout.top_p == 1.0), m.index, start_step,
        logprobs=peer_logprobs(m, task, prompt_cache, loss_config, config), shard=m.shard)
        for m in members}
    if source is not None and checkpoint is None:
        resume_screens(receivers, members, source, config)
    if role.independent and role.writes_run:
        warn_lead_beyond_staleness(config)
    swarm = Swarm(
        config=config, role=role, task=task, members=members,
        exchange=Silent.alone(exchange) if config.collaboration == "alone" else exchange, run_dir=run_dir,
        progress=start.progress or Progress(enabled=role.writes_run), schedule=schedule, receivers=receivers,
        loss_config=loss_config, start_step=start_step, prompt_cache=prompt_cache,
    )
    if connection.opened is not None:  # an open swarm's transport: the tokenizer and dataset it announces
        connection.opened(swarm)
    return swarm, start_step


def resume_screens(receivers: dict, members: list[Member], source: pathlib.Path, config: RunConfig) -> None:
    """A resumed member's receiver goes on with the claims monitor's tests (screen.json) and the length guard's own
    lengths (admission.json) its checkpoint holds; one that holds none (written before that state was kept) starts
    afresh, warned."""
    import json

    for member in members:
        for name, kept in receivers[member.index].kept_states().items():
            file = member_dir(source, member.name) / name
            if not file.is_file():
                log.warning("%s: %s holds no %s (written before it was kept); %s", member.name, source,
                            kept.what, kept.afresh)
                continue
            try:
                state = json.loads(file.read_text())
            except (OSError, ValueError) as exc:  # json's errors are ValueErrors too
                raise RunDirError(f"--resume: {file}: {first_line(exc)}") from None
            try:
                kept.target.load_state(state, str(file))
            except ValueError as exc:
                raise RunDirError(f"--resume: {first_line(exc)}") from None


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
        restore_into(member, source, what, load_optimizer=optimizer and shard is None, load_rng=not evaluating)
    if shard is not None:
        shard_member(member, shard, config)
        if source is not None and optimizer:
            restore_shard(member, source, what)


def restore_source(config: RunConfig, run_dir: pathlib.Path, checkpoint: pathlib.Path | None, resume: bool,
                   collectives) -> tuple[pathlib.Path | None, str]:
    """The checkpoint to restore (None: a fresh start) and how errors name it: the given one (eval), or on
    --resume the newest complete checkpoint every rank has (a collective)."""
    if checkpoint is not None:
        return checkpoint, "--checkpoint"
    if not resume:
        return None, ""
    found = latest_checkpoint(run_dir)
    agreed = collectives.all_agree(found[0] if found else 0)
    if agreed > config.train.steps:  # it would evaluate step `agreed`'s weights and call them the end
        raise RunDirError(f"train.steps: {config.train.steps} is below step {agreed} of the checkpoint a "
                          f"resume continues from; a resume can only go on (set train.steps >= {agreed}), or "
                          "evaluate that checkpoint with ftis-engine eval --checkpoint")
    return (run_dir / "checkpoints" / f"step-{agreed}", "--resume: checkpoint") if agreed else (None, "")


def checkpoint_step(config: RunConfig, checkpoint: pathlib.Path, what: str) -> int:
    """The step of `checkpoint` from its state.json, which must name this config's members and its directory's
    step. `what` names the argument in errors."""
    try:
        state = read_state(checkpoint)
        step = int(state["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        _replaced(checkpoint, what)
        raise RunDirError(f"{what} {checkpoint}: unreadable state.json ({type(exc).__name__}: "
                          f"{first_line(exc)})") from None
    named = STEP_DIR.match(checkpoint.name)
    if named and int(named.group(1)) != step or isinstance(state.get("step"), bool) or step < 0:
        raise RunDirError(f"{what} {checkpoint}: its state.json says step {state.get('step')!r}, its directory "
                          f"{checkpoint.name}; a checkpoint's step is its directory's")
    names = [m.name for m in config.members]
    if state.get("members") != names:
        raise RunDirError(f"{what} {checkpoint}: holds members {state.get('members')}, the config has {names}")
    return step


@contextlib.contextmanager
def _restoring(checkpoint: pathlib.Path, what: str, part: str):
    """Around loading `part` ("member 'x'") from `checkpoint`: what its files can raise (checkpoint.READ_ERRORS:
    missing or truncated weights, a missing adapter, a foreign optimizer state) is one RunDirError naming it; any
    other error (this code's own: an AttributeError) propagates as itself."""
    try:
        yield
    except READ_ERRORS as exc:
        _replaced(checkpoint, what)
        raise RunDirError(f"{what} {checkpoint}: cannot load {part} ({describe_load_error(exc)})") from None


def restore_into(member: Member, checkpoint: pathlib.Path, what: str, load_optimizer: bool, load_rng: bool) -> None:
    """Load a member from `checkpoint` (weights; optimizer and RNG state when asked), its generator synced."""
    with _restoring(checkpoint, what, f"member {member.name!r}"):
        restore_member(member, checkpoint, load_optimizer=load_optimizer, load_rng=load_rng)
    member.generator.sync(member.model)


def restore_shard(member: Member, checkpoint: pathlib.Path, what: str) -> None:
    """A sharded member's optimizer shard (after shard_member), with restore's errors."""
    with _restoring(checkpoint, what, f"member {member.name!r}'s optimizer shard"):
        restore_optimizer_shard(member, checkpoint)


def _replaced(checkpoint: pathlib.Path, what: str) -> None:
    """A running training keeps checkpoint.keep_last checkpoints: one read while it is pruned is gone midway. Say
    so (and which is newest now) instead of blaming its files."""
    if checkpoint.is_dir():
        return
    newest = latest_checkpoint(checkpoint.parent.parent)
    now = f"the newest complete one now is {newest[1]}" if newest else "there is no complete one now"
    raise RunDirError(f"{what} {checkpoint}: it was removed while being read (a running training keeps only its "
                      f"newest checkpoint.keep_last); {now}: retry with it")
