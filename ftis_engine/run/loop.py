"""A run: the step loop, with evaluation (greedy pass@1 at step 0, every eval.every steps and at the end) and
checkpoints (every checkpoint.every steps) around it. One step is step.run_step; a run is opened by
session.open_run (train, eval, a torchrun rank, an elastic worker alike).

In swarm.mode async across processes the ranks never synchronise after the start: each logs its own records,
stages its own checkpoint (the last member to stage step N completes it) and leaves when done.
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
from ..exchange.adversary import measured_payloads
from ..model.checkpoint import clear_staging, finalize_checkpoint, finalize_when_staged, stage_members
from ..report.metrics import MetricsLogger, eval_record, resume_records, return_freed_memory, truncate_metrics
from ..report.plots import NothingToPlot, make_plots
from ..report.progress import LEGEND, summary_line
from ..report.trackers import open_trackers
from .evaluate import evaluate_questions
from .rundir import RunDirError, read_data_record, record_data
from .session import Swarm
from .step import run_step

log = logging.getLogger("ftis_engine")

# ----------------------------------------------------------------------------------------------- eval, checkpoint


def evaluate_all(swarm: Swarm, step: int) -> list[dict]:
    """Greedy pass@1 of every local member on every eval set."""
    cfg = swarm.config.eval
    max_new = cfg.max_new_tokens or swarm.config.rollout.max_new_tokens
    records = []
    payloads = measured_payloads(swarm.config)
    for member in swarm.members:  # a member on several ranks: every shard evaluates a share, the leader reports
        with member.generator.awake():
            for name, examples in swarm.task.evals.items():
                examples = examples[: cfg.max_samples] if cfg.max_samples else examples
                share = len(examples) if member.shard is None else len(member.shard.share(len(examples)))
                bar = swarm.progress.start(f"{member.name}: eval {name}", share)
                accuracy, attacked, correct = evaluate_questions(member, swarm.task, examples, max_new,
                                                                 on_batch=lambda k: swarm.progress.advance(bar, k),
                                                                 payloads=payloads)
                swarm.progress.finish(bar)
                record = eval_record(step, member.name, name, accuracy, len(examples), correct)
                if attacked is not None:  # the share of its greedy completions carrying an attacker's payload
                    record["attack_success"], record["attack_success_by"] = attacked
                records.append(record)
                return_freed_memory()  # the greedy passes' KV caches
    return records if swarm.role.reports else []


def save_checkpoint(swarm: Swarm, step: int) -> None:
    cfg = swarm.config.checkpoint
    state = {"members": swarm.names, "config": swarm.config.model_dump(mode="json")}  # resume's record of the run
    # a receiver's defenses that keep state across steps (the claims monitor's tests, the length guard's own
    # lengths) go on after a resume
    extras = {m.name: {file: kept.target.state() for file, kept in swarm.receivers[m.index].kept_states().items()}
              for m in swarm.members if m.index in swarm.receivers}
    stage_members(swarm.run_dir, step, swarm.members, cfg.save_optimizer, extras)
    if swarm.role.independent:  # no barrier: whoever stages step N last completes it
        finalize_when_staged(swarm.run_dir, step, state, cfg.keep_last)
        return
    swarm.exchange.collectives.barrier()  # every rank has staged its members
    if swarm.role.writes_run:
        finalize_checkpoint(swarm.run_dir, step, state, cfg.keep_last)
    swarm.exchange.collectives.barrier()


# ----------------------------------------------------------------------------------------------- the run


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


def train(swarm: Swarm, start_step: int = 0) -> list[dict]:
    """Run the steps after `start_step` (0: a fresh run; else the restored checkpoint's step); returns the final
    eval records. Rank 0 writes config.yaml, metrics.jsonl, TensorBoard events, plots and final_eval.json. The
    members' generators are closed however it ends, its start included (a coordinator that never answers, a peer
    lost at the first barrier): a vLLM engine holds a GPU."""
    try:
        final = _steps(swarm, start_step)
    finally:
        swarm.close()
    run_dir = swarm.run_dir
    if swarm.role.independent and swarm.role.reports:
        write_final_shared(run_dir, final)
    elif swarm.role.writes_run:
        end_plots(run_dir)
        # whole or not at all, never through a link: a study takes the file's presence for a finished run
        safefile.write_text(run_dir / "final_eval.json", json.dumps(final, indent=2), root=run_dir)
    return final


def end_plots(run_dir: pathlib.Path) -> None:
    """The run's figures as it ends; a figure that cannot be drawn or written (a link planted where it goes,
    refused by safefile) is a warning: the run's records and final_eval.json matter more than its pictures."""
    try:
        make_plots(run_dir)
    except NothingToPlot:  # a rank that logged no record yet has nothing to draw
        pass
    except OSError as exc:
        log.warning("the run's figures were not written (%s); `ftis-engine plot %s` draws them", exc, run_dir)


