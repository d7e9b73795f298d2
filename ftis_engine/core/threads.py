"""A worker thread whose failure reaches the thread that owns it: the exchange's I/O and receiving threads."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Worker:
    """A daemon thread that runs `target(*args)` (start) and keeps the exception it ends with, whatever its type:
    the owner raises it (check), as itself or wrapped in the owner's own error type with it as the cause. A thread's
    exception would otherwise reach nothing but threading.excepthook's print on stderr, and the owner would wait on
    a thread that is gone. `on_error(exc)`, when given, runs in the worker once the exception is kept (to wake the
    owner's waits: what they then check finds it)."""

    def __init__(self, target: Callable[..., object], name: str,
                 on_error: Callable[[BaseException], object] | None = None):
        self._target, self.name, self._on_error = target, name, on_error
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self, *args) -> None:
        self._thread = threading.Thread(target=self._run, args=args, name=self.name, daemon=True)
        self._thread.start()

    def _run(self, *args) -> None:
        try:
            self._target(*args)
        except BaseException as exc:  # a catch-all, as it must be: whatever ends the worker is its owner's to raise
            self.error = exc
            if self._on_error is not None:
                self._on_error(exc)

    def check(self, wrap: Callable[[BaseException], BaseException] | None = None) -> None:
        """Raise the exception the worker ended with: as itself (its type, message and traceback), or `wrap(it)`
        from it (an error of the owner's that says where). Nothing while it has not failed."""
        error = self.error
        if error is None:
            return
        if wrap is None:
            raise error
        raise wrap(error) from error

    @property
    def started(self) -> bool:
        return self._thread is not None

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout_s: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)
