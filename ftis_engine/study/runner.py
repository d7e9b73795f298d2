"""Running a study: each run its own train process (`jobs` at once), resumed or skipped as it stands, then the
aggregate and the outputs."""

from __future__ import annotations

import gzip
import itertools
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from datetime import datetime, timezone

from ..config import ConfigError, dump_config
from ..core.safefile import open_append, open_bounded, read_bytes, write_bytes, write_text
from ..data.tasks import TaskError, load_task
from ..member.members import check_warm_start
from ..model.checkpoint import latest_checkpoint
from ..report.metrics import MAX_LOG_BYTES
from ..run.preflight import check_before_launch
from ..run.rundir import RunLock
from .aggregate import aggregate
from .config import StudyConfig, StudyError, registration_files
from .plan import Group, Run, check_reuse, launch_times, plan, runs_under_other_code
from .report import write_outputs

log = logging.getLogger("ftis_engine")


UNKNOWN = "unknown"


def code_version(root: pathlib.Path | None = None) -> dict:
    """The code a study runs: {"commit": HEAD of the git checkout this package is in (UNKNOWN outside one, as
    an installed package), "dirty": whether tracked files differ from it or files git does not ignore were added
    (None when unknown): then the commit does not pin the code}. root: the checkout (default: this package's)."""
    root = (root or pathlib.Path(__file__).resolve().parents[2]).resolve()
    unknown = {"commit": UNKNOWN, "dirty": None}

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or pathlib.Path(top).resolve() != root:  # not a checkout, or one this package is only inside
        return unknown
    head, status = git("rev-parse", "HEAD"), git("status", "--porcelain")
    if head is None or status is None:
        return unknown
    return {"commit": head, "dirty": bool(status)}


def study_dir(run: Run) -> pathlib.Path:
    """The study's output directory that holds the run's files (configs/<group>/seed-<s>.yaml is under it): the
    root nothing the study writes leaves by a link (safefile)."""
    return run.config_path.parents[2]


def record_launch(run: Run, code: dict) -> None:
    """Append this launch to the run's code record (plan.Run.code_path): the code version and when it started
    (UTC; summary.json's `launches`)."""
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    with open_append(run.code_path, study_dir(run)) as f:
        f.write(json.dumps({"commit": code["commit"], "dirty": code["dirty"], "started": started}) + "\n")


def check_registered(paths: list[pathlib.Path], refuse: bool = True) -> list[dict]:
    """A study's pre-registration must be committed before its runs start: each file that holds it (its config, the
    file its `preregistration` names) that lies in a git checkout must be tracked and without changes git has not
    committed (staged or not: `git diff --quiet HEAD` on it); else StudyError in one line naming the file. A symbolic
    link is judged by the file it points to, in that file's checkout. Returns, per file, its last commit and that
    commit's time ({"file", "commit", "committed"}; None outside a checkout, or not committed when `refuse` is False:
    a report recomputed from records still says when the registration was committed)."""
    out = []
    for given in paths:
        path = given.resolve()
        folder = path.parent

        def git(*args: str) -> subprocess.CompletedProcess | None:
            try:
                return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                return None

        inside = git("rev-parse", "--is-inside-work-tree")
        if inside is None or inside.returncode != 0 or inside.stdout.strip() != "true":
            out.append({"file": str(given), "commit": None, "committed": None})
            continue
        tracked = git("ls-files", "--error-unmatch", "--", path.name)
        if refuse and (tracked is None or tracked.returncode != 0):
            raise StudyError(f"{given}: the study's pre-registration is not committed (git does not track this "
                             "file); commit it before the study starts")
        changed = git("diff", "--quiet", "HEAD", "--", path.name)
        if refuse and (changed is None or changed.returncode != 0):
            raise StudyError(f"{given}: the study's pre-registration has changes git has not committed; commit them "
                             "before the study starts")
        last = git("log", "-1", "--format=%H %cI", "--", path.name)
        commit, _, committed = (last.stdout.strip() if last is not None and last.returncode == 0 else "").partition(" ")
        out.append({"file": str(given), "commit": commit or None, "committed": committed or None})
    return out


