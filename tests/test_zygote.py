"""tests/zygote.py: a command the tests fork from a zygote behaves as the same command started as a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from . import zygote
from .helpers import TINY

# every test starts commands: the slow tier (issue 69: the zygote goes with WP-G3, these tests with it)
pytestmark = pytest.mark.slow


def _env(**extra) -> dict:
    """What the other test files pass (read now: the session's environment may have changed since collection)."""
    return {**os.environ, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1", **extra}


def test_a_refused_command_exits_and_writes_as_the_same_command_started_as_a_subprocess(tmp_path):
    args = [sys.executable, "-m", "ftis_engine", "train", "--config", str(TINY), "--set", "rollout.group_size=-1",
            "--output-dir", "out"]
    forked = zygote.run(args, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=300)
    plain = subprocess.run(args, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=300)
    assert type(forked) is subprocess.CompletedProcess
    assert (forked.returncode, forked.stdout, forked.stderr) == (plain.returncode, plain.stdout, plain.stderr)
    assert forked.returncode == 2 and "rollout.group_size" in forked.stderr and not (tmp_path / "out").exists()


def test_a_forked_script_gets_its_argv_directory_environment_streams_and_exit_code(tmp_path):
    """What `python SCRIPT.py a "b c"` would see: argv, the current directory, the script's directory first on
    sys.path, the environment asked for, `__main__`, standard input; its exit code and both streams come back."""
    script = tmp_path / "probe.py"
    script.write_text("import json, os, sys\n"
                      "print(json.dumps({'argv': sys.argv, 'cwd': os.getcwd(), 'path0': sys.path[0],\n"
                      "                  'env': os.environ.get('FTIS_PROBE'), 'main': __name__,\n"
                      "                  'stdin': sys.stdin.read()}))\n"
                      "sys.stderr.write('to stderr\\n')\n"
                      "sys.exit(3)\n")
    args = [sys.executable, str(script), "a", "b c"]
    kw = dict(capture_output=True, text=True, env=_env(FTIS_PROBE="1"), cwd=tmp_path, input="in", timeout=60)
    forked, plain = zygote.run(args, **kw), subprocess.run(args, **kw)
    assert (forked.returncode, forked.stdout, forked.stderr) == (plain.returncode, plain.stdout, plain.stderr)
    assert forked.returncode == 3 and forked.stderr == "to stderr\n"
    assert json.loads(forked.stdout) == {"argv": [str(script), "a", "b c"], "cwd": str(tmp_path),
                                         "path0": str(tmp_path), "env": "1", "main": "__main__", "stdin": "in"}


def test_a_signal_or_a_time_out_ends_a_forked_command_as_it_ends_a_subprocess(tmp_path):
    args = [sys.executable, "-m", "ftis_engine", "train", "--config", str(TINY), "--set", "train.steps=100000",
            "--set", "eval.every=0"]
    for kill, code in ((signal.SIGKILL, -9), (signal.SIGTERM, 130)):  # SIGTERM: the command's one line, code 130
        process = zygote.Popen([*args, "--output-dir", str(tmp_path / str(code))], env=_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        assert type(process) is not subprocess.Popen
        while not (tmp_path / str(code)).exists() and process.poll() is None:
            time.sleep(0.1)  # the run has started: its SIGTERM handler is in place
        assert process.poll() is None
        process.send_signal(kill)
        _, err = process.communicate(timeout=120)
        assert process.returncode == code, err
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run([*args, "--output-dir", str(tmp_path / "t")], env=_env(), capture_output=True, timeout=1)


def test_only_run_time_settings_may_differ_from_the_zygotes_and_special_starts_are_plain_subprocesses():
    base = {"PATH": "/bin", "PYTHONHASHSEED": "0"}
    same = zygote._import_environment
    assert same({**base, "RANK": "1", "MASTER_PORT": "1", "FTIS_CACHE_DIR": "/x", "PYTEST_CURRENT_TEST": "t"}) == \
        same(base)
    assert same({**base, "PYTHONHASHSEED": "1"}) != same(base) and same({**base, "OMP_NUM_THREADS": "1"}) != same(base)
    args = [sys.executable, "-m", "ftis_engine", "--help"]
    assert zygote._forkable(args, {"env": _env(), "stdout": subprocess.PIPE})
    for kw in ({"start_new_session": True}, {"preexec_fn": os.getpid}, {"pass_fds": (0,)}, {"shell": True}):
        assert not zygote._forkable(args, kw)
    assert not zygote._forkable([sys.executable, "-c", "pass"], {})
    special = zygote.Popen(args, env=_env(), stdout=subprocess.DEVNULL, start_new_session=True)
    assert type(special) is subprocess.Popen and special.wait(timeout=120) == 0


def test_a_retired_zygote_takes_no_more_commands_and_ends_after_the_ones_it_forked_with_their_statuses(tmp_path):
    """A fourth environment retires the zygote used least recently: what it forked goes on and reports."""
    script = tmp_path / "slow.py"
    script.write_text("import sys, time\ntime.sleep(2)\nsys.exit(5)\n")
    env = _env(ZYGOTE_TEST_ENVIRONMENT="retired")  # an environment of its own: no other test's zygote is retired
    process = zygote.Popen([sys.executable, str(script)], env=env)
    assert type(process) is not subprocess.Popen
    retired = process._zygote
    retired.retire()
    assert process.wait(timeout=60) == 5
    retired.proc.wait(timeout=30)
    with zygote._lock:
        zygote._zygotes.pop(zygote._import_environment(env))
    with pytest.raises(OSError):
        zygote._ForkedPopen(retired, [sys.executable, str(script)], env=env)
