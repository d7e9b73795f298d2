"""A run directory: one run (or study) at a time in it (`RunLock`), a new run never into one that holds a run,
and what a resumed run (`--resume`) or an evaluation (`eval --checkpoint`) may change of the config it continues.
Every refusal is a RunDirError, one line naming the field or path."""

from __future__ import annotations

import errno
import fcntl
import os
import pathlib
import re
import socket
import time

from ..config import ConfigError, RunConfig, config_differences, load_config, validate_config
from ..config.tasks import settings_read
from ..core.safefile import LinkRefused, open_lock, write_text
from ..model.checkpoint import complete_checkpoints, latest_checkpoint, read_state


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
    record = run_dir / DATA_RECORD  # a run with a checkpoint: check_resume_data's to judge
    if record.exists() and not record.is_file() and latest_checkpoint(run_dir) is None:
        raise RunDirError(f"run_name: {record} is not a file (a run's record of its data is); move it away")
    if holds_run(run_dir) and not resume:
        raise RunDirError(f"run_name: {run_dir} already holds a run; pass --resume to continue it or choose "
                          "another run_name/--output-dir")
    if resume and not has_logged(run_dir):
        raise RunDirError(f"--resume: {run_dir} holds no run to continue (no metrics and no checkpoint); drop "
                          "--resume to start it")


# the fields a resumed run may change: how long it runs, how often it evaluates and checkpoints, where and how
# fast the processes run and what they log; everything else would make the resumed run a different run than the
# one it continues. (Recompute and the device change memory and speed, not the update: after an out-of-memory
# crash a run may move or shrink.)
RESUMABLE = ("train.steps", "train.threads", "eval.", "checkpoint.every", "checkpoint.keep_last", "output_dir",
             "swarm.timeout_s", "swarm.max_restarts", "data.reward_timeout_s", "data.eval_paths",
             "logging.report_to", "logging.project", "logging.completions", "train.device",
             "train.gradient_checkpointing", "train.shared_prompt")
# and, to go on after a divergence, a member's step size: its learning rate, gradient clip and weight decay (the
# restored optimizer takes them from the config, not from its saved state); and where it runs and how much of the
# GPU its engine takes
RESUMABLE_MEMBER = ("lr", "grad_clip", "weight_decay", "device", "vllm")


def resumable(field: str) -> bool:
    parts = field.split(".")
    return field.startswith(RESUMABLE) or (len(parts) >= 3 and parts[0] == "members" and parts[2] in RESUMABLE_MEMBER)
# the member fields that make the model eval loads (with the run's seed: a built-in model is rebuilt from it)
MEMBER_MODEL_KEYS = ("name", "model", "tokenizer", "lora", "seed", "dtype", "warm_start")


def _saved_config(run_dir: pathlib.Path, what: str) -> RunConfig | None:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    try:
        return load_config(path)
    except ConfigError as exc:
        # from None: a one-line error for the user; the cause adds nothing to it
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
    if saved.train.steps != config.train.steps and config.train.lr_schedule != "constant":
        raise RunDirError(f"--resume: train.steps {saved.train.steps} -> {config.train.steps} would move the "
                          f"{config.train.lr_schedule} learning-rate schedule, which runs over train.steps (the rate "
                          "would jump at the resumed step); a resumed run changes train.steps only with "
                          "train.lr_schedule constant (start a new run_name for a longer schedule)")
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


# the temporary files of the run's whole-or-nothing writes: .config.yaml.tmp<pid>, safefile's .data.json.<hex>.tmp
TEMPORARY = re.compile(r"^\.[^/]+\.(tmp\d+|[0-9a-f]{12}\.tmp)$")


