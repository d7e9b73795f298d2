"""The one table from exceptions to exit codes (ftis_engine/app/exits.py): what the command line and a rank of a
multi-process run print and exit with, and the entry point's line for a Ctrl-C while it starts."""

from __future__ import annotations

import errno
import subprocess
import sys

import pytest
import torch

from ftis_engine.model.checkpoint import CheckpointWriteError
from ftis_engine.config import ConfigError
from ftis_engine.exchange import PeerLost, TransportError
from ftis_engine.app.exits import CONFIG, FAILED, INTERRUPTED, Interrupted, Outcome, UsageFailure, ending, outcome
from ftis_engine.generation import EngineError
from ftis_engine.openswarm.client import CoordinatorRefused, JoinRefused
from ftis_engine.run.session import AgreedError
from ftis_engine.data.tasks import TaskError
from ftis_engine.model.update import DivergenceError

from .helpers import ROOT

LOST = "lost contact with a peer (dead, hung past swarm.timeout_s, or unreachable)"


def _chained(exc: BaseException, context: BaseException) -> BaseException:
    try:
        try:
            raise context
        except BaseException:
            raise exc  # noqa: B904  (its context, as a library's wrapping error has it)
    except BaseException as raised:
        return raised


@pytest.mark.parametrize("exc, code, line, final", [
    (ConfigError("members.0.lr: must be > 0"), CONFIG, "members.0.lr: must be > 0", True),
    (TaskError("data.train_path: x holds no rows"), CONFIG, "data.train_path: x holds no rows", True),
    (UsageFailure("--groups: name at least one group"), CONFIG, "--groups: name at least one group", True),
    (DivergenceError("step 2: members.0 (tiny-s) diverged"), FAILED, "step 2: members.0 (tiny-s) diverged", True),
    (EngineError("the weight push failed"), FAILED, "the weight push failed", True),
    (Interrupted("interrupted; the evaluation wrote nothing"), INTERRUPTED, "interrupted; the evaluation wrote nothing",
     False),
    (KeyboardInterrupt(), INTERRUPTED, "the hint", False),
    (CheckpointWriteError("step 4: could not be written"), FAILED, "step 4: could not be written", False),
    (OSError(errno.ENOSPC, "No space left on device", "/runs/a/x"), FAILED,
     "No space left on device writing /runs/a/x: free space, then --resume goes on from the run's newest complete "
     "checkpoint (a run with none yet: start it again without --resume)",
     False),
    (OSError(errno.EACCES, "Permission denied", "/runs"), CONFIG,
     "/runs: Permission denied (check --output-dir and the paths in the config)", False),
])
def test_the_command_line_tells_each_error_it_knows_in_one_line_with_its_code(exc, code, line, final):
    assert outcome(exc, hint="the hint") == Outcome(code, line, final)


def test_an_error_caused_by_a_ctrl_c_is_a_ctrl_c_but_one_the_table_names_keeps_its_row():
    assert outcome(_chained(RuntimeError("Could not import module"), KeyboardInterrupt()), hint="h") == \
        Outcome(INTERRUPTED, "h")
    assert outcome(_chained(ConfigError("x: bad"), KeyboardInterrupt())) == Outcome(CONFIG, "x: bad", True)


@pytest.mark.parametrize("exc", [RuntimeError("a bug"), AttributeError("a bug"), OSError(errno.EIO, "I/O error"),
                                 PeerLost("barrier: gone"), TransportError("rank 0: ..."), TimeoutError("late"),
                                 SystemExit(0), GeneratorExit()])
def test_the_command_line_raises_what_the_table_does_not_tell_as_itself(exc):
    """A bug keeps its type and traceback; a lost peer or the exchange's failure is a rank's to tell (a process that
    runs every member has no peer), and a TimeoutError on the command line is no peer's (a hub's socket)."""
    assert outcome(exc) is None


def test_a_rank_tells_a_lost_peer_the_exchanges_failure_and_anything_else_with_its_rank():
    assert outcome(PeerLost("barrier: Connection closed by peer"), rank=1) == Outcome(
        FAILED, f"rank 1 {LOST}: PeerLost: barrier: Connection closed by peer")
    assert outcome(TimeoutError("no step from peer rank 0 within 60 s"), rank=1).line == (
        f"rank 1 {LOST}: TimeoutError: no step from peer rank 0 within 60 s")
    cause = ValueError("a bad frame")
    transport = TransportError("rank 0: receiving from peer rank 1 failed")
    transport.__cause__ = cause
    assert outcome(transport, rank=0) == Outcome(
        FAILED, "rank 0 failed in the exchange: TransportError: rank 0: receiving from peer rank 1 failed",
        traceback=cause)
    bug = AttributeError("'NoneType' object has no attribute 'step'")
    assert outcome(bug, rank=2) == Outcome(
        FAILED, "rank 2 failed: AttributeError: 'NoneType' object has no attribute 'step'", traceback=bug)


