"""A learner's run: the step loop, with evaluation (greedy pass@1 at step 0, every eval.every steps and at the end)
and checkpoints (every checkpoint.every steps) around it. One step is step.run_step; a run is opened by
session.open_run (train, a torchrun rank, an elastic worker alike) and run by trainer.Learner. Where the records go
(rank 0 of a synchronous world, or each rank its own) is records.py's strategy, chosen once from the role.

In swarm.mode async across processes the ranks never synchronise after the start: each logs its own records,
stages its own checkpoint (the last member to stage step N completes it) and leaves when done.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from .evaluate import evaluate_all
from .records import Records, records_for
from .session import Swarm
from .step import run_step

log = logging.getLogger("ftis_engine")


def train(swarm: Swarm, start_step: int = 0, close: Callable[[], None] = lambda: None) -> list[dict]:
    """Run the steps after `start_step` (0: a fresh run; else the restored checkpoint's step); returns the final
    eval records. Rank 0 writes config.yaml, metrics.jsonl, TensorBoard events, plots and final_eval.json (each
    rank its own records when they never synchronise). close: the Trainer's (the generators), run once the steps
    are done and before the run is marked finished: a close that fails leaves no final_eval.json, which a study takes
    for a finished run."""
    with records_for(swarm) as records:  # its logger closed (flushed) before the end's figures read the log
        final = _steps(swarm, start_step, records)
    close()
    records.finish(final)
    return final


def _steps(swarm: Swarm, start_step: int, records: Records) -> list[dict]:
    """train's start (the run directory's files, the exchange, the log) and its step loop; the final records."""
    config = swarm.config
    records.prepare(start_step)
    swarm.exchange.collectives.barrier()
    swarm.exchange.start(swarm.schedule.parcel_limit, start_step)  # once every rank has opened the run
    records.open(start_step)
    steps = config.train.steps
    final: list[dict] = []
    with swarm.progress:
        if start_step == 0 and config.eval.at_start:
            final = records.log(0, evaluate_all(swarm, 0))
        if start_step < steps:
            records.legend()
        started = time.perf_counter()
        peer_sequences = {m.name: 0 for m in swarm.members}
        for step in range(start_step + 1, steps + 1):
            step_start = time.perf_counter()
            step_records = run_step(swarm, step)
            for r in step_records:
                if r["kind"] == "train":
                    peer_sequences[r["member"]] += r["peer_sequences"]
            last = step == steps
            evaluating = last or (config.eval.every and step % config.eval.every == 0)
            if evaluating:
                step_records += evaluate_all(swarm, step)
            done = step - start_step
            timing = (time.perf_counter() - step_start, (time.perf_counter() - started) / done * (steps - step))
            logged = records.log(step, step_records, timing)
            if evaluating:
                final = [r for r in logged if r["kind"] == "eval"]
            if last or (config.checkpoint.every and step % config.checkpoint.every == 0):
                records.checkpoint(step)
        if start_step < steps and records.reports:
            warn_if_alone(swarm, peer_sequences, steps - start_step)
        if start_step >= steps:  # nothing left to train: report the finished run's accuracy
            final = records.gather(evaluate_all(swarm, steps))
        swarm.exchange.finish()  # async: say DONE to the peers, drain their late parcels
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
