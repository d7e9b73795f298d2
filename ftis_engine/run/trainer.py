"""One start-up sequence for every entry point: `train` in one process, `train --join`, `eval`, and each rank that
`--nproc` or torchrun starts (app.launch.run_worker) open and run a run the same way:

    connection = connect_local(config) or connect(config, rank, world, local_rank, join)    wiring.py
    records = run(config, Start(run_dir, resume=...), connection)

which is

    with build(config, start, connection) as trainer:    session.open_run, then the role's Trainer
        trainer.run()                                    Learner, Sampler or Evaluator

What the process is (a learner, a member's further shard, a sampler, an open swarm's member, every member in one
process) is its role (layout.Role), computed once as it connects; build chooses the Trainer for it once, and the
Trainer is the one place its generators close (a vLLM engine holds a GPU), however the run ends. How a failure ends
the process is the one table in app/exits.py, which each entry point runs this inside.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from ..config import RunConfig
from .evaluate import evaluate_all
from .loop import train
from .samplers import run_sampler
from .session import Start, Swarm, open_run
from .wiring import Connection

__all__ = ["Evaluator", "Learner", "Sampler", "Start", "Trainer", "run"]


def print_record(record: dict) -> None:
    print(json.dumps(record), flush=True)


class Trainer:
    """A run opened in this process, and what its role does with it (run). A context manager: the members'
    generators close when it ends, however it ends (close: the one place they do)."""

    def __init__(self, swarm: Swarm, start_step: int):
        self.swarm = swarm
        self.start_step = start_step  # the step it starts after (eval: the checkpoint's)
        self.closed = False

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.swarm.close()

    def run(self, emit: Callable[[dict], None] = print_record) -> list[dict]:
        """The role's work; returns its final (or eval) records."""
        raise NotImplementedError


class Learner(Trainer):
    """Trains its members (every member here, or one rank's share of one), run.loop.train."""

    def run(self, emit: Callable[[dict], None] = print_record) -> list[dict]:
        return train(self.swarm, self.start_step, close=self.close)  # closed before final_eval.json is written


class Sampler(Trainer):
    """Generates for its member's learner until it finishes (members.N.samplers), samplers.run_sampler."""

    def run(self, emit: Callable[[dict], None] = print_record) -> list[dict]:
        run_sampler(self.swarm, self.start_step)
        return []


class Evaluator(Trainer):
    """Greedy pass@1 of the checkpoint it opened (eval): rank 0 emits every rank's records, one JSON line each,
    before the engines close."""

    def run(self, emit: Callable[[dict], None] = print_record) -> list[dict]:
        swarm = self.swarm
        records = swarm.exchange.collectives.gather_records(evaluate_all(swarm, self.start_step))
        if swarm.role.writes_run:
            for record in records:
                emit(record)
        return records


def build(config: RunConfig, start: Start, connection: Connection | None = None) -> Trainer:
    """Open the run in this process (session.open_run: checks, the start's collectives, members built and
    restored, schedule, receivers; an open swarm's transport given what it announces) and the Trainer of its role,
    chosen once. Use it in a `with` (as run() does): its generators close when the block ends."""
    swarm, start_step = open_run(config, start, connection)
    role = swarm.role
    kind = Evaluator if role.evaluating else Sampler if role.sampler is not None else Learner
    return kind(swarm, start_step)


def run(config: RunConfig, start: Start, connection: Connection | None = None,
        emit: Callable[[dict], None] = print_record) -> list[dict]:
    """Open the run, run it for this process's role and close its generators, however it ends: what every entry
    point calls."""
    with build(config, start, connection) as trainer:
        return trainer.run(emit)
