"""Opening a run: the one way for every entry point (`train`, `eval`, a torchrun rank, an elastic worker).

    swarm, start_step = open_run(config, run_dir, resume=...)          # then run.train(swarm, start_step)

checks the run directory (a new run never writes into another's), loads and checks every local member's model and
tokenizer (members exchange token ids: one vocabulary across the swarm), builds the task and the members, agrees
with the other ranks on the training prompts, and restores the newest complete checkpoint (or the one given).
Every problem is a ConfigError whose one-line message names the field or path.
"""

from __future__ import annotations

import logging
import pathlib

import torch

from .checkpoint import latest_checkpoint, read_state, restore_member
from .config import ConfigError, RunConfig
from .exchange import Alone, Exchange, LocalExchange, RolloutChecker
from .members import build_member, check_generator_placement, preflight, resolve_device
from .models import vocabulary_hash
from .progress import Progress
from .run import Swarm
from .tasks import load_task, prompt_ids
from .update import check_model

log = logging.getLogger("ftis_engine")


class AgreedError(ConfigError):
    """A problem every rank finds alike (they decided it together): rank 0 alone reports it."""


class RunDirError(ConfigError):
    """A run directory or checkpoint that cannot be used as asked."""


def check_fresh_run(run_dir: pathlib.Path, resume: bool) -> None:
    """A new run never writes into a directory that holds one: that needs --resume."""
    if (run_dir / "metrics.jsonl").exists() and not resume:
        raise RunDirError(f"run_name: {run_dir} already holds a run; pass --resume to continue it or choose "
                          "another run_name/--output-dir")


def check_shared_vocabulary(hashes: dict[int, str]) -> None:
    """members.N.model: every member's tokenizer must hash alike (vocabulary_hash); hashes: member -> hash."""
    if len(set(hashes.values())) > 1:
        first = min(hashes)
        other = min(i for i in hashes if hashes[i] != hashes[first])
        raise AgreedError(f"members.{other}.model: its tokenizer vocabulary differs from members.{first}'s; members "
                          "exchange token ids and must share one vocabulary")


def check_before_launch(config: RunConfig, distributed: bool) -> list:
    """Everything that can be checked before any member is built or any process started; returns the tokenizers."""
    check_generator_placement(config, distributed=distributed)
    tokenizers = preflight(config)
    check_shared_vocabulary({i: vocabulary_hash(t) for i, t in enumerate(tokenizers)})
    return tokenizers


def open_run(config: RunConfig, run_dir: pathlib.Path, *, resume: bool = False, first_start: bool = True,
             checkpoint: pathlib.Path | None = None, exchange: Exchange | None = None,
             local_rank: int | None = None, progress: Progress | None = None) -> tuple[Swarm, int]:
    """This process's Swarm and the step to start after (0: a fresh run).

    resume: continue from the newest complete checkpoint every rank has (train --resume, or an elastic restart).
    first_start: False for an elastic restart (which resumes by design, so the fresh-run check is skipped).
    checkpoint: restore exactly this checkpoint, without its optimizer (eval).
    exchange: this process's transport (None: every member lives in this process); the members it holds are
    its rank's (one member per rank) or all of them.
    """
    exchange = exchange or LocalExchange()
    distributed = exchange.world_size > 1
    local = [exchange.rank] if distributed else list(range(len(config.members)))
    if config.train.threads:
        torch.set_num_threads(config.train.threads)
    check_generator_placement(config, distributed=distributed)
    if checkpoint is None and first_start:
        problem = None
        if exchange.rank == 0:
            try:
                check_fresh_run(run_dir, resume)
            except RunDirError as exc:
                problem = str(exc)
        problem = exchange.all_gather_object(problem)[0]
        if problem:
            raise AgreedError(problem)
    tokenizers = preflight(config, members=local)
    hashes: dict[int, str] = {}
    for part in exchange.all_gather_object({i: vocabulary_hash(tokenizers[i]) for i in local}):
        hashes.update(part)
    check_shared_vocabulary(hashes)

    task = load_task(config.data, config.seed, config.eval.datasets)
    members = []
    for i in local:
        device = resolve_device(config.train.device, local_rank if local_rank is not None else i)
        member = build_member(i, config, tokenizers[i], device)
        check_model(member)
        members.append(member)
    train_indices = _usable_prompts(config, task, members[0].tokenizer, exchange)
    checkers = {m.index: RolloutChecker(task, m.tokenizer, m.vocab_size, config.rollout.max_new_tokens)
                for m in members}
    swarm = Swarm(
        config=config, task=task, members=members,
        exchange=Alone(exchange) if config.collaboration == "alone" else exchange, run_dir=run_dir,
        progress=progress or Progress(enabled=exchange.rank == 0), train_indices=train_indices,
        names=[m.name for m in config.members], checkers=checkers,
        loss_config=config.algorithm.loss_config(config.rollout.temperature),
    )
    if checkpoint is not None:
        return swarm, restore(swarm, checkpoint, load_optimizer=False, what="--checkpoint")
    if not resume:
        return swarm, 0
    found = latest_checkpoint(run_dir)
    step = exchange.all_agree(found[0] if found else 0)
    if step == 0:
        return swarm, 0
    return swarm, restore(swarm, run_dir / "checkpoints" / f"step-{step}",
                          load_optimizer=config.checkpoint.save_optimizer, what="--resume: checkpoint")


def _usable_prompts(config: RunConfig, task, tokenizer, exchange: Exchange) -> list[int]:
    """Training prompts that fit data.max_prompt_tokens (rank 0's list on every rank); eval sets are cut alike."""
    limit = config.data.max_prompt_tokens
    fits = [i for i, ex in enumerate(task.train) if len(prompt_ids(tokenizer, task, ex.question)) <= limit]
    fits = exchange.all_gather_object(fits)[0]
    if len(fits) < config.rollout.prompts_per_step:
        raise ConfigError(f"data.max_prompt_tokens={limit}: only {len(fits)} training prompts are that "
                          f"short, fewer than rollout.prompts_per_step={config.rollout.prompts_per_step}")
    for name, examples in task.evals.items():  # eval prompts obey the same limit (a vLLM engine is sized by it)
        keep = [i for i, ex in enumerate(examples) if len(prompt_ids(tokenizer, task, ex.question)) <= limit]
        kept = [examples[i] for i in exchange.all_gather_object(keep)[0]]
        if len(kept) < len(examples):
            log.warning("eval %s: %d of %d prompts exceed data.max_prompt_tokens=%d and are left out", name,
                        len(examples) - len(kept), len(examples), limit)
        task.evals[name] = kept
    return fits


def restore(swarm: Swarm, checkpoint: pathlib.Path, load_optimizer: bool, what: str) -> int:
    """Load every local member from `checkpoint`; returns its step. `what` names the argument in errors."""
    try:
        state = read_state(checkpoint)
        step = int(state["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RunDirError(f"{what} {checkpoint}: unreadable state.json ({type(exc).__name__}: "
                          f"{_first_line(exc)})") from None
    if state.get("members") != swarm.names:
        raise RunDirError(f"{what} {checkpoint}: holds members {state.get('members')}, the config has {swarm.names}")
    for member in swarm.members:
        try:
            restore_member(member, checkpoint, load_optimizer=load_optimizer)
        except Exception as exc:  # missing or truncated weights, a missing adapter, a foreign optimizer state
            raise RunDirError(f"{what} {checkpoint}: cannot load member {member.name!r} "
                              f"({type(exc).__name__}: {_first_line(exc)})") from None
        member.generator.sync(member.model)
    return step


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no detail"
