"""Checkpoints: run_dir/checkpoints/step-<N>/, written to a temporary directory and renamed when complete.

Layout of step-<N>/: state.json (the step and the member names; a member's policy version is the step, and the
data position follows from it), and per member members/<name>/ with the model (HF format: the master weights,
float32 whatever the compute dtype, so a resume is exact) or the LoRA adapter (peft format), the tokenizer, optimizer.pt (a member on several ranks: optimizer.shard-<i>.pt per rank) and
rng.pt. A directory named step-<N> is complete by construction (the
rename is the last act). Nothing is loaded with pickle's code execution (torch.load(weights_only=True)), so a
checkpoint from someone else can be resumed or evaluated safely; weights that are NaN or inf are never saved, and a
member's folder is checked whole before it is used (checkpoint_files.py: its kind, every tensor's shape, dtype and
finiteness, from the local files alone).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import pickle
import random
import re
import shutil

import torch
from ftis_kernels import NonFiniteInputError
from safetensors import SafetensorError

from ..core import safefile
from ..core.errors import first_line
from . import precision
from .checkpoint_files import (
    ADAPTER_FILE,
    CheckpointFault,
    check_finite,
    check_kind,
    check_loaded,
    check_optimizer_state,
    check_tensors,
    model_weight_files,
    read_headers,
    read_small_json,
)
from .fsdp import full_state_dict, local
from .precision import master_dtype
from .saving import save_pretrained
from .update import DivergenceError, weights_finite

STEP_DIR = re.compile(r"^step-(\d+)$")

# What writing a checkpoint's files raises when the disk is full, over quota or read-only: OSError (open, write,
# mkdir, rename), torch.save's RuntimeError ("file write failed") and safetensors' SafetensorError (an IoError).
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)

# What reading a checkpoint's files raises when they are missing, truncated, damaged or another run's: OSError (a
# missing file), ValueError (an adapter or optimizer state that does not fit), KeyError (a state without one of its
# keys), RuntimeError (torch.load's damaged archive, load_state_dict's shapes), SafetensorError (a damaged
# .safetensors), UnpicklingError (weights_only's refusal of a file that would run code) and EOFError (an empty file).
READ_ERRORS = (OSError, ValueError, KeyError, RuntimeError, SafetensorError, pickle.UnpicklingError, EOFError)


def checkpoint_root(run_dir: pathlib.Path) -> pathlib.Path:
    return run_dir / "checkpoints"


def complete_checkpoints(run_dir: pathlib.Path) -> list[tuple[int, pathlib.Path]]:
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = STEP_DIR.match(path.name)
        if match and (path / "state.json").is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(run_dir: pathlib.Path) -> tuple[int, pathlib.Path] | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def _writing(path: pathlib.Path):
    """Around one write of a checkpoint's file or folder: one of WRITE_ERRORS there is the disk's, a
    CheckpointWriteError naming `path`; any other error is this code's own and propagates as itself."""
    try:
        yield
    except safefile.LinkRefused:  # a link planted where the checkpoint goes: a path to check, not a full disk
        raise
    except WRITE_ERRORS as exc:
        reason = getattr(exc, "strerror", None) or " ".join(str(exc).split())[:160] or type(exc).__name__
        raise CheckpointWriteError(f"{path}: {reason}") from exc


def save_member(member, directory: pathlib.Path, save_optimizer: bool, extra: dict | None = None,
                root: pathlib.Path | None = None) -> None:
    """A member's model (HF format) or adapter, tokenizer, optimizer and RNG state, and `extra` (file name -> a
    JSON object, written by the leader: its receiver's screen.json). Every file and folder through safefile, under
    `root` (the run directory; None: `directory` itself): a link planted in their place is refused (LinkRefused,
    naming it), never written through; the model folder is written whole into a fresh folder and renamed.
    A member on several ranks:
    every shard calls it; the weights are gathered one tensor at a time and the leader writes them, each shard
    writes its optimizer shard (optimizer.shard-<i>.pt), and the leader writes rng.pt once all have. A write that
    fails (a full disk: torch.save reports it as a RuntimeError) raises CheckpointWriteError naming the file."""
    shard = member.shard
    if not weights_finite(member.trainable_parameters(), shard):
        raise DivergenceError(f"members.{member.index} ({member.name}): its weights are NaN or inf; they are not "
                              "saved (the newest complete checkpoint stays)")
    leader = member.leads
    model_dir = directory / "model"
    root = directory if root is None else root
    if leader:
        with _writing(directory):
            if root == directory:  # the caller's own folder: made as given
                directory.mkdir(parents=True, exist_ok=True)
            os.close(safefile.open_folder(directory, root))
    weights = full_state_dict(member.model, keep=leader) if shard.sharded else None
    shard.barrier()  # the leader made the directory
    if leader:

        def write_model(folder: pathlib.Path) -> None:  # weights and tokenizer, renamed to model/ together
            given = {"state_dict": weights} if shard.sharded else {}
            save_pretrained(member.model, folder, safe_serialization=True, **given)
            member.tokenizer.save_pretrained(str(folder))

        with _writing(model_dir):
            safefile.write_folder(model_dir, write_model, root)
        for file, value in (extra or {}).items():
            text = json.dumps(value)
            with _writing(directory / file):
                safefile.write_text(directory / file, text, root)
    if save_optimizer:
        path = directory / (f"optimizer.shard-{shard.index}.pt" if shard.sharded else "optimizer.pt")
        state = local_optimizer_state(member.optimizer) if shard.sharded else member.optimizer.state_dict()
        with _writing(path), safefile.open_write(path, root) as out:
            torch.save(state, out)
    shard.barrier()  # every shard has written its part
    if leader:  # rng.pt is written last and atomically: its presence marks the member staged (finalize_when_staged)
        state = rng_state()
        with _writing(directory / "rng.pt"), safefile.open_write(directory / "rng.pt", root) as out:
            torch.save(state, out)


