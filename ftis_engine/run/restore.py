"""Reading a checkpoint into a run as it opens (session.open_run): which checkpoint a start restores (the given one,
or on --resume the newest complete one every rank has: `agree_checkpoint`), its step, a member's weights,
optimizer and RNG state (`restore_into`, `restore_shard`) and its receiver's kept state (`resume_screens`). What a
checkpoint's files can raise is one RunDirError naming the checkpoint; this code's own errors propagate as
themselves. Writing checkpoints is checkpoint.py's.
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
from typing import TYPE_CHECKING

from ..model.checkpoint import (
    READ_ERRORS,
    STEP_DIR,
    complete_checkpoints,
    latest_checkpoint,
    member_dir,
    read_state,
    restore_member,
    restore_optimizer_shard,
)
from ..model.checkpoint_files import CheckpointFault, read_small_json
from ..config import RunConfig
from ..core.errors import describe_load_error, first_line
from .rundir import RunDirError

if TYPE_CHECKING:
    from ..member.members import Member

log = logging.getLogger("ftis_engine")


def agree_checkpoint(config: RunConfig, run_dir: pathlib.Path, checkpoint: pathlib.Path | None, resume: bool,
                     collectives) -> tuple[pathlib.Path | None, str, int]:
    """The checkpoint this start restores (None: a fresh start), how errors name it, and the step the run goes on
    after (0: a fresh start). A collective on --resume (restore_source)."""
    source, what = restore_source(config, run_dir, checkpoint, resume, collectives)
    if source is None:
        return None, what, 0
    if checkpoint is None and not config.checkpoint.save_optimizer:
        log.warning("--resume: checkpoint.save_optimizer is false, so %s holds no optimizer state: Adam's "
                    "moments restart from zero (the resumed run is not the run that went through)", source)
    return source, what, checkpoint_step(config, source, what)


def resume_screens(receivers: dict, members: list[Member], source: pathlib.Path, config: RunConfig) -> None:
    """A resumed member's receiver goes on with the claims monitor's tests (screen.json) and the length guard's own
    lengths (admission.json) its checkpoint holds; one that holds none (written before that state was kept) starts
    afresh, warned."""
    for member in members:
        for name, kept in receivers[member.index].kept_states().items():
            file = member_dir(source, member.name) / name
            if not file.is_file():
                log.warning("%s: %s holds no %s (written before it was kept); %s", member.name, source,
                            kept.what, kept.afresh)
                continue
            try:
                state = read_small_json(file)
            except (OSError, ValueError) as exc:  # json's errors are ValueErrors too
                # from None: a one-line error for the user; the cause adds nothing to it
                raise RunDirError(f"--resume: {file}: {first_line(exc)}") from None
            try:
                kept.target.load_state(state, str(file))
            except ValueError as exc:
                # from None: a one-line error for the user; the cause adds nothing to it
                raise RunDirError(f"--resume: {first_line(exc)}") from None


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
        # from None: a one-line error for the user; the cause adds nothing to it
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
        said = str(exc) if isinstance(exc, CheckpointFault) else describe_load_error(exc)
        # from None: a one-line error for the user; the cause adds nothing to it
        raise RunDirError(f"{what} {checkpoint}: cannot load {part} ({said}); {_instead(checkpoint, what)}") from None


def _instead(checkpoint: pathlib.Path, what: str) -> str:
    """A checkpoint that cannot be used is its files' fault, not the run's: what else there is to go on from (an
    older complete checkpoint beside it), never the advice to retry the same one."""
    named = STEP_DIR.match(checkpoint.name)
    older = [path for step, path in complete_checkpoints(checkpoint.parent.parent)
             if named and path.parent == checkpoint.parent and step < int(named.group(1))]
    if not older:
        return "no older complete checkpoint is kept beside it"
    path = older[-1]
    if what == "--checkpoint":
        return f"an older complete checkpoint is {path}: evaluate that one with --checkpoint {path}"
    return (f"an older complete checkpoint is {path}: move {checkpoint.name} out of {checkpoint.parent} and --resume "
            "goes on from it")


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
