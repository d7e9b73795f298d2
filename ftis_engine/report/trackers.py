"""Experiment trackers beside metrics.jsonl and TensorBoard (logging.report_to, TRL's and verl's report_to): wandb and
trackio, optional extras. A tracker sees the numbers a TensorBoard writer sees, under the same names
(`<member>/<kind>[/<dataset>]/<key>`), with the run's step as its own axis (`step`), so that a resumed run's
repeated steps are logged again rather than refused by a tracker whose internal step only grows.

Where they write is theirs to say: wandb's WANDB_MODE=offline and WANDB_DIR, trackio's TRACKIO_DIR (a local SQLite
database unless a Space is configured). A resumed run continues the same wandb run (its id is kept in the run
directory) and the same trackio run (its name).
"""

from __future__ import annotations

import contextlib
import importlib.util
import pathlib
import re
import secrets
from typing import Protocol

from ..config import ConfigError
from ..core import safefile

TRACKERS = ("tensorboard", "wandb", "trackio")
EXTRA_HINT = {"wandb": "pip install 'ftis-engine[wandb]' (or wandb)", "trackio": "pip install 'ftis-engine[trackio]' "
              "(or trackio)"}


class Tracker(Protocol):
    def log(self, values: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def check_available(report_to: list[str]) -> str | None:
    """The first tracker in logging.report_to that is not installed, said in one line; None when all are."""
    for name in report_to:
        if name in EXTRA_HINT and importlib.util.find_spec(name) is None:
            return f"logging.report_to: {name} is not installed; {EXTRA_HINT[name]}"
    return None


class WandbTracker:
    def __init__(self, run_dir: pathlib.Path, project: str, name: str, group: str, config: dict):
        import wandb

        id_file = run_dir / "wandb_id"
        run_id = read_wandb_id(id_file) or secrets.token_hex(4)  # wandb's id form
        self.run = wandb.init(project=project, name=name, group=group, id=run_id, resume="allow", config=config,
                              dir=str(run_dir), reinit="create_new")
        safefile.write_text(id_file, run_id, run_dir)  # never through a link
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log({**values, "step": step})

    def close(self) -> None:
        self.run.finish()


MAX_WANDB_ID_BYTES = 128  # an id is a few characters (ours: 8 hex digits)
WANDB_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def read_wandb_id(id_file: pathlib.Path) -> str | None:
    """The wandb run id kept in the run directory, or None when there is none: read bounded (MAX_WANDB_ID_BYTES) and
    only an id's characters, else a ConfigError naming the file (it would name another run in wandb's records)."""
    try:
        raw = safefile.read_bytes(id_file, MAX_WANDB_ID_BYTES, "a wandb id file")
    except FileNotFoundError:  # a new run (or a link to nothing): a new id
        return None
    run_id = raw.decode("utf-8", "replace").strip()
    if not WANDB_ID.match(run_id):
        raise ConfigError(f"{id_file}: not a wandb run id (letters, digits, - and _); move it away")
    return run_id


class TrackioTracker:
    def __init__(self, project: str, name: str, group: str, config: dict, resume: bool):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=project, name=name, group=group, config=config,
                                resume="allow" if resume else "never", embed=False)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def open_trackers(report_to: list[str], run_dir: pathlib.Path, project: str, name: str, group: str, config: dict,
                  resume: bool) -> list[Tracker]:
    """The trackers of logging.report_to other than TensorBoard (MetricsLogger writes that itself). One that fails to
    open (or a Ctrl-C meanwhile) closes those already open."""
    trackers: list[Tracker] = []
    with contextlib.ExitStack() as opened:
        for kind in report_to:
            if kind == "wandb":
                tracker: Tracker = WandbTracker(run_dir, project, name, group, config)
            elif kind == "trackio":
                tracker = TrackioTracker(project, name, group, config, resume)
            else:
                continue
            opened.callback(tracker.close)
            trackers.append(tracker)
        opened.pop_all()  # all open: the caller closes them
    return trackers