def apply_step_size(member) -> None:
    """A restored optimizer's learning rate and weight decay are the config's (a resume may lower them after a
    divergence; load_state_dict would bring back the saved ones)."""
    precision.set_lr(member.optimizer, member.settings.lr)
    for group in member.optimizer.param_groups:
        group["weight_decay"] = member.settings.weight_decay


def local_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state with every sharded tensor as this rank's plain part (loadable with weights_only)."""
    state = optimizer.state_dict()
    state["state"] = {key: {name: local(value) if isinstance(value, torch.Tensor) else value
                            for name, value in entry.items()} for key, entry in state["state"].items()}
    return state


def restore_optimizer_shard(member, checkpoint: pathlib.Path) -> None:
    """A sharded member's optimizer from its shard's file (same ranks as when saved: members.N.ranks cannot
    change on --resume): each plain part becomes a part of its parameter's sharded tensor again."""
    from torch.distributed.tensor import DTensor

    path = member_dir(checkpoint, member.name) / f"optimizer.shard-{member.shard.index}.pt"
    state = torch.load(path, map_location="cpu", weights_only=True)  # Adam's step count stays on the CPU
    check_optimizer_state(state, None, path)  # its parts are this rank's: finite, their shapes the shards'
    params = [p for group in member.optimizer.param_groups for p in group["params"]]
    for key, entry in state["state"].items():
        param = params[int(key)]
        for name, value in entry.items():
            if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0:
                entry[name] = DTensor.from_local(value.to(member.device), param.device_mesh, param.placements,
                                                 shape=param.shape, stride=param.stride())
    member.optimizer.load_state_dict(state)
    apply_step_size(member)


