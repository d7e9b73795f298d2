"""What the user sees: progress bars (rich) for generation, update and eval, the one-line step summaries, and
third-party libraries kept quiet."""

from __future__ import annotations

import logging
import sys
import warnings

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress

from ..core.errors import shown


class Progress:
    """Transient bars, one per phase; disabled bars still print summary lines."""

    def __init__(self, enabled: bool = True, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self._bars = RichProgress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=self.console, transient=True, disable=not enabled,
        )

    def __enter__(self) -> Progress:
        self._bars.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._bars.__exit__(*exc)

    def start(self, description: str, total: int) -> int:
        return self._bars.add_task(description, total=total)

    def advance(self, task_id: int, amount: int) -> None:
        self._bars.advance(task_id, amount)

    def finish(self, task_id: int) -> None:
        self._bars.remove_task(task_id)

    def print(self, line: str) -> None:
        self.console.print(line, highlight=False, markup=False, soft_wrap=True)


LEGEND = ("each step: reward = mean reward of the member's own rollouts; loss = the F-TIS loss (near 0 by "
          "construction: group advantages average to 0); w = mean truncated importance weight of what it trained on "
          "(1 = on-policy); filt = share of sequences the KL filter dropped")


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def summary_line(step: int, steps: int, records: list[dict], step_seconds: float | None = None,
                 eta_seconds: float | None = None) -> str:
    parts = []
    for r in sorted((r for r in records if r["kind"] in ("train", "eval")), key=lambda r: r["kind"] == "eval"):
        if r["kind"] == "train":
            parts.append(f"{r['member']}: reward {r['reward_mean']:.3f} loss {r['loss']:+.2e} "
                         f"w {r['is_weight_mean']:.2f} filt {r['filtered_frac']:.2f}")
        else:
            parts.append(f"{r['member']}: {r['dataset']} acc {r['accuracy']:.3f}")
    timing = ""
    if step_seconds is not None:
        timing = f" | {step_seconds:.1f}s/step" + (f", ETA {_duration(eta_seconds)}" if eta_seconds is not None else "")
    return f"step {step}/{steps} | " + " | ".join(parts) + timing


class ShownFormatter(logging.Formatter):
    """The engine's log lines with their message escaped (errors.shown): a warning may quote what a peer or a
    coordinator sent (a name, a reason), and none of it may drive the terminal or forge a line."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        if record.name == "ftis_engine" or record.name.startswith("ftis_engine."):
            record.message = shown(record.message, limit=None)
        return super().formatMessage(record)


def quiet_libraries() -> None:
    """Warnings to stderr as one line each, the engine's escaped (ShownFormatter); no third-party progress bars
    (ours say what is happening)."""
    root = logging.getLogger()
    if not root.handlers:  # as logging.basicConfig, with the engine's lines escaped
        handler = logging.StreamHandler()
        handler.setFormatter(ShownFormatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*TRANSFORMERS_VERBOSITY.*")
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    # transformers takes its bars' switch from huggingface_hub's as it is imported (which imports no torch: a bad
    # config is told before torch loads); one imported already has its own switch
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()
    if "transformers.utils.logging" in sys.modules:
        sys.modules["transformers.utils.logging"].disable_progress_bar()
