"""How a command ends: the one table from exceptions to exit codes and lines, for the command line (cli.main) and
for a rank of a multi-process run (launch.run_worker).

The first row that matches tells it:

    exception                                                     code  final  the line
    the command line: KeyboardInterrupt                            130         the command's hint
    Interrupted                                                    130         its message (what the command left)
    ConfigError, TaskError, UsageFailure                             2  yes    its message (AgreedError: rank 0's)
    WriteFailure                                                     1         its message (what the run left)
    DivergenceError, EngineError                                     1  yes    its message
    a rank: JoinRefused                                              2  yes    "--join: the coordinator refused ..."
    a rank: CoordinatorRefused (the member refused the coordinator)  2  yes    "--join: the coordinator at ..."
    a rank: PeerLost, TimeoutError, torch.distributed.DistError,     its  yes  none (the peer said it)
            after a peer ended the run with a final code (settled)  code
    a rank: PeerLost, TimeoutError, torch.distributed.DistError      1         "rank N lost contact with a peer ..."
    a rank: TransportError                                           1         "rank N failed in the exchange ...",
                                                                               then its cause's traceback
    CheckpointWriteError, OSError ENOSPC / EDQUOT                    1         "... free space, then ..." (--resume
                                                                               when a checkpoint is there)
    OSError ENAMETOOLONG / EACCES / EROFS / ENOTDIR / EPERM /        2         the path and what to check
            EISDIR / EFBIG (safefile: a link, a file too large)
    the command line: an error caused by a KeyboardInterrupt       130         the command's hint
    anything else: the command line                                  -         raised as itself (its traceback)
    anything else: a rank                                            1         "rank N failed ...", its traceback

Final: no restart mends it (a resume replays the same steps to the same NaN, reads the same config): a rank writes
its code where the launcher told it (launch.FINAL_EXIT_ENV), and the elastic agent's restarts end at once with it.
The ranks it leaves behind lose contact with it: each finds its code there (`settled`) and ends with the same code
and no line of its own, so a refusal the leader of a member on several ranks met (a coordinator's, a join's) is one
line and one exit code however many ranks the member has.

The command line's handler of Ctrl-C and SIGTERM while a command runs is Interrupts (cli.main installs it).

Light on purpose: entry.py imports INTERRUPTED while torch is not loaded yet. The table's exception classes are
imported when an exception is told, each from the module that raises it; a Ctrl-C and the command line's own
errors are told before any of them (a command that ends so imports nothing more).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Callable
from typing import NamedTuple

FAILED = 1
CONFIG = 2  # a bad config, override, path or data file: one line naming it, nothing written
INTERRUPTED = 130  # the shell's code for Ctrl-C (and SIGTERM)

LOST_PEER = "lost contact with a peer (dead, hung past swarm.timeout_s, or unreachable)"
FULL = (errno.ENOSPC, errno.EDQUOT)
REFUSED_PATH = (errno.ENAMETOOLONG, errno.EACCES, errno.EROFS, errno.ENOTDIR, errno.EPERM, errno.EISDIR, errno.EFBIG)


class UsageFailure(Exception):
    """A one-line error for the user; exits with code 2."""


class WriteFailure(Exception):
    """A write the machine refused (a full disk, a quota) told with what the run left and how it goes on; exits
    with code 1."""


class Interrupted(Exception):
    """Ctrl-C (or SIGTERM) stopped a command; the message says what it left. Exits with code 130."""


class Outcome(NamedTuple):
    code: int
    line: str | None  # the one line's message ("error: " goes before it); None: this process says nothing
    final: bool = False  # no restart mends it (see the module)
    traceback: BaseException | None = None  # printed after the line: the exception whose traceback says more


def outcome(exc: BaseException, rank: int | None = None, joining: str | None = None,
            hint: str = "interrupted", settled: Callable[[], int | None] | None = None) -> Outcome | None:
    """How `exc` ends the command line (rank None) or the rank `rank` of a multi-process run: its exit code and
    line (the table in the module). joining: the member an open swarm's coordinator refused (a rank's JoinRefused);
    hint: the command line's line for a Ctrl-C; settled: a rank's look at the code a peer ended the run with for
    good (launch's final-exit file), None when none did. None: the command line raises it as itself."""
    if isinstance(exc, KeyboardInterrupt) and rank is None:
        return Outcome(INTERRUPTED, hint)
    if isinstance(exc, Interrupted):
        return Outcome(INTERRUPTED, str(exc))
    if not isinstance(exc, Exception):  # SystemExit (its code chosen already); a rank's Ctrl-C: its launcher says it
        return None
    if isinstance(exc, UsageFailure):
        return Outcome(CONFIG, str(exc), final=True)
    if isinstance(exc, WriteFailure):
        return Outcome(FAILED, str(exc))
    from ..config import ConfigError

    if isinstance(exc, ConfigError):  # told before the imports below, which load torch: a bad config's line is quick
        return _config_outcome(exc, rank)
    from ..data.tasks import TaskError
    from ..generation import EngineError
    from ..model.checkpoint import CheckpointWriteError
    from ..model.update import DivergenceError

    if isinstance(exc, TaskError):
        return _config_outcome(exc, rank)
    if isinstance(exc, (DivergenceError, EngineError)):
        return Outcome(FAILED, str(exc), final=True)
    if rank is not None:
        told = _rank_outcome(exc, rank, joining, settled)
        if told is not None:
            return told
    if isinstance(exc, OSError):  # what the machine refused while writing: what to do, in one line
        if isinstance(exc, CheckpointWriteError):
            return Outcome(FAILED, str(exc))
        if exc.errno in FULL:
            return Outcome(FAILED, f"{exc.strerror} writing {exc.filename or 'the run directory'}: free space, then "
                                   "--resume goes on from the run's newest complete checkpoint (a run with none yet: "
                                   "start it again without --resume)")
        if exc.errno in REFUSED_PATH:
            return Outcome(CONFIG, f"{exc.filename or 'a path'}: {exc.strerror} (check --output-dir and the paths "
                                   "in the config)")
        return _anything_else(exc, rank)
    if rank is None and caused_by_interrupt(exc):  # a library's error wrapping a Ctrl-C ("Could not import ...")
        return Outcome(INTERRUPTED, hint)
    return _anything_else(exc, rank)


def _config_outcome(exc: BaseException, rank: int | None) -> Outcome:
    """A config's or a task's error: exit 2 and its line, said once (an error every rank found alike: by rank 0)."""
    if rank is not None and rank > 0:
        from ..run.session import AgreedError

        if isinstance(exc, AgreedError):  # every rank found it alike: rank 0 says it
            return Outcome(CONFIG, None, final=True)
    return Outcome(CONFIG, str(exc), final=True)


def _rank_outcome(exc: BaseException, rank: int, joining: str | None,
                  settled: Callable[[], int | None] | None = None) -> Outcome | None:
    """The rows only a rank of a multi-process run meets: a coordinator's refusal or the member's of it, a lost
    peer (after a peer's final failure: its code, silently), the exchange."""
    import torch.distributed as dist

    from ..core.errors import first_line
    from ..exchange import PeerLost, TransportError
    from ..openswarm.client import CoordinatorRefused, JoinRefused

    said = f"{type(exc).__name__}: {first_line(exc)}"
    if isinstance(exc, JoinRefused):
        return Outcome(CONFIG, f"--join: the coordinator refused {joining}: {exc}", final=True)
    if isinstance(exc, CoordinatorRefused):  # as train --join on one process says it (cli._train_joined)
        return Outcome(CONFIG, f"--join: {exc}", final=True)
    if isinstance(exc, (PeerLost, TimeoutError, dist.DistError)):
        code = settled() if settled is not None else None
        if code is not None:  # the peer it lost ended the run for good and said why: the same end, no second line
            return Outcome(code, None, final=True)
        return Outcome(FAILED, f"rank {rank} {LOST_PEER}: {said}")
    if isinstance(exc, TransportError):  # the exchange's own failure, with its cause
        return Outcome(FAILED, f"rank {rank} failed in the exchange: {said}", traceback=exc.__cause__ or exc)
    return None


def _anything_else(exc: BaseException, rank: int | None) -> Outcome | None:
    """The command line raises what the table does not tell; a rank says it failed, with the traceback (it ends
    with os._exit: a teardown could wait on a peer that is gone)."""
    if rank is None:
        return None
    from ..core.errors import first_line

    return Outcome(FAILED, f"rank {rank} failed: {type(exc).__name__}: {first_line(exc)}",
                   traceback=exc.__cause__ or exc)


def caused_by_interrupt(exc: BaseException) -> bool:
    """Whether a KeyboardInterrupt is `exc` or in its chain of causes and contexts."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


@contextlib.contextmanager
def ending(stop: Callable[[Outcome], object], rank: int | None = None, joining: str | None = None,
           hint: str = "interrupted", settled: Callable[[], int | None] | None = None):
    """Run the block; an exception the table tells (outcome's arguments) prints its line (and traceback) on stderr
    and goes to `stop`, which ends the process with the outcome's code (sys.exit, os._exit) and never returns. What
    the table does not tell is raised as itself."""
    try:
        yield
    except BaseException as exc:  # a catch-all by design: every exception meets the table here; what it does not
        # tell is raised as itself
        told = outcome(exc, rank, joining, hint, settled)
        if told is None:
            raise
        import traceback

        from ..core.errors import error_line

        if told.line is not None:
            sys.stderr.write(error_line(told.line))
        if told.traceback is not None:
            traceback.print_exception(told.traceback, file=sys.stderr)
        sys.stderr.flush()
        stop(told)
        raise  # stop ends the process: this is never reached


class Interrupts:
    """SIGINT's and SIGTERM's handler while a command runs: the first stops it as Ctrl-C does (KeyboardInterrupt:
    its runs interrupted, its checkpoints kept, one line); those within FORCE_AFTER_S of it (a double Ctrl-C, a
    supervisor's SIGTERMs in a row) are ignored, so the cleanup it set off finishes and says what it left; one
    later than that (a cleanup that hangs) ends the process at once, in one line."""

    FORCE_AFTER_S = 2.0

    def __init__(self):
        self.first: float | None = None

    def __call__(self, signum, frame) -> None:
        import time

        if self.first is None:
            self.first = time.monotonic()
            raise KeyboardInterrupt
        if time.monotonic() - self.first >= self.FORCE_AFTER_S:
            from ..core.errors import error_line

            sys.stderr.write(error_line("interrupted again while stopping: stopped at once, its cleanup unfinished"))
            sys.stderr.flush()
            os._exit(INTERRUPTED)