def staging_dir(run_dir: pathlib.Path, step: int) -> pathlib.Path:
    return checkpoint_root(run_dir) / f".tmp-step-{step}"


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written (a full disk, a quota, a read-only place): its staging directory is
    removed and the newest complete checkpoint stays as it was."""


def stage_members(run_dir: pathlib.Path, step: int, members: list, save_optimizer: bool,
                  extras: dict | None = None) -> pathlib.Path:
    """Write the members this process holds into the step's staging directory (every rank may add its own). A
    write that fails (one of WRITE_ERRORS where a file is written) removes the staging directory and raises
    CheckpointWriteError saying what to do; any other error (weights that turned non-finite: DivergenceError; this
    code's own, an AttributeError) propagates as itself."""
    tmp = staging_dir(run_dir, step)
    try:
        for member in members:
            target = tmp / "members" / member.name
            if target.is_dir() and not target.is_symlink():  # a link there: save_member refuses it
                with _writing(target):
                    shutil.rmtree(target)
            save_member(member, target, save_optimizer, (extras or {}).get(member.name), run_dir)
    except CheckpointWriteError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(f"checkpoint step-{step} could not be written into {checkpoint_root(run_dir)} "
                                   f"({exc}); {after_failed_write(run_dir)}") from exc
    return tmp


def after_failed_write(run_dir: pathlib.Path) -> str:
    """How a run goes on after a write the disk refused (full, over quota): from its newest complete checkpoint
    (--resume), or, with none yet, from the start (a --resume there would find nothing to continue)."""
    newest = latest_checkpoint(run_dir)
    if newest is not None:
        return f"the newest complete checkpoint, step-{newest[0]}, is intact: free space, then --resume"
    return ("the run has no complete checkpoint yet, so nothing to continue from: free space, then start it again "
            "(the same command, without --resume)")


def sync_tree(root: pathlib.Path) -> None:
    """fsync every file and directory under `root` (and root itself): written to the disk, not only to the page
    cache, so that after a power or node loss a complete checkpoint's files are whole."""
    for path in sorted(root.rglob("*"), key=lambda p: -len(p.parts)) + [root]:  # files and subdirectories first
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def sync_directory(directory: pathlib.Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def finalize_checkpoint(run_dir: pathlib.Path, step: int, state: dict, keep_last: int) -> pathlib.Path:
    """Write state.json and rename the staging directory to step-<N> (the act that makes it complete); prune.
    Everything is on the disk before the rename and the rename before any older checkpoint is pruned: a machine
    that loses power never leaves a step-<N> of truncated files in place of the one before it."""
    tmp = staging_dir(run_dir, step)
    safefile.write_text(tmp / "state.json", json.dumps({**state, "step": step}, indent=2), run_dir)
    sync_tree(tmp)
    final = checkpoint_root(run_dir) / f"step-{step}"
    if final.exists():  # never a moment without a complete step-N: move the old one aside first
        old = checkpoint_root(run_dir) / f".old-step-{step}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    sync_directory(checkpoint_root(run_dir))  # the rename itself
    prune(run_dir, keep_last)
    return final


def finalize_when_staged(run_dir: pathlib.Path, step: int, state: dict, keep_last: int) -> pathlib.Path | None:
    """Async ranks stage a step whenever they reach it; the one that finds every member of state["members"]
    staged (rng.pt is the last file a member writes) completes the checkpoint. A lock makes that exactly one."""
    import fcntl

    root = checkpoint_root(run_dir)
    with open(safefile.open_lock(root / ".finalize.lock", run_dir), "rb") as lock:  # never through a link
        fcntl.flock(lock, fcntl.LOCK_EX)
        tmp = staging_dir(run_dir, step)
        if not tmp.is_dir() or not all((tmp / "members" / name / "rng.pt").is_file() for name in state["members"]):
            return None
        return finalize_checkpoint(run_dir, step, state, keep_last)


def prune(run_dir: pathlib.Path, keep_last: int) -> None:
    """Keep the newest keep_last complete checkpoints; remove staging left behind by steps up to the newest (an
    async member may already be staging a later one)."""
    found = complete_checkpoints(run_dir)
    for step, path in found[:-keep_last]:
        gone = path.parent / f".pruned-step-{step}"  # renamed first: a prune cut short never leaves a step-N
        os.replace(path, gone)  # that looks complete (its state.json) with some of its files deleted
        shutil.rmtree(gone, ignore_errors=True)
    clear_staging(run_dir, up_to=found[-1][0] if found else -1)


def clear_staging(run_dir: pathlib.Path, up_to: int | None = None) -> None:
    """Remove staging directories of steps up to `up_to` (None: all of them, before a run (re)starts: staging a
    crashed run left behind must never be completed by the new one)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return
    for leftover in root.glob(".tmp-step-*"):
        number = leftover.name.removeprefix(".tmp-step-")
        if up_to is None or not number.isdigit() or int(number) <= up_to:
            shutil.rmtree(leftover, ignore_errors=True)
    for leftover in [*root.glob(".pruned-step-*"), *root.glob(".old-step-*")]:  # a prune or a replace cut short
        shutil.rmtree(leftover, ignore_errors=True)


def read_state(checkpoint: pathlib.Path) -> dict:
    return read_small_json(checkpoint / "state.json")


def member_dir(checkpoint: pathlib.Path, name: str) -> pathlib.Path:
    return checkpoint / "members" / name


def restore_member(member, checkpoint: pathlib.Path, load_optimizer: bool = True, load_rng: bool = True) -> None:
    """Load weights (full model or LoRA adapter), optimizer and RNG state saved by save_member. A resume needs all
    three (an exact resume: Adam's moments and the sampling streams continue): a missing optimizer.pt or rng.pt
    raises FileNotFoundError naming it, never a silent restart from zero. Eval loads the weights only. Whatever of
    the folder does not fit the member (another kind or architecture, a tensor missing, extra, of another shape or
    dtype, NaN or inf) is a CheckpointFault naming the file, raised before any of it is used."""
    directory = member_dir(checkpoint, member.name)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint {checkpoint} has no member {member.name!r}")
    model_dir = directory / "model"
    optimizer_file, rng_file = directory / "optimizer.pt", directory / "rng.pt"
    for needed, file in ((load_optimizer, optimizer_file), (load_rng, rng_file)):
        if needed and not file.is_file():
            raise FileNotFoundError(f"{file} is missing (an exact resume needs it)")
    check_kind(member, model_dir)  # before a byte of weights is read: another member's folder, another kind
    if member.settings.lora is not None:  # peft: load the adapter weights in place
        from peft import get_peft_model_state_dict, set_peft_model_state_dict
        from safetensors.torch import load_file

        adapter_file = model_dir / ADAPTER_FILE
        check_tensors(member, read_headers([adapter_file]), get_peft_model_state_dict(member.model), True, adapter_file)
        weights = load_file(str(adapter_file), device=str(member.device))
        check_finite(weights.items(), lambda name: adapter_file)
        loaded = set_peft_model_state_dict(member.model, weights)
        adapter = [k for k in loaded.missing_keys if "lora_" in k]
        if loaded.unexpected_keys or adapter or not weights:  # else the member would go on from a fresh adapter
            raise CheckpointFault(f"{adapter_file} does not fit this member's adapter ({len(adapter)} of its weights "
                                  f"missing, e.g. {adapter[:1]}; {len(loaded.unexpected_keys)} unexpected, e.g. "
                                  f"{loaded.unexpected_keys[:1]})")
    else:
        files = model_weight_files(model_dir)
        found = read_headers(files)
        check_tensors(member, found, member.model.state_dict(), False, model_dir)
        # through transformers' own loader: it maps the saved (original-format) names back to the module's
        # names, which differ for families whose weights transformers converts on load (e.g. MoE experts); local
        # files only, and what it finds amiss is said in one line (check_loaded), not in its report
        with _quiet_load_report():
            saved, info = type(member.model).from_pretrained(
                str(model_dir), dtype=master_dtype(member.settings.master_dtype), local_files_only=True,
                output_loading_info=True, ignore_mismatched_sizes=True)
        check_loaded(member, info, model_dir)
        weights = saved.state_dict()
        check_finite(weights.items(), lambda name: found[name][2] if name in found else model_dir)
        member.model.load_state_dict(weights, strict=True)
        del saved, weights
    if load_optimizer:
        # loaded to the CPU: load_state_dict moves each moment to its parameter's device and leaves Adam's step
        # count where it lies, as torch keeps it (on the CPU: loaded onto a GPU, every step would sync once a tensor)
        state = torch.load(optimizer_file, map_location="cpu", weights_only=True)
        check_optimizer_state(state, member.optimizer, optimizer_file)
        with _holding(optimizer_file, "an optimizer state"):
            member.optimizer.load_state_dict(state)
        apply_step_size(member)
    if load_rng:
        state = torch.load(rng_file, weights_only=True)
        with _holding(rng_file, "an RNG state"):
            set_rng_state(state)


@contextlib.contextmanager
def _quiet_load_report():
    """transformers logs a multi-line load report (missing, unexpected, mismatched tensors) as a warning before it
    returns them; restore_member says what matters of it in one line (check_loaded)."""
    import logging

    logger = logging.getLogger("transformers.modeling_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _holding(file: pathlib.Path, what: str):
    """Around applying a state read from `file`: what its content alone makes torch or random raise there (a
    TypeError or IndexError: a list where a dict was saved) is the file's fault, a ValueError naming it (one of
    READ_ERRORS, as a damaged file's)."""
    try:
        yield
    except (TypeError, IndexError) as exc:
        raise ValueError(f"{file}: does not hold {what} ({type(exc).__name__}: {first_line(exc)})") from exc


@contextlib.contextmanager
def diverging(run_dir: pathlib.Path, member, step: int):
    """A member's forward or update that finds its model diverged (hidden states, loss, gradient or weights NaN or
    inf) stops the run with one DivergenceError naming the member, the step and what to do: in the update, and in
    the forwards before it (generation, the screen, the logged completions, the old log-probs of several optimizer
    steps), on a learner or a sampler; the advice names the newest complete checkpoint of `run_dir`."""
    try:
        yield
    except (DivergenceError, NonFiniteInputError) as exc:
        what = str(exc) if isinstance(exc, DivergenceError) else \
            f"the model's hidden states became NaN or inf ({exc}); no step was taken"
        newest = latest_checkpoint(run_dir)
        knobs = f"members.{member.index}.lr, .grad_clip or .weight_decay"
        advice = (f"the newest complete checkpoint, step-{newest[0]}, is kept: --resume with a smaller step, e.g. "
                  f"--set members.{member.index}.lr=... (a resume may change {knobs})" if newest else
                  f"no checkpoint was written before it: rerun with a smaller step ({knobs}); the run starts over")
        # from None: a one-line error for the user; the cause adds nothing to it
        raise DivergenceError(f"step {step}: members.{member.index} ({member.name}) diverged: {what}; {advice}") \
            from None
