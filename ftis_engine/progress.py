"""Progress bars (rich) for generation, update and eval, and the one-line step summaries."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress


class Progress:
    """Transient bars, one per phase; disabled bars still print summary lines."""

    def __init__(self, enabled: bool = True, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self._bars = RichProgress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=self.console, transient=True, disable=not enabled,
        )

    def __enter__(self) -> "Progress":
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
