"""How a learner's records reach its run directory, chosen once from its role (records_for) so the loop reads no
role flag:

- SharedRecords: a synchronous world (or one process). Every rank sends its records to rank 0, which writes them,
  prints the step's line and completes each checkpoint between two barriers.
- OwnRecords: a process that never synchronises after the start (a rank of an async run across processes, an open
  swarm's member). Each rank that reports logs its own records, and whoever stages a checkpoint last completes it;
  final_eval.json is merged under a lock.

Rank 0 alone prepares the run directory (config.yaml, the data record, an earlier start's logs kept aside, the
resumed step's markers), whichever of the two it is.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pathlib
import time

from ..config import dump_config
from ..core import safefile
from ..model.checkpoint import clear_staging, finalize_checkpoint, finalize_when_staged, stage_members
from ..report.metrics import MetricsLogger, resume_records, truncate_metrics
from ..report.plots import NothingToPlot, make_plots
from ..report.progress import LEGEND, summary_line
from ..report.trackers import open_trackers
from .rundir import RunDirError, read_data_record, record_data
from .session import Swarm

log = logging.getLogger("ftis_engine")

MAX_FINAL_EVAL_BYTES = 16 << 20  # final_eval.json: a record per member and eval set, kilobytes


class Records:
    """A learner's records and checkpoints: what it writes (writes: a logger of its own), what it prepares
    (prepares: rank 0 sets the run directory up) and whether it reports (evaluates and logs its members: every
    process but a member's further shard). A context manager: the logger closes however the run ends."""

    per_rank = False  # each rank its own tracker run and TensorBoard folder (OwnRecords)

    def __init__(self, swarm: Swarm, writes: bool):
        self.swarm, self.writes = swarm, writes
        self.prepares, self.reports = swarm.role.writes_run, swarm.role.reports
        self.logger: MetricsLogger | None = None
        self._dropped = 0

    def __enter__(self) -> Records:
        return self

    def __exit__(self, *exc) -> None:
        if self.logger is not None:
            self.logger.close()

    # ------------------------------------------------------------------------------------------- the start

    def prepare(self, start_step: int) -> None:
        """Rank 0: the run directory's files before the first step (config.yaml, its data files' sha256, an earlier
        start's logs kept aside, the records a resume replays dropped, the staging area cleared)."""
        if not self.prepares:
            return
        config, run_dir = self.swarm.config, self.swarm.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        safefile.write_text(run_dir / "config.yaml", dump_config(config), root=run_dir)  # a Ctrl-C may land here
        record_data(run_dir, config, start_step)  # its data files' sha256 (a resume on changed data: the change)
        if start_step == 0:  # a start over a run that stopped before its first checkpoint: its logs are kept aside
            for log_file in ("metrics.jsonl", "completions.jsonl"):
                keep_aside(run_dir / log_file)
        self._dropped = truncate_metrics(run_dir / "metrics.jsonl", start_step if start_step else -1)  # step 0 anew
        if (run_dir / "completions.jsonl").is_file():  # its samples too: the resumed steps write them anew
            truncate_metrics(run_dir / "completions.jsonl", start_step)
        clear_staging(run_dir)

    def open(self, start_step: int) -> None:
        """The logger (metrics.jsonl, TensorBoard, trackers), once every rank has opened the run; TensorBoard forgets
        what the truncated log dropped. A resume's markers and the step line's legend from rank 0."""
        if not self.writes:
            return
        swarm, own = self.swarm, self.per_rank
        config, run_dir, rank = swarm.config, swarm.run_dir, swarm.exchange.rank
        # a resume that went on on changed data (--allow-data-change): every record from then on says since when
        data = read_data_record(run_dir)
        changed_at = max((c["step"] for c in data["changes"] if isinstance(c, dict) and isinstance(c.get("step"), int)),
                         default=None) if data is not None else None
        report_to = config.logging.report_to
        trackers = open_trackers(report_to, run_dir, config.logging.project,
                                 config.run_name + (f"-rank{rank}" if own else ""), config.run_name,
                                 config.model_dump(mode="json"), resume=start_step > 0)
        self.logger = MetricsLogger(run_dir, purge_step=start_step + 1 if start_step else None, shared=own,
                                    tensorboard="tensorboard" in report_to, trackers=trackers,
                                    tensorboard_suffix=f".rank{rank}" if own else "",
                                    tensorboard_subdir=f"rank{rank}" if own else "",
                                    marks={"data_changed_at": changed_at} if changed_at is not None else None)
        if self.prepares and start_step:
            for record in resume_records(start_step, swarm.names, self._dropped):
                self.logger.log(record)

    def legend(self) -> None:
        if self.prepares:
            self.swarm.progress.print(LEGEND)

    # ------------------------------------------------------------------------------------------- each step

    def gather(self, records: list[dict]) -> list[dict]:
        """Every rank's records where they are written (a collective in a synchronous world)."""
        raise NotImplementedError

    def log(self, step: int, records: list[dict], timing: tuple[float, float] | None = None) -> list[dict]:
        """The step's records gathered and written, with the step's summary line (its seconds and the time left,
        from the mean step so far); returns the gathered records."""
        records = self.gather(records)
        if self.logger is not None:
            for record in records:
                self.logger.log(record)
            self.swarm.progress.print(summary_line(step, self.swarm.config.train.steps, records, *(timing or ())))
        return records

    def checkpoint(self, step: int) -> None:
        """Every rank stages its members; the checkpoint is then completed (finalize)."""
        swarm = self.swarm
        cfg = swarm.config.checkpoint
        # a receiver's defenses that keep state across steps (the claims monitor's tests, the length guard's own
        # lengths) go on after a resume
        extras = {m.name: {file: kept.target.state() for file, kept in swarm.receivers[m.index].kept_states().items()}
                  for m in swarm.members if m.index in swarm.receivers}
        stage_members(swarm.run_dir, step, swarm.members, cfg.save_optimizer, extras)
        self.complete(step, {"members": swarm.names, "config": swarm.config.model_dump(mode="json")})

    def complete(self, step: int, state: dict) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------- the end

    def finish(self, final: list[dict]) -> None:
        """The final eval records and the figures, once the run is over."""
        raise NotImplementedError


class SharedRecords(Records):
    def gather(self, records: list[dict]) -> list[dict]:
        return self.swarm.exchange.collectives.gather_records(records)

    def complete(self, step: int, state: dict) -> None:
        collectives = self.swarm.exchange.collectives
        collectives.barrier()  # every rank has staged its members
        if self.prepares:
            finalize_checkpoint(self.swarm.run_dir, step, state, self.swarm.config.checkpoint.keep_last)
        collectives.barrier()

    def finish(self, final: list[dict]) -> None:
        if self.writes:
            run_dir = self.swarm.run_dir
            end_plots(run_dir)
            # whole or not at all, never through a link: a study takes the file's presence for a finished run
            safefile.write_text(run_dir / "final_eval.json", json.dumps(final, indent=2), root=run_dir)


class OwnRecords(Records):
    per_rank = True

    def gather(self, records: list[dict]) -> list[dict]:
        return records

    def complete(self, step: int, state: dict) -> None:  # no barrier: whoever stages step N last completes it
        finalize_when_staged(self.swarm.run_dir, step, state, self.swarm.config.checkpoint.keep_last)

    def finish(self, final: list[dict]) -> None:
        if self.reports:  # every rank that reports merges its members' records in
            write_final_shared(self.swarm.run_dir, final)


def records_for(swarm: Swarm) -> Records:
    """The strategy of this process's role: rank 0 of a synchronous world writes every rank's records; a process
    that never synchronises writes its own when it reports (Role.writes_records)."""
    kind = OwnRecords if swarm.role.independent else SharedRecords
    return kind(swarm, writes=swarm.role.writes_records)


def keep_aside(metrics: pathlib.Path) -> None:
    """Rename a non-empty log (metrics.jsonl, completions.jsonl) of an earlier start, one that left no checkpoint,
    to <name>.<time>, so a start over never deletes its records."""
    if metrics.is_file() and metrics.stat().st_size > 0:
        stamp, n = time.strftime("%Y%m%d-%H%M%S"), 0
        while (aside := metrics.with_name(f"{metrics.name}.{stamp}" + (f"-{n}" if n else ""))).exists():
            n += 1  # two starts within a second: never one over the other
        os.replace(metrics, aside)
        log.warning("%s: the log of an earlier start that left no checkpoint is kept as %s; this run starts over",
                    metrics.parent, aside.name)


def end_plots(run_dir: pathlib.Path) -> None:
    """The run's figures as it ends; a figure that cannot be drawn or written (a link planted where it goes,
    refused by safefile) is a warning: the run's records and final_eval.json matter more than its pictures."""
    try:
        make_plots(run_dir)
    except NothingToPlot:  # a rank that logged no record yet has nothing to draw
        pass
    except OSError as exc:
        log.warning("the run's figures were not written (%s); `ftis-engine plot %s` draws them", exc, run_dir)


def write_final_shared(run_dir: pathlib.Path, final: list[dict]) -> None:
    """Async ranks finish at different times: each merges its members' final evals into final_eval.json and
    redraws the plots, under a lock (the last to finish leaves the complete picture)."""
    with open(safefile.open_lock(run_dir / ".final.lock", run_dir), "rb") as lock:  # never through a link
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = run_dir / "final_eval.json"
        mine = {r["member"] for r in final}
        kept = [r for r in read_final_evals(path) if r["member"] not in mine]
        safefile.write_text(path, json.dumps(kept + final, indent=2), root=run_dir)
        end_plots(run_dir)


def read_final_evals(path: pathlib.Path) -> list[dict]:
    """The records another rank wrote to final_eval.json ([] when there is none), read bounded
    (MAX_FINAL_EVAL_BYTES): one that is too large, not JSON or not a list of records with a member is a RunDirError
    naming it (the file is left as it is)."""
    if not path.exists() and not path.is_symlink():
        return []
    try:
        records = json.loads(safefile.read_bytes(path, MAX_FINAL_EVAL_BYTES, "final_eval.json"))
    except OSError as exc:
        # from None: a one-line error for the user naming the file
        raise RunDirError(f"{path}: {exc.strerror or type(exc).__name__}") from None
    except ValueError as exc:  # json's errors, and bytes that are not UTF-8
        # from None: a one-line error for the user naming the file
        raise RunDirError(f"{path}: not JSON ({' '.join(str(exc).split())[:120]}); move it away") from None
    if not isinstance(records, list) or not all(isinstance(r, dict) and isinstance(r.get("member"), str)
                                                for r in records):
        raise RunDirError(f"{path}: not a list of eval records (each with its member); move it away")
    return records