def test_a_ranks_config_error_found_by_every_rank_is_said_by_rank_0_alone_and_a_refusal_names_the_member():
    agreed = AgreedError("--resume: no complete checkpoint")
    assert outcome(agreed, rank=0) == Outcome(CONFIG, "--resume: no complete checkpoint", True)
    assert outcome(agreed, rank=1) == Outcome(CONFIG, None, True)
    assert outcome(ConfigError("members.1.ranks: 3"), rank=1) == Outcome(CONFIG, "members.1.ranks: 3", True)
    assert outcome(JoinRefused("a live member is already named 'a'"), rank=0, joining="a") == Outcome(
        CONFIG, "--join: the coordinator refused a: a live member is already named 'a'", True)


def test_a_member_that_refuses_its_coordinator_ends_with_code_2_in_one_line_on_any_rank():
    """CoordinatorRefused (a welcome no coordinator's config allows) is met by the leader of a member on several
    ranks, which holds the swarm client: it says it as train --join on one process does (exit 2), and final (a
    restart would be refused again)."""
    refused = CoordinatorRefused("the coordinator at tcp://h:1 announced swarm.lease_s=1e-300: below 1 s; this "
                                 "member does not join it")
    assert outcome(refused, rank=0, joining="a") == Outcome(CONFIG, f"--join: {refused}", True)
    assert outcome(refused, rank=2, joining="a") == Outcome(CONFIG, f"--join: {refused}", True)


@pytest.mark.parametrize("lost", [PeerLost("broadcast: Connection closed by peer"), TimeoutError("no step"),
                                  torch.distributed.DistError("gloo: connection reset")])
def test_a_rank_that_loses_a_peer_which_ended_the_run_for_good_ends_with_its_code_and_says_nothing(lost):
    """The leader's refusal wrote its final code (launch's final-exit file) before it exited; the member's other
    ranks then lose contact with it: they end with the same code and no line, so the refusal is the one line."""
    assert outcome(lost, rank=1, settled=lambda: CONFIG) == Outcome(CONFIG, None, True)
    assert outcome(lost, rank=1, settled=lambda: None).code == FAILED  # no peer said why: a lost peer, said
    assert outcome(lost, rank=1).line.startswith(f"rank 1 {LOST}")


def test_every_rank_of_a_refused_member_ends_with_one_line_and_the_same_code(tmp_path, capsys):
    """The two ranks of a member, as launch.run_worker ends them: the leader meets the refusal, writes its final
    code and exits; the other rank loses contact with it and reads that code. One line between them, both exit 2."""
    from ftis_engine.app.launch import _final_code
    from ftis_engine.core.safefile import write_text

    final = tmp_path / "final-exit"
    codes = []

    def stop(told):
        if told.final:
            write_text(final, str(told.code))
        codes.append(told.code)
        raise SystemExit(told.code)

    for rank, exc in ((0, CoordinatorRefused("the coordinator at tcp://h:1 announced swarm.lease_s=0.001: below "
                                             "1 s; this member does not join it")),
                      (1, PeerLost("barrier: Connection closed by peer"))):
        with pytest.raises(SystemExit):
            with ending(stop, rank=rank, joining="a", settled=lambda: _final_code(final)):
                raise exc
    assert codes == [CONFIG, CONFIG]
    assert capsys.readouterr().err == ("error: --join: the coordinator at tcp://h:1 announced swarm.lease_s=0.001: "
                                       "below 1 s; this member does not join it\n")


def test_a_ranks_ctrl_c_is_not_the_tables_its_launcher_stops_it_and_says_so():
    assert outcome(KeyboardInterrupt(), rank=0) is None


def test_ending_prints_the_line_and_the_traceback_then_stops_with_the_outcome(capsys):
    stopped = []

    def stop(told):
        stopped.append(told)
        raise SystemExit(told.code)

    with pytest.raises(SystemExit):
        with ending(stop):
            raise ConfigError("members.0.lr: must be > 0\n  (twice)")
    assert capsys.readouterr().err == "error: members.0.lr: must be > 0 (twice)\n"
    assert stopped == [Outcome(CONFIG, "members.0.lr: must be > 0\n  (twice)", True)]
    with pytest.raises(SystemExit):
        with ending(stop, rank=3):
            raise AttributeError("a bug")
    err = capsys.readouterr().err
    assert err.startswith("error: rank 3 failed: AttributeError: a bug\nTraceback (most recent call last):")
    with pytest.raises(AttributeError, match="a bug"):  # the command line's bug: raised as itself, stop not called
        with ending(stop):
            raise AttributeError("a bug")
    assert len(stopped) == 2 and capsys.readouterr().err == ""


@pytest.mark.slow
def test_a_ctrl_c_while_the_command_starts_is_one_line_and_exit_130():
    """The signal arrives while entry.py imports the command line (torch, transformers: seconds on a first start):
    one line, no traceback, the shell's code for Ctrl-C."""
    code = """
import os, signal, sys

class CtrlC:  # the signal arrives as the command line's module is about to be imported
    def find_spec(self, name, path=None, target=None):
        if name == "ftis_engine.app.cli":
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlC())
from ftis_engine.app.entry import main
main(["--help"])
"""
    from .helpers import with_default_sigint  # a CI script's background job starts with SIGINT ignored

    result = subprocess.run(with_default_sigint([sys.executable, "-c", code]), capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == INTERRUPTED, result.stderr
    assert result.stderr == "error: interrupted while starting; nothing was written\n"
    assert result.stdout == ""