def _steps(swarm: Swarm, start_step: int) -> list[dict]:
    """train's start (the run directory's files, the exchange, the log) and its step loop; the final records."""
    config, run_dir = swarm.config, swarm.run_dir
    if swarm.role.writes_run:
        run_dir.mkdir(parents=True, exist_ok=True)
        safefile.write_text(run_dir / "config.yaml", dump_config(config), root=run_dir)  # a Ctrl-C may land here
        record_data(run_dir, config, start_step)  # its data files' sha256 (a resume on changed data: the change)
        if start_step == 0:  # a start over a run that stopped before its first checkpoint: its logs are kept aside
            for log_file in ("metrics.jsonl", "completions.jsonl"):
                keep_aside(run_dir / log_file)
        dropped = truncate_metrics(run_dir / "metrics.jsonl", start_step if start_step else -1)  # step 0 anew
        if (run_dir / "completions.jsonl").is_file():  # its samples too: the resumed steps write them anew
            truncate_metrics(run_dir / "completions.jsonl", start_step)
        clear_staging(run_dir)
    swarm.exchange.collectives.barrier()
    swarm.exchange.start(swarm.schedule.parcel_limit, start_step)  # once every rank has opened the run
    # rank 0 writes what every rank reports (async ranks each write their own); TensorBoard forgets what the
    # truncated log dropped
    writes = swarm.role.writes_run or (swarm.role.independent and swarm.role.reports)
    logger = None
    if writes:
        # a resume that went on on changed data (--allow-data-change): every record from then on says since when
        data = read_data_record(run_dir)
        changed_at = max((c["step"] for c in data["changes"] if isinstance(c, dict) and isinstance(c.get("step"), int)),
                         default=None) if data is not None else None
        report_to = config.logging.report_to
        name = config.run_name + (f"-rank{swarm.exchange.rank}" if swarm.role.independent else "")
        trackers = open_trackers(report_to, run_dir, config.logging.project, name, config.run_name,
                                 config.model_dump(mode="json"), resume=start_step > 0)
        logger = MetricsLogger(run_dir, purge_step=start_step + 1 if start_step else None,
                               shared=swarm.role.independent,
                               tensorboard="tensorboard" in report_to, trackers=trackers,
                               tensorboard_suffix=f".rank{swarm.exchange.rank}" if swarm.role.independent else "",
                               tensorboard_subdir=f"rank{swarm.exchange.rank}" if swarm.role.independent else "",
                               marks={"data_changed_at": changed_at} if changed_at is not None else None)
    if swarm.role.writes_run and start_step:
        for record in resume_records(start_step, swarm.names, dropped):
            logger.log(record)
    steps = config.train.steps
    final: list[dict] = []
    try:
        with swarm.progress:
            if start_step == 0 and config.eval.at_start:
                final = _log(swarm, logger, 0, evaluate_all(swarm, 0))
            if swarm.role.writes_run and start_step < steps:
                swarm.progress.print(LEGEND)
            started = time.perf_counter()
            peer_sequences = {m.name: 0 for m in swarm.members}
            for step in range(start_step + 1, steps + 1):
                step_start = time.perf_counter()
                records = run_step(swarm, step)
                for r in records:
                    if r["kind"] == "train":
                        peer_sequences[r["member"]] += r["peer_sequences"]
                last = step == steps
                evaluating = last or (config.eval.every and step % config.eval.every == 0)
                if evaluating:
                    records += evaluate_all(swarm, step)
                done = step - start_step
                timing = (time.perf_counter() - step_start, (time.perf_counter() - started) / done * (steps - step))
                logged = _log(swarm, logger, step, records, timing)
                if evaluating:
                    final = [r for r in logged if r["kind"] == "eval"]
                if last or (config.checkpoint.every and step % config.checkpoint.every == 0):
                    save_checkpoint(swarm, step)
            if start_step < steps and swarm.role.reports:
                warn_if_alone(swarm, peer_sequences, steps - start_step)
            if start_step >= steps:  # nothing left to train: report the finished run's accuracy
                final = evaluate_all(swarm, steps)
                final = final if swarm.role.independent else swarm.exchange.collectives.gather_records(final)
            swarm.exchange.finish()  # async: say DONE to the peers, drain their late parcels
    finally:
        if logger is not None:
            logger.close()
    return final


def warn_if_alone(swarm: Swarm, peer_sequences: dict[str, int], steps: int) -> None:
    """A collaborating member that trained on no peer rollout in the whole run trained alone: say so, and the
    likeliest cause, rather than let a study read it as collaboration."""
    if not swarm.schedule.has_peers:  # alone, or no other member (an open swarm's member has the swarm's)
        return
    latency = swarm.config.swarm.latency
    for name, count in peer_sequences.items():
        if count:
            continue
        if len(swarm.names) < 2:  # an open swarm's member: its peers are whoever is live in the swarm
            cause = ("no peer's rollouts reached it: it was alone in the swarm, joined after the others finished, "
                     "or every peer rollout was stale, rejected, of a tokenizer it cannot load or left out by a "
                     "defense")
        elif latency.unit == "seconds" and not latency.is_zero:
            cause = f"swarm.latency ({latency.min:g}-{latency.max:g} s) is longer than the run?"
        elif not latency.is_zero and latency.min >= steps:
            cause = f"swarm.latency delays every delivery {latency.min:g} steps, the run has {steps}"
        else:
            cause = ("every peer rollout was stale, rejected, left out by a defense (defense.*), or arrived after "
                     "this member's last step")
        log.warning("%s trained on no peer rollout in its %d steps: it trained alone (%s)", name, steps, cause)


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


MAX_FINAL_EVAL_BYTES = 16 << 20  # final_eval.json: a record per member and eval set, kilobytes


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


def _log(swarm: Swarm, logger: MetricsLogger | None, step: int, records: list[dict],
         timing: tuple[float, float] | None = None) -> list[dict]:
    """Gather every rank's records (async ranks: each its own); rank 0 writes them and prints the step's summary
    line (with the step's seconds and the time left, from the mean step so far)."""
    if not swarm.role.independent:
        records = swarm.exchange.collectives.gather_records(records)
    if logger is not None:
        for record in records:
            logger.log(record)
        swarm.progress.print(summary_line(step, swarm.config.train.steps, records, *(timing or ())))
    return records
