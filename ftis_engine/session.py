"""Opening a run: the one way for every entry point (`train`, `eval`, a torchrun rank, an elastic worker).

    swarm, start_step = open_run(config, run_dir, resume=...)          # then run.train(swarm, start_step)

checks the run directory (a new run never writes into another's), loads and checks every local member's model and
tokenizer (and every peer's tokenizer: a peer whose tokenizer differs sends text to re-encode), builds the task and the members, agrees
with the other ranks on the training prompts, and restores the newest complete checkpoint (or the one given).
Every problem is a ConfigError whose one-line message names the field or path.
"""

from __future__ import annotations

import fcntl
import logging
import os
import pathlib
import socket
import time
from dataclasses import dataclass, field

import torch
from ftis_kernels import LossConfig, resolve_backend

from . import layers
from .checkpoint import (
    STEP_DIR,
    complete_checkpoints,
    latest_checkpoint,
    member_dir,
    read_state,
    restore_member,
    restore_optimizer_shard,
)
from .config import ConfigError, RunConfig, config_differences, rank_roles, validate_config
from .errors import describe_load_error, first_line
from .exchange import Alone, Exchange
from .exchange.admission import FOREIGN_EXPANSION, Admission, RolloutChecker
from .exchange.async_ import Latency, LocalAsync, queue_capacity
from .exchange.sync import LocalSync
from .members import (
    Member,
    build_member,
    check_context,
    check_generator_placement,
    check_warm_start,
    load_member_tokenizer,
    member_device,
    preflight,
    resolve_device,
    shard_member,
)
from .models import vocabulary_hash
from .placement import check_placement, process_roles
from .progress import Progress
from .schedule import Schedule
from .tasks import Task, load_task, prompt_ids
from .update import check_model

log = logging.getLogger("ftis_engine")


@dataclass(frozen=True)
class Swarm:
    """Everything one process needs to run its members' steps; built by open_run, its fields never reassigned
    (the receivers keep their intake, the prompt cache fills as prompts are met)."""

    config: RunConfig
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

    @property
    def is_main(self) -> bool:
        """Process rank 0 (member 0's leader), which writes the run's shared files."""
        return self.exchange.collectives.rank == 0

    @property
    def reports(self) -> bool:
        """This process reports its members (records, evals): not a further shard of a member (its leader does)."""
        return all(m.leads for m in self.members)

    @property
    def independent(self) -> bool:
        """Ranks that never synchronise after the start (async mode, one member per process)."""
        return self.exchange.independent

    def prompt(self, member: Member, index: int) -> list[int]:
        key = (member.index, index)
        if key not in self.prompt_cache:
            self.prompt_cache[key] = prompt_ids(member.tokenizer, self.task, self.task.train[index].question)
        return self.prompt_cache[key]

    def close(self) -> None:
        close_generators(self.members)


def close_generators(members: list[Member]) -> None:
    for member in members:
        member.generator.close()


class AgreedError(ConfigError):
    """A problem every rank finds alike (they decided it together): rank 0 alone reports it."""


class RunDirError(ConfigError):
    """A run directory or checkpoint that cannot be used as asked."""


def holds_run(run_dir: pathlib.Path) -> bool:
    """A run is kept there: it wrote a complete checkpoint, or it finished (final_eval.json). A run that stopped
    before its first checkpoint left nothing to continue from: its directory does not block a rerun (which moves
    its metrics aside, run.train)."""
    return bool(complete_checkpoints(run_dir)) or (run_dir / "final_eval.json").is_file()


def has_logged(run_dir: pathlib.Path) -> bool:
    """Something of a run is there: a checkpoint, its end, or a non-empty metrics log."""
    metrics = run_dir / "metrics.jsonl"
    return holds_run(run_dir) or (metrics.is_file() and metrics.stat().st_size > 0)


