"""ftis-engine swarm serve: the open swarm's coordinator in the foreground (the command line's other commands are in
cli.py, which adds this one)."""

from __future__ import annotations

import pathlib
import threading

import typer

from ..config import OVERRIDE_HELP as SET_HELP
from .exits import UsageFailure

swarm_app = typer.Typer(no_args_is_help=True, help="The open swarm: members as independent jobs around a "
                                                   "coordinator (ftis-engine train --join).")


@swarm_app.command("serve")
def swarm_serve(
    config: pathlib.Path = typer.Option(..., "--config", help="YAML swarm config: the shared settings (seed, "
                                        "rollout, data, train.steps, swarm bounds and swarm.lease_s), no members."),
    bind: str = typer.Option(..., "--bind", help="Where members dial in, e.g. tcp://0.0.0.0:5555."),
    set_: list[str] = typer.Option([], "--set", metavar="KEY=VALUE", help=SET_HELP),
    output_dir: pathlib.Path = typer.Option(pathlib.Path("runs/swarm"), "--output-dir",
                                            help="Where coordinator.jsonl (joins, leaves, leases) is written."),
) -> None:
    """Run the open swarm's coordinator in the foreground (Ctrl-C ends it): it checks each joining member's shared
    settings and dataset, keeps the live set by leases and relays every member's parcels to the others."""
    from ..openswarm.coordinator import Coordinator, SwarmLogError, load_swarm_config, max_parcel_bytes, shared_settings
    from ..openswarm.wire import address_problem, host_problem
    from ..run.rundir import RunLock

    cfg = load_swarm_config(config, set_)
    problem = address_problem(bind, bind=True) or host_problem(bind)
    if problem:
        raise UsageFailure(f"--bind: {bind!r} {problem}")
    log = output_dir / "coordinator.jsonl"
    # one coordinator at a time in a directory, as one run in a run directory; one that fails before it is bound
    # (another swarm's log there, an address it cannot bind) leaves nothing behind
    with RunLock(output_dir, kind="coordinator"):
        if log.exists() and not log.is_file():
            raise UsageFailure(f"--output-dir {output_dir}: its coordinator.jsonl is not a file (a coordinator's log "
                               "is); move it away")
        try:
            coordinator = Coordinator(shared_settings(cfg), cfg.swarm.lease_s, max_parcel_bytes(cfg), log_path=log,
                                      echo=lambda line: typer.echo(line, err=True))
        except SwarmLogError as exc:
            # from None: a one-line error for the user; the cause adds nothing to it
            raise UsageFailure(f"--output-dir {output_dir}: {exc}") from None
        stop = threading.Event()
        bound: list[str] = []
        import zmq

        try:
            coordinator.serve(bind, stop, bound)
        except zmq.ZMQError as exc:
            if bound:
                raise
            # from None: a one-line error for the user; the cause adds nothing to it
            raise UsageFailure(f"--bind {bind}: {exc}") from None
        except KeyboardInterrupt:  # Ctrl-C (or SIGTERM) is how a coordinator ends: the summary line follows
            pass
    typer.echo(f"coordinator stopped: {coordinator.relayed} parcels relayed, {coordinator.undeliverable} "
               f"undeliverable, {coordinator.refused} refused; log: {log}", err=True)
