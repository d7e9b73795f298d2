"""ftis-engine train | eval | plot.

A bad config, override or path exits with code 2 and one line naming the field, before anything is written.
"""

from __future__ import annotations

import json
import logging
import pathlib
import sys
import warnings
from typing import Optional

import typer

from .config import ConfigError, RunConfig, dump_config, load_config
from .tasks import TaskError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Collaborative GRPO across heterogeneous LLMs with F-TIS.")


class UsageFailure(Exception):
    """A one-line error for the user; exits with code 2."""


def _load(config: pathlib.Path, overrides: list[str], output_dir: Optional[pathlib.Path]) -> RunConfig:
    cfg = load_config(config, overrides)
    if output_dir is not None:
        cfg.output_dir = str(output_dir)
    return cfg


def run_directory(cfg: RunConfig) -> pathlib.Path:
    return pathlib.Path(cfg.output_dir) / cfg.run_name


@app.command()
def train(
    config: pathlib.Path = typer.Option(..., "--config", help="YAML run config."),
    set_: list[str] = typer.Option([], "--set", help="Override a field: dotted.path=value (list indices allowed)."),
    output_dir: Optional[pathlib.Path] = typer.Option(None, "--output-dir", help="Parent of the run directory."),
    nproc: int = typer.Option(1, "--nproc", min=1, help="Processes on this machine, one member each."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the newest complete checkpoint."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved config and exit."),
    max_restarts: Optional[int] = typer.Option(None, "--max-restarts", min=0,
                                               help="--nproc: elastic restarts (default swarm.max_restarts)."),
) -> None:
    """Train the members of a config together."""
    cfg = _load(config, set_, output_dir)
    if dry_run:
        typer.echo(dump_config(cfg), nl=False)
        return
    run_dir = run_directory(cfg)
    if not _under_torchrun():  # under torchrun the ranks decide together (launch.run_worker)
        check_fresh_run(run_dir, resume)
    if nproc > 1 or _under_torchrun():
        from .launch import launch_distributed

        if max_restarts is not None:
            cfg.swarm.max_restarts = max_restarts
        code = launch_distributed(cfg, run_dir, resume, nproc)
        raise typer.Exit(code)
    from .members import check_generator_placement, preflight
    from .run import setup_swarm, train as run_training

    check_generator_placement(cfg, distributed=False)
    tokenizers = preflight(cfg)
    swarm = setup_swarm(cfg, run_dir, tokenizers=tokenizers)
    from .progress import Progress

    swarm.progress = Progress()
    run_training(cfg, run_dir, resume=resume, swarm=swarm)
    typer.echo(f"run directory: {run_dir}", err=True)


def check_fresh_run(run_dir: pathlib.Path, resume: bool) -> None:
    """A new run never writes into a directory that holds one: that needs --resume."""
    if (run_dir / "metrics.jsonl").exists() and not resume:
        raise UsageFailure(f"run_name: {run_dir} already holds a run; pass --resume to continue it or choose "
                           "another run_name/--output-dir")


def _under_torchrun() -> bool:
    import os

    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


@app.command("eval")
def evaluate(
    config: pathlib.Path = typer.Option(..., "--config", help="The run's YAML config."),
    checkpoint: pathlib.Path = typer.Option(..., "--checkpoint", help="checkpoints/step-<N> (or a run directory)."),
    set_: list[str] = typer.Option([], "--set", help="Override a field: dotted.path=value."),
) -> None:
    """Greedy pass@1 of every member in a checkpoint on the task's eval sets (JSON lines on stdout)."""
    from .checkpoint import latest_checkpoint, restore_member
    from .members import preflight
    from .run import evaluate_all, setup_swarm

    cfg = _load(config, set_, None)
    if not (checkpoint / "state.json").is_file():
        found = latest_checkpoint(checkpoint)
        if found is None:
            raise UsageFailure(f"--checkpoint {checkpoint}: not a complete checkpoint or a run directory holding one")
        checkpoint = found[1]
    state = json.loads((checkpoint / "state.json").read_text())
    names = [m.name for m in cfg.members]
    if state.get("members") != names:
        raise UsageFailure(f"--checkpoint {checkpoint}: holds members {state.get('members')}, the config has {names}")
    tokenizers = preflight(cfg)
    swarm = setup_swarm(cfg, checkpoint, tokenizers=tokenizers)
    for member in swarm.members:
        restore_member(member, checkpoint, load_optimizer=False)
        member.generator.sync(member.model)
    for record in evaluate_all(swarm, int(state["step"])):
        typer.echo(json.dumps(record))


@app.command()
def plot(run_dir: pathlib.Path = typer.Argument(..., help="A run directory (holding metrics.jsonl).")) -> None:
    """Draw each member's validation curve and the loss stats over steps (run_dir/plots/*.png)."""
    from .plots import make_plots

    if not (run_dir / "metrics.jsonl").is_file():
        raise UsageFailure(f"RUN_DIR {run_dir}: no metrics.jsonl there")
    for path in make_plots(run_dir):
        typer.echo(str(path))


# typer raises click's UsageError (its own vendored click in recent versions): reach it through a public class.
_UsageError = typer.BadParameter.__mro__[1]


def main(argv: list[str] | None = None) -> None:
    """Entry point: usage and config errors become one line on stderr and exit code 2."""
    quiet_libraries()
    try:
        code = app(args=argv, standalone_mode=False)
    except (ConfigError, TaskError, UsageFailure) as exc:
        _fail(str(exc))
    except _UsageError as exc:
        if type(exc).__name__ == "NoArgsIsHelpError" and exc.ctx is not None:
            sys.stdout.write(exc.ctx.get_help() + "\n")
            sys.exit(0)
        _fail(exc.format_message())
    except typer.Abort:
        _fail("aborted", code=130)
    sys.exit(code if isinstance(code, int) else 0)


def quiet_libraries() -> None:
    """Warnings to stderr as one line each; no third-party progress bars (ours say what is happening)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore", message=".*TRANSFORMERS_VERBOSITY.*")
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _fail(message: str, code: int = 2) -> None:
    sys.stderr.write(f"error: {' '.join(message.split())}\n")
    sys.exit(code)
