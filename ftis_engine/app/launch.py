"""Multi-process runs over torch.distributed: one process per member rank and sampler (layout.py).

`ftis-engine train --nproc N` starts N local workers through torch.distributed's elastic agent (what torchrun
uses); the same config runs under `torchrun` too (single- or multi-node), the ranks coming from the environment.
A worker that fails ends the others (the agent stops them); with swarm.max_restarts > 0 the agent restarts every
rank and each resumes from the newest complete checkpoint that all ranks have.

Each worker starts as a fresh interpreter, as torchrun starts them (the elastic agent's `spawn`). Until 2026-11-28
workers without CUDA were forked from a fork server that had imported them once (about 1.7 s saved a 2-process launch,
benchmarks/results/launch_start.md); restarting or stopping one needs CPython's private fork-server state, so it went
(issue 69).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import sys
import tempfile
import uuid

from ..config import ConfigError, RunConfig, validate_config
from ..core import safefile
from ..core.env import set_env
from ..topology.layout import check_processes, describe_layout, describe_role, process_roles
from .exits import CONFIG, FAILED, INTERRUPTED, Outcome, ending

log = logging.getLogger("ftis_engine.app.launch")

# A failure a restart cannot mend (exits.Outcome.final: a config error, a divergence: a resume replays the same
# steps to the same NaN): the worker writes its exit code to this file (set by the launcher), and the agent's
# restarts, which cannot tell exit codes apart, end at once with it instead of resuming and failing again
# (swarm.max_restarts times); the launcher returns it (the worker printed its line).
FINAL_EXIT_ENV = "FTIS_FINAL_EXIT_FILE"
MAX_EXIT_FILE_BYTES = 64  # an exit code: a few digits


def any_rank(collectives, flag: bool) -> bool:
    """Whether `flag` holds on any rank of the world (a collective: every rank calls it)."""
    return any(collectives.all_gather_object(bool(flag)))


def launch_distributed(config: RunConfig, run_dir: pathlib.Path, resume: bool, nproc: int,
                       evaluate: pathlib.Path | None = None, join: str | None = None) -> int:
    """Run the swarm in several processes (or, with `evaluate`, greedy pass@1 of that checkpoint: rank 0 prints the
    records as JSON lines); returns the exit code for the command line."""
    target = None if evaluate is None else str(evaluate)
    if under_torchrun():  # launched by torchrun: this process is one rank
        check_rank_environment(os.environ)
        world = int(os.environ["WORLD_SIZE"])
        check_processes(config, world, evaluating=evaluate is not None, given=f"WORLD_SIZE={world}")
        return run_worker(config.model_dump(mode="json"), str(run_dir), resume, target, join)
    check_processes(config, nproc, evaluating=evaluate is not None, given=f"--nproc {nproc}")
    from ..run.preflight import check_before_launch
    from ..run.rundir import RunLock, check_run_dir

    if evaluate is not None:  # reads the checkpoint, writes nothing: no lock, no run directory checks
        check_before_launch(config, distributed=True)
        return _launch(config, run_dir, resume, nproc, target)
    with RunLock(run_dir):  # held by this launcher for all its ranks and restarts
        check_run_dir(run_dir, config, resume)
        check_before_launch(config, distributed=True)  # bad models, tokenizers, generators: before any process
        print(f"run directory: {run_dir} (starting {nproc} processes...)", flush=True)
        if any(m.ranks > 1 or m.samplers for m in config.members):
            print(f"rank layout:\n{describe_layout(config)}", flush=True)
        return _launch(config, run_dir, resume, nproc, join=join)


def under_torchrun(env=os.environ) -> bool:
    """Whether this process is one rank that torchrun started (RANK and WORLD_SIZE set; check_rank_environment
    checks the rest of what torchrun sets)."""
    return "RANK" in env and "WORLD_SIZE" in env


def check_rank_environment(env) -> None:
    """RANK and WORLD_SIZE say this process is one rank of a torchrun launch: the rest of what torchrun sets must
    be there and make sense, or the process group fails deep inside torch (KeyError: 'MASTER_ADDR')."""
    def number(name: str, low: int, high: int | None = None) -> int:
        try:
            value = int(env[name])
        except (KeyError, ValueError):
            # from None: a one-line error for the user; the cause adds nothing to it
            raise ConfigError(f"{name}: {env.get(name)!r} is not a whole number (RANK and WORLD_SIZE are set, so this "
                              "process runs as one rank of torchrun; unset them to run alone)") from None
        if value < low or (high is not None and value >= high):
            raise ConfigError(f"{name}: {value} is outside {low}..{'' if high is None else high - 1}")
        return value

    world = number("WORLD_SIZE", 1)
    number("RANK", 0, world)
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
    if missing:
        raise ConfigError(f"{missing[0]}: not set, but RANK and WORLD_SIZE are (a torchrun launch sets all four): "
                          "start the ranks with torchrun, or unset RANK and WORLD_SIZE to run in one process "
                          "(--nproc N starts N ranks itself)")
    number("MASTER_PORT", 1, 65536)


def _launch(config: RunConfig, run_dir: pathlib.Path, resume: bool, nproc: int, evaluate: str | None = None,
            join: str | None = None) -> int:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The agent logs every worker failure with a traceback; the workers' own one-line errors and our summary say it.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    launch = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"ftis-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=config.swarm.max_restarts,
        monitor_interval=0.2, start_method="spawn", logs_specs=DefaultLogsSpecs(),
    )
    # see FINAL_EXIT_ENV; in a folder of its own (mkdtemp: this user's alone), never a name in the shared /tmp
    # where another user could plant a link for a rank to write through
    final = pathlib.Path(tempfile.mkdtemp(prefix=f"{launch.run_id}.")) / "final-exit"
    try:
        with set_env(**{FINAL_EXIT_ENV: str(final)}):  # the workers inherit it; after the launch it is as it was
            elastic_launch(launch, run_worker)(config.model_dump(mode="json"), str(run_dir), resume, evaluate, join)
    except (SignalException, KeyboardInterrupt):  # Ctrl-C or SIGTERM: the agent stopped its workers
        return INTERRUPTED
    except ChildFailedError as exc:
        failures = exc.failures
        if any(f.exitcode == CONFIG for f in failures.values()):
            return CONFIG  # the worker already printed its one-line error
        code = _final_code(final)
        if code is not None:
            return code  # a failure no restart mends: likewise
        roles = process_roles(config)
        parts = []
        for rank, failure in sorted(failures.items()):
            how = f"signal {-failure.exitcode}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
            role = roles[rank] if rank < len(roles) else None
            who = f"rank {rank}" if role is None else describe_role(config, role)
            parts.append(f"rank {rank} ({who}) failed with {how}")
        restarts = config.swarm.max_restarts
        tried = f" after {restarts} restart(s)" if restarts else ""
        sys.stderr.write(f"error: swarm stopped{tried}: {'; '.join(parts)} (a rank that lost its peer says so above); "
                         "the newest complete checkpoint is intact, continue with --resume\n")
        return FAILED
    finally:
        final.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            final.parent.rmdir()
    return 0


def run_worker(config_data: dict, run_dir: str, resume: bool, evaluate: str | None = None,
               join: str | None = None) -> int:
    """One rank: join the process group, open the run and run it (trainer.run, as a command in one process); or,
    with `evaluate` (a checkpoint), evaluate it and let rank 0 print every rank's records. Its failures end it by the
    one table (exits.py): a config error prints one line (an error all ranks found alike: rank 0 alone) and exits 2.
    join: the open swarm's coordinator (a member on several ranks: its leader holds the exchange,
    openswarm/member.py)."""
    from ..report.progress import quiet_libraries
    from ..run.preflight import check_placement
    from ..run.trainer import Start, run
    from ..run.wiring import connect

    quiet_libraries()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    final = os.environ.get(FINAL_EXIT_ENV)
    if restarted and final:
        code = _final_code(final)
        if code is not None:
            os._exit(code)  # a failure no restart mends happened: its rank said what, once

    def stop(told: Outcome) -> None:
        if told.final and final:
            with contextlib.suppress(OSError):
                safefile.write_text(pathlib.Path(final), str(told.code))  # whole, never through a link
        os._exit(told.code)  # no teardown: the process group may be waiting on a peer that is gone

    settled = (lambda: _final_code(final)) if final else None  # a peer's final code: a lost peer's end is the same
    with ending(stop, rank=rank, joining=config_data["members"][0]["name"], settled=settled):
        config = validate_config(config_data)  # its process count was checked before it started (launch_distributed)
        check_placement(config)  # under torchrun nothing checked it before the processes started
        connection = connect(config, rank, world, local_rank, join, evaluating=evaluate is not None)
        collectives = connection.exchange.collectives
        if evaluate is not None:
            start = Start(pathlib.Path(evaluate), checkpoint=pathlib.Path(evaluate))
        else:
            # a restart resumes by design; a first start must not write into another run. Every rank takes the
            # same view: each node's agent counts its own restarts (one whose workers restarted because another
            # node's failed counts 0), and ranks that disagree would run open_run's collectives apart
            start = Start(pathlib.Path(run_dir), resume=resume, restarted=any_rank(collectives, restarted))
        run(config, start, connection)  # the one start-up (trainer.run): opened, run, its generators closed
    collectives.close()
    return 0


def _final_code(path: str | pathlib.Path) -> int | None:
    """The exit code a rank wrote to the final-exit file (FINAL_EXIT_ENV), or None: none written, or a file that is
    no exit code (read bounded, MAX_EXIT_FILE_BYTES: said in a warning naming it)."""
    try:
        return int(safefile.read_bytes(pathlib.Path(path), MAX_EXIT_FILE_BYTES, "an exit-code file"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("%s: not an exit code (%s); ignored", path, getattr(exc, "strerror", None) or exc)
        return None