class RunLock:
    """Holds a directory for one run (train, or an --nproc launcher for its ranks) or one study: `<dir>/.lock`,
    locked with flock (the OS releases it when the process ends, kill -9 included) and naming its holder. A
    second one into the same directory stops with one line naming the holder. A directory this lock created and
    that was left with nothing of a run (no record: at most its config.yaml, data.json and an empty metrics.jsonl)
    is removed again, so a run that fails before its first record leaves nothing behind."""

    # kind -> (the field a message names, what to choose instead)
    KINDS = {"run": ("run_name", "another run_name/--output-dir"), "study": ("--output-dir", "another --output-dir"),
             "coordinator": ("--output-dir", "another --output-dir")}

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
        where = "output_dir" if self.kind == "run" else field
        taken = next((d for d in [self.run_dir, *self.run_dir.parents] if d.exists()), None)
        if taken is not None and not taken.is_dir():
            raise RunDirError(f"{where}: cannot write to {self.run_dir} ({'it' if taken == self.run_dir else taken} "
                              "is not a directory)")
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = open_lock(self.run_dir / ".lock", self.run_dir)  # never through a link: its holder's line is written
        except LinkRefused as exc:
            # from None: a one-line error for the user naming the planted link
            raise RunDirError(f"{where}: {exc.filename}: {exc.strerror}") from None
        except OSError as exc:
            # from None: a one-line error for the user; the cause adds nothing to it
            raise RunDirError(f"{where}: cannot write to {self.run_dir} ({exc.strerror or type(exc).__name__})"
                              ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):  # not held: locks do not work here
                os.close(fd)
                # from None: a one-line error for the user; the cause adds nothing to it
                raise RunDirError(f"{field}: cannot lock {self.run_dir / '.lock'} ({exc.strerror or exc}): its file "
                                  "system takes no flock (NFS without locking, Lustre without -o flock); use a "
                                  "local or lock-capable --output-dir") from None
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            # from None: a one-line error for the user; the cause adds nothing to it
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
        for partial in self.run_dir.glob(".*.tmp*"):  # a write cut short (a full disk, a kill) left its temporary
            if TEMPORARY.match(partial.name) and partial.is_file() and not partial.is_symlink():  # file: no one
                partial.unlink(missing_ok=True)  # else writes here while the lock is held
        leftover = sorted(p.name for p in self.run_dir.iterdir())
        # a run that stopped before its first record (a refused join, a failure at start) wrote at most its resolved
        # config and an empty log: nothing a person needs, and a rerun writes them again
        empty = {".lock", "config.yaml", DATA_RECORD, "metrics.jsonl"} if self.kind == "run" else {".lock"}
        if self._created and set(leftover) <= empty and not has_logged(self.run_dir):
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


# ----------------------------------------------------------------------------------------------- the run's data

DATA_RECORD = "data.json"  # in the run directory: the sha256 of every local data file the run reads


def data_files(config: RunConfig) -> dict[str, pathlib.Path]:
    """The local files (or, task hf, the local directory) the run's data is read from, by the config field that
    names them: data.train_path, data.eval_paths.<name> (a file per eval set), data.path. A dataset read from the
    HF hub has none here (the hub's own revisions are not checked)."""
    data = config.data
    read = settings_read(data.task) or set()
    files = {}
    if "train_path" in read and data.train_path is not None:
        files["data.train_path"] = pathlib.Path(data.train_path)
    if "eval_paths" in read and data.task != "hf":  # task hf's eval_paths name splits of data.path
        files.update({f"data.eval_paths.{name}": pathlib.Path(path) for name, path in data.eval_paths.items()})
    if "path" in read and data.path is not None and pathlib.Path(data.path).is_dir():
        files["data.path"] = pathlib.Path(data.path)
    return files


def file_digest(path: pathlib.Path) -> str:
    """sha256 of a file's bytes, or of a directory's files (each one's path within it and its bytes, in order)."""
    import hashlib

    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode(errors="surrogateescape") + b"\x00")
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\x01")
    return digest.hexdigest()


def data_digests(config: RunConfig) -> dict[str, dict[str, str]]:
    """{config field: {path, sha256}} of data_files(config) (a file that cannot be read is left out: loading the
    task says why)."""
    out = {}
    for field, path in data_files(config).items():
        try:
            out[field] = {"path": str(path), "sha256": file_digest(path)}
        except OSError:
            continue
    return out


