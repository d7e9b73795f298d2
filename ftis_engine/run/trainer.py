"""One start-up sequence for every entry point: `train` in one process, `train --join`, `eval`, and each rank that
`--nproc` or torchrun starts (launch.run_worker) build the same way and run the same way.

    connection = connect_local(config) or connect(config, rank, world, local_rank, join)    wiring.py
    trainer = build(config, Start(run_dir, resume=...), connection)                         session.open_run
    trainer.run()                                   train, sample (a sampler rank) or evaluate (Start.checkpoint)

What the process is (a learner, a member's further shard, a sampler, an open swarm's member, every member in one
process) is its role (layout.Role), computed once as it connects; how a failure ends it is the one table in
exits.py, which each entry point runs this inside.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from ..config import RunConfig
from .loop import evaluate_all, train
from .samplers import run_sampler
from .session import Start, Swarm, open_run
from .wiring import Connection

__all__ = ["Start", "Trainer", "build"]


def _print_record(record: dict) -> None:
    print(json.dumps(record), flush=True)


class Trainer:
    """A run opened in this process, and what its role does with it."""

    def __init__(self, swarm: Swarm, start_step: int):
        self.swarm = swarm
        self.start_step = start_step  # the step it starts after (eval: the checkpoint's)

    def run(self, emit: Callable[[dict], None] = _print_record) -> list[dict]:
        """Train (a learner: every member here, or one rank's), sample (a sampler rank) or evaluate the checkpoint
        (eval: rank 0 emits every rank's records, one JSON line each, before its engines close). Returns the final
        (or eval) records. The members' generators are closed however it ends (a vLLM engine holds a GPU): here
        for an eval, by run.train and samplers.run_sampler for what they run."""
        swarm, role = self.swarm, self.swarm.role
        if role.evaluating:
            try:
                records = swarm.exchange.collectives.gather_records(evaluate_all(swarm, self.start_step))
                if role.writes_run:
                    for record in records:
                        emit(record)
            finally:
                swarm.close()
            return records
        if role.sampler is not None:
            run_sampler(swarm, self.start_step)
            return []
        return train(swarm, self.start_step)


def build(config: RunConfig, start: Start, connection: Connection | None = None) -> Trainer:
    """Open the run in this process (session.open_run: checks, the start's collectives, members built and
    restored, schedule, receivers; an open swarm's transport given what it announces) for its role."""
    return Trainer(*open_run(config, start, connection))