def check_fresh_run(run_dir: pathlib.Path, resume: bool) -> None:
    """A new run never writes into a directory that holds one (that needs --resume), and --resume needs something
    of a run there (without a checkpoint it starts over)."""
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists() and not metrics.is_file():
        raise RunDirError(f"run_name: {metrics} is not a file (a run's metrics log is); move it away")
    if holds_run(run_dir) and not resume:
        raise RunDirError(f"run_name: {run_dir} already holds a run; pass --resume to continue it or choose "
                          "another run_name/--output-dir")
    if resume and not has_logged(run_dir):
        raise RunDirError(f"--resume: {run_dir} holds no run to continue (no metrics and no checkpoint); drop "
                          "--resume to start it")


# the fields a resumed run may change: how long it runs, how often it evaluates and checkpoints, where and how
# fast the processes run; everything else would make the resumed run a different run than the one it continues
RESUMABLE = ("train.steps", "train.threads", "eval.", "checkpoint.every", "checkpoint.keep_last", "output_dir",
             "swarm.timeout_s", "swarm.max_restarts", "data.reward_timeout_s",
             "logging.report_to", "logging.project")
# and, to go on after a divergence, a member's step size: its learning rate, gradient clip and weight decay (the
# restored optimizer takes them from the config, not from its saved state)
RESUMABLE_MEMBER = ("lr", "grad_clip", "weight_decay")


def resumable(field: str) -> bool:
    parts = field.split(".")
    return field.startswith(RESUMABLE) or (len(parts) == 3 and parts[0] == "members" and parts[2] in RESUMABLE_MEMBER)
# the member fields that make the model eval loads (with the run's seed: a built-in model is rebuilt from it)
MEMBER_MODEL_KEYS = ("name", "model", "tokenizer", "lora", "seed", "dtype", "warm_start")


def _saved_config(run_dir: pathlib.Path, what: str) -> RunConfig | None:
    from .config import load_config

    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    try:
        return load_config(path)
    except ConfigError as exc:
        raise RunDirError(f"{what}: the run's {path} is not a valid config ({exc})") from None


def _describe(changes: list[tuple[str, object, object]]) -> str:
    shown = ", ".join(f"{k} ({a!r} -> {b!r})" for k, a, b in changes[:3])
    return shown + (f" and {len(changes) - 3} more" if len(changes) > 3 else "")


def _checkpoint_config(run_dir: pathlib.Path) -> RunConfig | None:
    """The config the newest complete checkpoint recorded in its state.json (None when it holds none)."""
    found = latest_checkpoint(run_dir)
    if found is None:
        return None
    try:
        recorded = read_state(found[1]).get("config")
        return validate_config(recorded) if isinstance(recorded, dict) else None
    except (OSError, ValueError):
        return None


def check_run_dir(run_dir: pathlib.Path, config: RunConfig, resume: bool) -> None:
    """Before any model is loaded: a fresh run needs an unused directory; --resume needs a run there, continued
    with a config that changes only what RESUMABLE allows."""
    check_fresh_run(run_dir, resume)
    if resume:
        check_resume_config(run_dir, config)


def check_resume_config(run_dir: pathlib.Path, config: RunConfig) -> None:
    """--resume continues the run in run_dir: its config.yaml (or, when that is gone, the config its newest
    checkpoint recorded) may change only in RESUMABLE fields; with neither, the resume is refused."""
    if latest_checkpoint(run_dir) is None:
        return  # nothing to continue from: the run starts over with this config (run.train)
    saved = _saved_config(run_dir, "--resume") or _checkpoint_config(run_dir)
    if saved is None:
        raise RunDirError(f"--resume: {run_dir} has no config.yaml and its newest checkpoint records no config, so "
                          "nothing tells whether this config continues that run; restore its config.yaml")
    changes = [c for c in config_differences(saved, config) if not resumable(c[0])]
    if changes:
        allowed = ", ".join([f"{key}*" if key.endswith(".") else key for key in RESUMABLE]
                            + [f"members.N.{key}" for key in RESUMABLE_MEMBER])
        raise RunDirError(f"--resume: the config differs from the run's config.yaml in {_describe(changes)}; a resumed "
                          f"run may change only {allowed} (start a new run_name for anything else)")