MAX_KEPT_FILE_BYTES = 16 << 20  # a run's config.yaml and final_eval.json, kept beside its records: kilobytes
MAX_LOG_TAIL_BYTES = 1 << 20  # the end of a run's log, where its last error line is


def keep_records(runs: list[Run]) -> list[pathlib.Path]:
    """Each finished run's metrics.jsonl at its record_path in the study's directory (gzip-compressed without a time
    stamp, so the same records give the same bytes; or, records: folders, as it is with the run's config.yaml and
    final_eval.json beside it), each file written again only when it changed, atomically. Returns the files
    written."""
    written = []
    for run in runs:
        if not run.finished:
            continue
        raw = read_bytes(run.run_dir / "metrics.jsonl", MAX_LOG_BYTES, "a run's metrics.jsonl")  # bounded
        files = {run.record_path: gzip.compress(raw, mtime=0) if run.records == "gzip" else raw}
        if run.records == "folders":
            for name in ("config.yaml", "final_eval.json"):
                files[run.record_path.with_name(name)] = read_bytes(run.run_dir / name, MAX_KEPT_FILE_BYTES,
                                                                    f"a run's {name}")
        # the metrics last: a record_path that exists marks the run done (Run.kept)
        for path, data in sorted(files.items(), key=lambda item: item[0] == run.record_path):
            if (path.is_file() and not path.is_symlink() and path.stat().st_size == len(data)
                    and path.read_bytes() == data):  # read only when it is as large as what would replace it
                continue
            written.append(write_bytes(path, data, study_dir(run)))
    return written


def commit_records(run: Run, paths: list[pathlib.Path], attempts: int = 20) -> bool:
    """git commit `paths` (a finished run's kept records and code record) and nothing else, in the checkout that
    holds them; retried while another git command holds the index (a person committing beside the study). Returns
    whether a commit was made; a failure is logged, never raised: the records stay on disk for the next try."""
    if not paths:
        return False
    folder = paths[0].parent
    names = [str(p.resolve()) for p in paths]
    message = (f"study {run.config_path.parents[2].name}: the records of {run.group} seed {run.seed} "
               f"({len(paths)} files), committed as the run finished")
    for attempt in range(attempts):
        added = subprocess.run(["git", "add", "--", *names], cwd=folder, capture_output=True, text=True)
        done = added if added.returncode != 0 else subprocess.run(
            ["git", "commit", "-q", "-m", message, "--", *names], cwd=folder, capture_output=True, text=True)
        if done.returncode == 0:
            return True
        if "index.lock" not in done.stderr:
            break
        time.sleep(min(30.0, 0.5 * 2 ** attempt))
    log.warning("the records of %s seed %s were kept but not committed: %s", run.group, run.seed,
                " ".join(done.stderr.split())[:300])
    return False