MAX_DATA_RECORD_BYTES = 4 << 20  # data.json holds a digest per data file and a line per resume: kilobytes
SHA256 = re.compile(r"^[0-9a-f]{64}$")


class DataRecordError(RunDirError):
    """A data.json that is missing, not a file, empty, too large, not JSON or not a whole, in-range record."""


def load_data_record(run_dir: pathlib.Path) -> dict:
    """The run's data.json ({"files": {field: {path, sha256}}, "changes": [{"step", "fields"}]}), checked whole: a
    DataRecordError saying what is wrong with it (missing, not a file, empty, over MAX_DATA_RECORD_BYTES, not JSON,
    a field of another form or out of range)."""
    import json

    path = run_dir / DATA_RECORD
    if not path.exists() and not path.is_symlink():
        raise DataRecordError(f"{path} is missing")
    if not path.is_file():
        raise DataRecordError(f"{path} is not a file")
    try:
        size = path.stat().st_size
        if 0 < size <= MAX_DATA_RECORD_BYTES:
            text = path.read_bytes()
    except OSError as exc:
        # from None: a one-line error for the user; the cause adds nothing to it
        raise DataRecordError(f"{path} cannot be read ({exc.strerror or type(exc).__name__})") from None
    if size == 0 or size > MAX_DATA_RECORD_BYTES:
        raise DataRecordError(f"{path} is {'empty' if size == 0 else f'{size} bytes (a record is kilobytes)'}")
    try:
        record = json.loads(text)
    except ValueError as exc:  # json's errors, and bytes that are not UTF-8
        # from None: a one-line error for the user; the cause adds nothing to it
        raise DataRecordError(f"{path} is not JSON ({' '.join(str(exc).split())[:120]})") from None
    files = record.get("files") if isinstance(record, dict) else None
    changes = record.get("changes") if isinstance(record, dict) else None
    if not isinstance(files, dict) or not isinstance(changes, list):
        raise DataRecordError(f"{path} is not a data record (an object with files and changes)")
    for field, entry in files.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("path"), str)
                and isinstance(entry.get("sha256"), str) and SHA256.match(entry["sha256"])):
            raise DataRecordError(f"{path}: files.{field} is not a file's path and sha256")
    for k, change in enumerate(changes):
        step = change.get("step") if isinstance(change, dict) else None
        fields = change.get("fields") if isinstance(change, dict) else None
        if (not isinstance(step, int) or isinstance(step, bool) or step < 0 or not isinstance(fields, list)
                or not all(isinstance(f, str) for f in fields)):
            raise DataRecordError(f"{path}: changes.{k} is not a step (>= 0) and its fields")
    return record


def read_data_record(run_dir: pathlib.Path) -> dict | None:
    """load_data_record's record, or None when there is none whole (the resume was refused for it, or went on
    with --allow-data-change and recorded so)."""
    try:
        return load_data_record(run_dir)
    except DataRecordError:
        return None


def changed_data(recorded: dict, config: RunConfig) -> list[tuple[str, dict, dict | None]]:
    """(field, as recorded, as now: None when the file is gone) of each recorded data file whose bytes differ now.
    An eval set added since is no change; one dropped neither."""
    now = data_digests(config)
    fields = set(data_files(config))
    return [(field, was, now.get(field)) for field, was in sorted(recorded["files"].items())
            if field in fields and isinstance(was, dict) and (now.get(field) or {}).get("sha256") != was.get("sha256")]