def eval_config(run_dir: pathlib.Path, config: RunConfig | None, overrides: list[str] | tuple[str, ...] = ()
                ) -> RunConfig:
    """The config eval builds the members from: the run's own config.yaml (beside its checkpoints, with
    `overrides`), or the given one. Either must build the models the run trained (seed, members' model,
    tokenizer, LoRA, init seed, dtype)."""
    from .config import load_config

    saved = _saved_config(run_dir, "--checkpoint")
    given = "--config" if config is not None else "--set"  # what the user changed the run's config with
    if config is None:
        if saved is None:
            raise RunDirError(f"--checkpoint: {run_dir} has no config.yaml; pass the run's config with --config")
        if not overrides:
            return saved
        config = load_config(run_dir / "config.yaml", overrides)
    if saved is not None:
        changes = [c for c in config_differences(saved, config) if c[0] == "seed" or (
            c[0].startswith("members.") and c[0].split(".")[2] in MEMBER_MODEL_KEYS)]
        if changes:
            raise RunDirError(f"{given}: builds other models than the run trained ({_describe(changes)}, against "
                              f"{run_dir / 'config.yaml'}); drop {given} to use the run's own")
    return config


class RunLock:
    """Holds a directory for one run (train, or an --nproc launcher for its ranks) or one study: `<dir>/.lock`,
    locked with flock (the OS releases it when the process ends, kill -9 included) and naming its holder. A
    second one into the same directory stops with one line naming the holder. A directory this lock created and
    that was left empty is removed again, so a run that fails before its first step leaves nothing behind."""

    # kind -> (the field a message names, what to choose instead)
    KINDS = {"run": ("run_name", "another run_name/--output-dir"), "study": ("--output-dir", "another --output-dir")}

    def __init__(self, run_dir: pathlib.Path, kind: str = "run"):
        self.run_dir = run_dir
        self.kind = kind
        self._fd: int | None = None
        self._created = False
        self._top: pathlib.Path | None = None

    def __enter__(self) -> "RunLock":
        field, instead = self.KINDS[self.kind]
        self._top = next((d for d in reversed([self.run_dir, *self.run_dir.parents]) if not d.exists()), None)
        self._created = self._top is not None
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.run_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            where = "output_dir" if self.kind == "run" else field
            raise RunDirError(f"{where}: cannot write to {self.run_dir} ({exc.strerror or type(exc).__name__})"
                              ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RunDirError(f"{field}: {self.run_dir} is in use by another {self.kind} ({holder}); wait for it to "
                              f"end or choose {instead}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is None:
            return
        leftover = sorted(p.name for p in self.run_dir.iterdir())
        empty = [[".lock"], [".lock", "metrics.jsonl"]] if self.kind == "run" else [[".lock"]]
        if self._created and leftover in empty and not has_logged(self.run_dir):
            for name in leftover:
                (self.run_dir / name).unlink()
            for directory in [self.run_dir, *self.run_dir.parents]:  # up to the first one this lock created
                if any(directory.iterdir()):
                    break
                directory.rmdir()
                if directory == self._top:
                    break
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


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


def check_backend(config: RunConfig, device: torch.device) -> None:
    """train.backend must run on the member's device (the op's own rule: ftis_kernels.resolve_backend)."""
    try:
        resolve_backend(config.train.backend, device)
    except ValueError as exc:
        raise ConfigError(f"train.{exc} (train.device={config.train.device!r} gives {device.type} here)") from None


def check_before_launch(config: RunConfig, distributed: bool) -> list:
    """Everything that can be checked before any member is built or any process started; returns the tokenizers."""
    from .trackers import check_available as missing_tracker

    problem = missing_tracker(config.logging.report_to)
    if problem:
        raise ConfigError(problem)
    check_placement(config)
    check_backend(config, resolve_device(config.train.device, 0))
    for i in range(len(config.members)):  # Liger's kernels need a GPU: said before any process starts
        layers.resolve(config.train.layers, member_device(config, i, 0))
    check_generator_placement(config, distributed=distributed)
    return preflight(config)


def open_run(config: RunConfig, run_dir: pathlib.Path, *, resume: bool = False, first_start: bool = True,
             checkpoint: pathlib.Path | None = None, exchange: Exchange | None = None,
             local_rank: int | None = None, progress: Progress | None = None, shard=None,
             open_peers=None) -> tuple[Swarm, int]:
    """This process's Swarm and the step to start after (0: a fresh run).

    resume: continue from the newest complete checkpoint every rank has (train --resume, or an elastic restart).
    first_start: False for an elastic restart (which resumes by design, so the fresh-run check is skipped).
    checkpoint: restore exactly this checkpoint, without its optimizer (eval).
    exchange: this process's transport (None: every member lives in this process); the members it holds are
    its rank's (a member's rank, or a sampler's) or all of them.
    shard: this rank's part of a member on several ranks (placement.Shard).
    open_peers: a member in an open swarm (openswarm.member.PeerBook): its schedule deals by member name.
    """
    if exchange is None:
        if config.swarm.mode == "async" and checkpoint is None:
            exchange = LocalAsync(list(range(len(config.members))), Latency(config.swarm.latency, config.seed),
                                  queue_capacity(config))
        else:
            exchange = LocalSync()
    distributed = exchange.collectives.world_size > 1
    if not distributed and checkpoint is None and any(m.samplers for m in config.members):
        first = next(i for i, m in enumerate(config.members) if m.samplers)
        raise ConfigError(f"members.{first}.samplers: sampler ranks run in processes of their own: --nproc "
                          f"{len(process_roles(config))} (one per member rank and sampler) or torchrun")
    if not distributed and checkpoint is None and any(m.ranks > 1 for m in config.members):
        first = next(i for i, m in enumerate(config.members) if m.ranks > 1)
        raise ConfigError(f"members.{first}.ranks: a member on {config.members[first].ranks} ranks runs in "
                          f"processes of its own: --nproc {len(process_roles(config))} (or torchrun)")
    # a rank holds its member: a learner's, or the one a sampler rank generates for
    local = [rank_roles(config)[exchange.rank][0]] if distributed else list(range(len(config.members)))
    if config.train.threads:
        check_threads(config.train.threads)
        torch.set_num_threads(config.train.threads)
    check_generator_placement(config, distributed=distributed)
    devices = {i: member_device(config, i, local_rank) for i in local}
    for i in local:
        check_backend(config, devices[i])
    if checkpoint is None and first_start:
        problem = None
        if exchange.collectives.rank == 0:
            try:
                check_run_dir(run_dir, config, resume)
            except RunDirError as exc:
                problem = str(exc)
        problem = exchange.collectives.all_gather_object(problem)[0]
        if problem:
            raise AgreedError(problem)
    tokenizers = preflight(config, members=local)
    hashes: dict[int, str] = {}
    for part in exchange.collectives.all_gather_object({i: vocabulary_hash(tokenizers[i]) for i in local}):
        hashes.update(part)
    # every member's tokenizer, here too: a peer whose tokenizer differs sends text this rank decodes with it
    everyone = {i: tokenizers[i] if i in local else load_member_tokenizer(config, i) for i in range(len(config.members))}
    foreign = foreign_tokenizers(config, everyone, hashes)

    task = load_task(config.data, config.seed, config.eval.datasets, with_train=checkpoint is None)
    for i in local:
        check_warm_start(i, config.members[i], task)
    members: list[Member] = []
    try:  # a member or checkpoint that fails closes the generators already built (a vLLM engine holds a GPU)
        for i in local:
            sampler = distributed and rank_roles(config)[exchange.rank][1] is not None
            member = build_member(i, config, tokenizers[i], devices[i], task,
                                  trains=checkpoint is None and not sampler)
            members.append(member)
            if checkpoint is None:  # eval (--checkpoint) only generates: the update's checks (and compiles) are moot
                check_model(member)
        # one per vocabulary and chat template (prompt lengths depend on both)
        distinct = list({(hashes[i], getattr(everyone[i], "chat_template", None)): everyone[i]
                         for i in everyone}.values())
        train_indices, longest_prompt = _usable_prompts(config, task, distinct, exchange)
        for member in members:  # a completion after the longest prompt must fit each model's context
            check_context(config, member.index, getattr(member.causal_lm.config, "max_position_embeddings", None),
                          longest_prompt)
        start_step, source, what = 0, None, ""
        if checkpoint is not None:
            source, what = checkpoint, "--checkpoint"
        elif resume:
            found = latest_checkpoint(run_dir)
            agreed = exchange.collectives.all_agree(found[0] if found else 0)
            if agreed:
                source, what = run_dir / "checkpoints" / f"step-{agreed}", "--resume: checkpoint"
            if agreed > config.train.steps:  # it would evaluate step `agreed`'s weights and call them the end
                raise RunDirError(f"train.steps: {config.train.steps} is below step {agreed} of the checkpoint a "
                                  f"resume continues from; a resume can only go on (set train.steps >= {agreed}), or "
                                  "evaluate that checkpoint with ftis-engine eval --checkpoint")
        optimizer = checkpoint is None and config.checkpoint.save_optimizer
        if source is not None:  # a sharded member restores its weights whole, then shards them
            if checkpoint is None and not config.checkpoint.save_optimizer:
                log.warning("--resume: checkpoint.save_optimizer is false, so %s holds no optimizer state: Adam's "
                            "moments restart from zero (the resumed run is not the run that went through)", source)
            start_step = restore(members, config, source, load_optimizer=optimizer and shard is None,
                                 load_rng=checkpoint is None, what=what)
        if shard is not None:
            for member in members:
                shard_member(member, shard, config)
                if source is not None and optimizer:
                    restore_shard(member, source, what)
    except BaseException:
        close_generators(members)
        raise
    if open_peers is None:
        schedule = Schedule(config, tuple(train_indices))
    else:
        from .openswarm.member import OpenSchedule

        schedule = OpenSchedule(config, tuple(train_indices), open_peers)
    receivers = {m.index: Admission(config, schedule, RolloutChecker(
        task, m.tokenizer, m.vocab_size, config.rollout.max_new_tokens, foreign[m.index],
        foreign_limit(config, m, longest_prompt), config.defense.check_claims,
        config.rollout.top_k is None and config.rollout.top_p == 1.0), m.index, start_step)
        for m in members}
    if source is not None and checkpoint is None:
        resume_screens(receivers, members, source, config)
    if exchange.independent and config.swarm.max_lead is not None \
            and config.swarm.max_lead > config.swarm.max_staleness and exchange.collectives.rank == 0:
        log.warning("swarm.max_lead=%d > swarm.max_staleness=%d: a member that far ahead drops its slowest peer's "
                    "newest rollouts as stale", config.swarm.max_lead, config.swarm.max_staleness)
    swarm = Swarm(
        config=config, task=task, members=members,
        exchange=Alone(exchange) if config.collaboration == "alone" else exchange, run_dir=run_dir,
        progress=progress or Progress(enabled=exchange.collectives.rank == 0), schedule=schedule, receivers=receivers,
        loss_config=config.algorithm.loss_config(config.rollout.temperature), start_step=start_step,
    )
    return swarm, start_step


def resume_screens(receivers: dict, members: list[Member], source: pathlib.Path, config: RunConfig) -> None:
    """A resumed member's receiver goes on with the claims monitor's tests its checkpoint holds (screen.json); one
    that holds none (written before the monitor's state was kept) starts them afresh, warned."""
    import json

    for member in members:
        file = member_dir(source, member.name) / "screen.json"
        if file.is_file():
            try:
                receivers[member.index].screen.load_state(json.loads(file.read_text()), str(file))
            except ValueError as exc:  # json's errors are ValueErrors too
                raise RunDirError(f"--resume: {first_line(exc)}") from None
        elif config.defense.claims_monitor:
            log.warning("%s: %s holds no claims-monitor state (written before it was kept); every peer's test "
                        "starts afresh", member.name, source)


def check_threads(threads: int) -> None:
    """train.threads beyond the cores this process may run on only slows it down (20,000 threads once crashed the
    machine): a check of where the run runs, not of its config (a config made on a bigger machine stays valid)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if threads > cores:
        raise ConfigError(f"train.threads: {threads} threads for the {cores} core(s) this process may use; at most "
                          f"{cores} (--set train.threads={cores})")


def foreign_limit(config: RunConfig, member: Member, longest_prompt: int) -> int:
    """The most tokens a foreign peer's completion may re-encode into here: what fits the member's context after
    the longest prompt, and at most FOREIGN_EXPANSION x max_new_tokens (exchange/admission.py)."""
    limit = FOREIGN_EXPANSION * config.rollout.max_new_tokens
    context = getattr(member.causal_lm.config, "max_position_embeddings", None)
    return min(limit, context - longest_prompt) if context else limit


def _prompt_tokens(tokenizers: list, task, question: str) -> int:
    """A prompt's length under the tokenizer that makes it longest: every member must fit it (its context, its
    vLLM max_model_len, data.max_prompt_tokens)."""
    return max(len(prompt_ids(tokenizer, task, question)) for tokenizer in tokenizers)


def _usable_prompts(config: RunConfig, task, tokenizers: list, exchange: Exchange) -> tuple[list[int], int]:
    """Training prompts that fit data.max_prompt_tokens with every member's tokenizer (rank 0's list on every
    rank), and the longest prompt the run uses, in tokens; eval sets are cut alike."""
    limit = config.data.max_prompt_tokens
    lengths = [_prompt_tokens(tokenizers, task, ex.question) for ex in task.train]
    fits = [i for i, n in enumerate(lengths) if n <= limit]
    fits = exchange.collectives.all_gather_object(fits)[0]
    if task.train and len(fits) < config.rollout.prompts_per_step:  # (an eval reads no training set)
        if len(task.train) < config.rollout.prompts_per_step:  # the data set itself is too small
            raise ConfigError(f"rollout.prompts_per_step={config.rollout.prompts_per_step}: the task's training set "
                              f"has only {len(task.train)} prompts")
        raise ConfigError(f"data.max_prompt_tokens={limit}: only {len(fits)} training prompts are that "
                          f"short, fewer than rollout.prompts_per_step={config.rollout.prompts_per_step}")
    longest = max((lengths[i] for i in fits if i < len(lengths)), default=0)
    for name, examples in task.evals.items():  # eval prompts obey the same limit (a vLLM engine is sized by it)
        eval_lengths = [_prompt_tokens(tokenizers, task, ex.question) for ex in examples]
        keep = [i for i, n in enumerate(eval_lengths) if n <= limit]
        kept = [examples[i] for i in exchange.collectives.all_gather_object(keep)[0]]
        if len(kept) < len(examples):
            log.warning("eval %s: %d of %d prompts exceed data.max_prompt_tokens=%d and are left out", name,
                        len(examples) - len(kept), len(examples), limit)
        task.evals[name] = kept
        longest = max([longest] + [eval_lengths[i] for i in keep])
    return fits, longest


def restore(members: list[Member], config: RunConfig, checkpoint: pathlib.Path, load_optimizer: bool,
            what: str, load_rng: bool = True) -> int:
    """Load every local member from `checkpoint`; returns its step. `what` names the argument in errors."""
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
    for member in members:
        try:
            restore_member(member, checkpoint, load_optimizer=load_optimizer, load_rng=load_rng)
        except Exception as exc:  # missing or truncated weights, a missing adapter, a foreign optimizer state
            _replaced(checkpoint, what)
            raise RunDirError(f"{what} {checkpoint}: cannot load member {member.name!r} "
                              f"({describe_load_error(exc)})") from None
        member.generator.sync(member.model)
    return step


def restore_shard(member: Member, checkpoint: pathlib.Path, what: str) -> None:
    """A sharded member's optimizer shard (after shard_member), with restore's errors."""
    try:
        restore_optimizer_shard(member, checkpoint)
    except Exception as exc:
        _replaced(checkpoint, what)
        raise RunDirError(f"{what} {checkpoint}: cannot load member {member.name!r}'s optimizer shard "
                          f"({describe_load_error(exc)})") from None


def _replaced(checkpoint: pathlib.Path, what: str) -> None:
    """A running training keeps checkpoint.keep_last checkpoints: one read while it is pruned is gone midway. Say
    so (and which is newest now) instead of blaming its files."""
    if checkpoint.is_dir():
        return
    newest = latest_checkpoint(checkpoint.parent.parent)
    now = f"the newest complete one now is {newest[1]}" if newest else "there is no complete one now"
    raise RunDirError(f"{what} {checkpoint}: it was removed while being read (a running training keeps only its "
                      f"newest checkpoint.keep_last); {now}: retry with it")