class Launcher:
    """Starts each run's train process and can stop them all: a study stopped by Ctrl-C or SIGTERM starts no
    further run and interrupts the ones in flight (they exit as a Ctrl-C'd run does, keeping their newest
    checkpoint), so none is left running orphaned, holding its run directory. Each launch's code version is
    recorded beside the run's config (record_launch)."""

    GRACE_S = 60.0  # an interrupted run's time to stop cleanly before it is killed

    def __init__(self, env: dict[str, str], code: dict | None = None):
        self.env = env
        self.code = code or {"commit": UNKNOWN, "dirty": None}
        self._stopping = threading.Event()
        self._running: set[subprocess.Popen] = set()
        self._lock = threading.Lock()

    def __call__(self, run: Run) -> int | None:
        """Run one train process to completion (resuming from its newest checkpoint when it has one); its output
        goes to the run's log. Returns its exit code, or None when the study was stopped before it started."""
        if self._stopping.is_set():  # a run the stopped study never starts leaves no config behind
            return None
        write_text(run.config_path, dump_config(run.config), study_dir(run))
        command = [sys.executable, "-m", "ftis_engine", "train", "--config", str(run.config_path)]
        if latest_checkpoint(run.run_dir) is not None:
            command.append("--resume")
        with open_append(run.log_path, study_dir(run)) as log, self._lock:
            if self._stopping.is_set():
                return None
            record_launch(run, self.code)
            log.write(f"$ {' '.join(command)}\n")
            log.flush()
            # its own process group: the terminal's Ctrl-C reaches the study, which stops its runs itself
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                       start_new_session=True)
            self._running.add(process)
        try:
            return process.wait()
        finally:
            with self._lock:
                self._running.discard(process)

    def stop(self) -> None:
        """No further run starts; every run in flight gets SIGTERM (a run stops on it as on Ctrl-C: its handler is
        installed whatever the run inherited, where SIGINT may be ignored, as in a background job of a script),
        then SIGKILL after GRACE_S."""
        with self._lock:
            self._stopping.set()
            running = list(self._running)
        for process in running:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.GRACE_S
        for process in running:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def check_runs(study: StudyConfig, groups: list[Group], todo: list[Run]) -> None:
    """What a train run checks before it writes anything (models, tokenizers, generators, the backend, the task and
    its data, warm-start styles), once per group with runs to do, before any run is launched: a study whose runs
    would all fail on a bad model path stops with one line instead. Then every figure's datasets must be eval sets
    of its groups (a figure of none would be blank)."""
    checked: dict[str, list[str]] = {}
    evals: dict[str, list[str]] = {}
    for group in groups:
        config = group.config
        key = json.dumps(config.model_dump(mode="json", include={"members", "data", "eval", "train"}), sort_keys=True)
        if key not in checked:
            try:
                if any(run in todo for run in group.runs):
                    check_before_launch(config, distributed=False)
                task = load_task(config.data, config.seed, config.eval.datasets, eval_reward=config.eval.reward)
                for i, member in enumerate(config.members):
                    check_warm_start(i, member, task)
            except (ConfigError, TaskError) as exc:
                # from None: a one-line error for the user; the cause adds nothing to it
                raise StudyError(f"groups ({group.name}): {exc}") from None
            checked[key] = list(task.evals)
        evals[group.name] = checked[key]
    for f, figure in enumerate(study.figures):
        known = {d for g in figure.groups if g in evals for d in evals[g]}
        unknown = [d for d in figure.datasets or [] if d not in known]
        if unknown and all(g in evals for g in figure.groups):
            raise StudyError(f"figures.{f}.datasets: {unknown[0]!r} is an eval set of none of its groups "
                             f"({', '.join(sorted(known))})")


def run_study(study: StudyConfig, output_dir: pathlib.Path, *, quick: bool = False, jobs: int | None = None,
              command: str = "", progress: bool = True, only: list[str] | None = None,
              aggregate_only: bool = False) -> dict:
    """Plan, run what is not finished (`jobs` at once), aggregate; returns the summary. only: those groups and
    the groups they are paired with (--groups). aggregate_only: run nothing, aggregate the runs finished or kept in
    records/ (--aggregate-only). Raises StudyError on a bad config (or a pre-registration with changes git has not
    committed: check_registered) and RuntimeError naming the failed runs' logs (after the others have finished)."""
    # a quick study is the pipeline's smoke test, never a result, and --aggregate-only starts no run: either may go
    # on while a registration is being written
    registered = [] if quick else check_registered(registration_files(study), refuse=not aggregate_only)
    groups = plan(study, output_dir, quick, only)
    runs = [run for group in groups for run in group.runs]
    for run in runs:
        check_reuse(run)
    code = code_version()
    other = runs_under_other_code(runs, code["commit"], kept=aggregate_only)
    if other:  # a warning, not a refusal: the config is the same, and a run's code is recorded only since this
        shown = ", ".join(f"{o['group']} seed {o['seed']} ({'/'.join(c[:12] for c in o['commits'])})"
                          for o in other[:3])
        log.warning("%d of the study's %d runs to reuse or resume were made under other code than this commit "
                    "(%s) or under code not recorded: %s%s. Their numbers will mix code versions (summary.json and "
                    "report.md name them); delete their run directories to redo them on this code.", len(other),
                    len(runs), code["commit"][:12], shown, ", ..." if len(other) > 3 else "")
    if aggregate_only and not any(run.metrics_source is not None for run in runs):
        raise StudyError(f"--aggregate-only: {output_dir} holds no finished run of this study and no records/ of one")
    # seed by seed: a study stopped half way has every group at the same number of seeds
    todo = [run for nth in itertools.zip_longest(*(group.runs for group in groups)) for run in nth
            if run is not None and not run.finished and not run.kept and not aggregate_only]
    if not aggregate_only:
        check_runs(study, groups, todo)
    # one study at a time in a directory: a second one would delete and rerun the first one's runs under it
    with RunLock(output_dir, kind="study"):
        return _run(study, groups, runs, todo, output_dir, quick, jobs, command, progress, only,
                    {"code": code, "other_code": other, "registered": registered})