def check_resume_data(run_dir: pathlib.Path, config: RunConfig, allow_change: bool) -> list[str]:
    """--resume continues on the data the run trained and evaluated on: a recorded data file whose bytes changed
    since (data.json) refuses the resume, one line naming the field, unless allow_change (--allow-data-change): then
    it is warned about, and the run records the change (record_data) and marks every record after it. Returns the
    changed fields. A data.json that is not whole (missing, emptied, damaged: load_data_record) is refused alike, never
    taken for "unchanged" (a run started before data.json was written too: --allow-data-change goes on)."""
    import logging

    if latest_checkpoint(run_dir) is None:
        return []  # nothing to continue from: the run starts over and records its data anew
    try:
        recorded = load_data_record(run_dir)
    except DataRecordError as exc:
        if not allow_change:
            # from None: a one-line error for the user; the cause adds nothing to it
            raise RunDirError(f"--resume: {exc}; it records the sha256 of the data the run trained on, so without it "
                              "a resume cannot tell whether the data changed: restore it, or pass --allow-data-change "
                              "to go on on the data as it is now (warned, the unusable record kept aside, and every "
                              "record from the resumed step marked data_changed_at)") from None
        logging.getLogger("ftis_engine").warning("--resume --allow-data-change: %s, so whether the run's data changed "
                                                 "is not known; its records from here carry data_changed_at", exc)
        return sorted(data_files(config))
    changes = changed_data(recorded, config)
    if not changes:
        return []
    said = ", ".join(f"{field} ({now['path'] if now else was.get('path')}: "
                     + (f"sha256 {str(was.get('sha256'))[:12]}... then, {now['sha256'][:12]}... now)" if now else
                        "unreadable now)") for field, was, now in changes[:3])
    said += f" and {len(changes) - 3} more" if len(changes) > 3 else ""
    if not allow_change:
        raise RunDirError(f"--resume: the run's data changed since it recorded it: {said}; a resume is exact or "
                          "refused: restore the data, start a new run_name, or pass --allow-data-change to go on "
                          "on the new data (warned, and every record from the resumed step marked data_changed_at)")
    logging.getLogger("ftis_engine").warning("--resume --allow-data-change: the run's data changed since it recorded "
                                             "it: %s; its records from here carry data_changed_at", said)
    return [field for field, _, _ in changes]


def record_data(run_dir: pathlib.Path, config: RunConfig, start_step: int) -> int | None:
    """Write data.json at a run's start (atomically): the sha256 of its data files; a resumed run whose data
    changed (allowed by --allow-data-change, check_resume_data) adds {step, fields} to its changes. Returns the
    step of the newest change (None: the data is as the run began), which the run's records then carry."""
    import json
    import logging

    recorded, problem = None, None
    if start_step:
        try:
            recorded = load_data_record(run_dir)
        except DataRecordError as exc:
            problem = str(exc)
    changes = list(recorded["changes"]) if recorded is not None else []
    if recorded is not None:
        fields = [field for field, _, _ in changed_data(recorded, config)]
        if fields:
            changes.append({"step": start_step, "fields": fields})
    elif problem is not None:  # a resume past an unusable record (--allow-data-change): kept, and said
        kept = _keep_aside(run_dir / DATA_RECORD, f"unusable-step-{start_step}")
        changes.append({"step": start_step, "fields": sorted(data_files(config)), "unverified": problem})
        logging.getLogger("ftis_engine").warning(
            "%s; the data is recorded as it is now%s, and the records from step %d on carry data_changed_at", problem,
            f" (the old record kept as {kept})" if kept else "", start_step)
    record = {"files": {**(recorded["files"] if recorded is not None else {}), **data_digests(config)},
              "changes": changes}
    write_text(run_dir / DATA_RECORD, json.dumps(record, indent=2), run_dir)  # whole, never through a link
    steps = [c.get("step") for c in changes if isinstance(c, dict) and isinstance(c.get("step"), int)]
    return max(steps) if steps else None


def _keep_aside(path: pathlib.Path, tag: str) -> pathlib.Path | None:
    """Move `path` (a file, a directory or a link) to `<path>.<tag>` (or .<tag>-2, ...) beside it; None when
    there is nothing there."""
    if not path.exists() and not path.is_symlink():
        return None
    target, n = path.with_name(f"{path.name}.{tag}"), 1
    while target.exists() or target.is_symlink():
        n += 1
        target = path.with_name(f"{path.name}.{tag}-{n}")
    os.rename(path, target)
    return target