def _run(study: StudyConfig, groups: list[Group], runs: list[Run], todo: list[Run], output_dir: pathlib.Path,
         quick: bool, jobs: int | None, command: str, progress: bool, only: list[str] | None = None,
         code: dict | None = None) -> dict:
    """code: {"code": code_version(), "other_code": runs_under_other_code(...), "registered": check_registered(...)},
    into summary.json (`registered` under `preregistration`), with each run's launch times (`launches`) and, for a
    study with a pre-registration, its hypotheses' verdicts (`verdicts`, verdicts.md)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    code = code or {"code": {"commit": UNKNOWN, "dirty": None}, "other_code": []}
    launcher = Launcher(dict(os.environ), code["code"])
    failed: list[Run] = []
    started = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=not progress) as bar:
        task = bar.add_task(f"study {study.study}: runs", total=len(runs), completed=len(runs) - len(todo))
        with ThreadPoolExecutor(max_workers=jobs or study.jobs) as pool:
            futures = {pool.submit(launcher, run): run for run in todo}
            finished = False
            try:
                for future in as_completed(futures):
                    run, exit_code = futures[future], future.result()
                    if exit_code != 0 or not run.finished:
                        failed.append(run)
                        bar.console.print(f"[red]failed[/red] {run.group} seed {run.seed} (exit {exit_code}): "
                                          f"{run.log_path}")
                    else:  # kept (and committed) now: a study cut later keeps this run
                        written = keep_records([run])
                        if study.commit_records and not quick:
                            commit_records(run, [p for p in (*written, run.code_path, run.config_path)
                                                 if p.is_file()])
                    bar.advance(task)
                finished = True
            finally:  # Ctrl-C or SIGTERM (the CLI turns it into KeyboardInterrupt), or a launch that raised: stop
                if not finished:  # every run, before the pool waits for them
                    launcher.stop()
    keep_records(runs)
    summary = aggregate(study, groups, quick=quick, command=command)
    summary.update({key: value for key, value in code.items() if key != "registered"})
    summary["launches"] = [{"group": run.group, "seed": run.seed, "started": times} for run in runs
                           if (times := launch_times(run))]
    if study.preregistration is not None:
        from .verdicts import judge  # here, not at the top: `python -m ftis_engine.study.verdicts` runs that module

        summary["preregistration"] = {"registered": code.get("registered") or [],
                                      "transcribed": study.preregistration.transcribed}
        summary["verdicts"] = judge(study.preregistration, [summary])
    if only:
        summary["only"] = list(only)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    write_outputs(study, groups, summary, output_dir)
    if failed:
        said = last_error(failed[0].log_path)
        raise RuntimeError(f"{len(failed)} of {len(runs)} runs failed ({failed[0].group} seed {failed[0].seed}"
                           + (f": {said}" if said else "") + f"); see {failed[0].log_path}")
    return summary


def last_error(log_path: pathlib.Path) -> str | None:
    """The one-line error a failed run printed last ("error: ..."), without its prefix; None when it printed none."""
    try:
        with open_bounded(log_path, 1 << 62, "a run's log") as log:  # a regular file; its end alone is read
            log.seek(max(0, os.fstat(log.fileno()).st_size - MAX_LOG_TAIL_BYTES))
            lines = log.read(MAX_LOG_TAIL_BYTES).decode("utf-8", errors="replace").splitlines()
    except OSError:
        return None
    errors = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
    return errors[-1] if errors else None
