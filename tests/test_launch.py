"""Launching several processes (launch.py): the process count is checked before anything starts, and a worker's
failure is told for what it is. The runs themselves: tests/test_swarm.py and tests/test_async_swarm.py."""

from __future__ import annotations

import os
import pathlib
import tempfile

import pytest

from ftis_engine.config import ConfigError
from ftis_engine.launch import _collective_failure, launch_distributed

from .helpers import short_config


def test_nproc_must_be_one_process_per_member_and_sampler(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ConfigError, match=r"^--nproc 3: the config needs 2 processes \(one per member rank and "
                                          r"sampler: tiny-s, tiny-m-lora\)$"):
        launch_distributed(short_config(), tmp_path / "run", resume=False, nproc=3)
    with pytest.raises(ConfigError, match=r"needs 3 processes .*, 1 sampler rank\(s\)\)$"):
        launch_distributed(short_config("swarm.mode=async", "members.0.samplers=1"), tmp_path / "run", False, 2)
    with pytest.raises(ConfigError, match=r"needs 4 processes .*: tiny-s on 3 rank\(s\), tiny-m-lora\)$"):
        launch_distributed(short_config("members.0.ranks=3"), tmp_path / "run", False, 2)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("message, lost", [
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5", True),
    ("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error", True),
    ("Rank 1 failed to pass monitoredBarrier in 1800000 ms", True),
    ("The size of tensor a (3) must match the size of tensor b (4) at non-singleton dimension 0", False),
    ("CUDA out of memory. Tried to allocate 2.00 GiB", False),
])
def test_a_collectives_failure_is_a_lost_peer_and_anything_else_a_failure(message, lost):
    assert _collective_failure(RuntimeError(message)) is lost


@pytest.mark.parametrize("env, message", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR: not set, but RANK and WORLD_SIZE are"),
    ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "RANK: 'x' is not a whole number"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, r"RANK: 2 is outside 0..1"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "99999"}, "MASTER_PORT: 99999 is outside"),
])
def test_a_half_set_torchrun_environment_is_one_line_naming_the_variable(env, message):
    from ftis_engine.config import ConfigError
    from ftis_engine.launch import check_rank_environment

    with pytest.raises(ConfigError, match=message):
        check_rank_environment(env)
    check_rank_environment({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})


def test_a_restart_on_any_rank_is_a_restart_on_every_rank():
    """The ranks of a node restarted for another node's failure see a count of 0: all take the restart's path
    (resume, no fresh-run check), so open_run's collectives line up."""
    import types

    from ftis_engine.launch import any_rank

    collectives = types.SimpleNamespace(all_gather_object=lambda flag: [False, flag, True])
    assert any_rank(collectives, False) is True
    assert any_rank(types.SimpleNamespace(all_gather_object=lambda flag: [flag, False]), False) is False


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_a_divergence_is_not_restarted_it_ends_the_swarm_once_with_its_one_line(tmp_path, start_method):
    """The elastic agent restarts on any failure: with swarm.max_restarts 2 a member whose step 1 blows its weights up
    (lr 1e30) resumed and diverged again, twice, printing its error three times (and, on a GPU, replaying every step
    since the checkpoint each time). A failure no restart mends ends the swarm at the first: one line, exit 1.
    With workers forked from the fork server (the default without CUDA) the file that says so reaches them though
    the launcher names it after the server started; and with spawned workers."""
    import subprocess
    import sys

    from .helpers import SHORT, TINY

    leftovers = set(pathlib.Path(tempfile.gettempdir()).glob("ftis-*.final-exit"))
    args = ["train", "--config", str(TINY), "--output-dir", str(tmp_path)]
    for o in [*SHORT, "run_name=swarm", "eval.every=0", "members.0.lr=1e30"]:
        args += ["--set", o]
    result = subprocess.run([sys.executable, "-m", "ftis_engine", *args, "--nproc", "2", "--max-restarts", "2"],
                            env={**os.environ, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1",
                                 "FTIS_START_METHOD": start_method}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    diverged = [line for line in result.stderr.splitlines() if "diverged" in line]
    assert len(diverged) == 1 and diverged[0].startswith("error: step 2: members.0 (tiny-s) diverged:"), result.stderr
    assert set(pathlib.Path(tempfile.gettempdir()).glob("ftis-*.final-exit")) == leftovers  # the launcher's is gone


@pytest.fixture
def environ_restored():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_a_forked_worker_gets_the_launchers_environment_at_launch_and_keeps_what_the_agent_set(monkeypatch,
                                                                                                environ_restored):
    """A worker forked from the fork server starts with the server's environment (the launcher's when the server
    started) plus what the agent set for its rank; it runs with the launcher's environment at launch in place of
    the server's, and the agent's keys on top."""
    import sys
    import types

    from ftis_engine import launch

    server = {"PATH": "/bin", "GONE_SINCE": "1", "CHANGED": "old"}
    agent = {"RANK": "1", "MASTER_ADDR": "127.0.0.1", "TORCHELASTIC_RESTART_COUNT": "0"}
    at_launch = {"PATH": "/bin", "CHANGED": "new", "FTIS_FINAL_EXIT_FILE": "/tmp/x.final-exit"}
    # the server's preload module, without its imports (those are the fork server test's)
    monkeypatch.setitem(sys.modules, "ftis_engine.preload", types.SimpleNamespace(SERVER_ENVIRON=server))
    seen = {}
    monkeypatch.setattr(launch, "run_worker", lambda *args: seen.update(env=dict(os.environ), args=args) or 7)
    os.environ.clear()
    os.environ.update({**server, **agent})
    assert launch.start_worker(at_launch, "config", "run") == 7
    assert seen == {"env": {**at_launch, **agent}, "args": ("config", "run")}
    os.environ.clear()
    os.environ.update({**server, **agent})
    launch.start_worker(None, "config")  # spawned: its environment is already the launcher's
    assert seen["env"] == {**server, **agent}


def test_the_fork_server_imports_the_workers_modules_under_the_environment_of_each_launch(monkeypatch):
    """start_fork_server: a server whose children start with the workers' modules imported; a second launch in the
    same process gets a new server that imported under the environment as it is then; FTIS_START_METHOD=spawn or a
    bad value; spawn by default where CUDA is available."""
    import multiprocessing

    import torch

    from ftis_engine.launch import start_fork_server, stop_fork_server

    monkeypatch.setenv("FTIS_START_METHOD", "spawn")
    assert start_fork_server() == "spawn"
    monkeypatch.setenv("FTIS_START_METHOD", "fork")
    with pytest.raises(ConfigError, match=r"^FTIS_START_METHOD: 'fork' is not one of auto, forkserver, spawn$"):
        start_fork_server()
    monkeypatch.delenv("FTIS_START_METHOD")
    with monkeypatch.context() as cuda:
        cuda.setattr(torch.cuda, "is_available", lambda: True)
        assert start_fork_server() == "spawn"  # by default, a machine with CUDA spawns its workers
    context = multiprocessing.get_context("forkserver")
    try:
        for value in ("first", "second"):
            monkeypatch.setenv("FTIS_TEST_MARK", value)
            assert start_fork_server() == "forkserver"
            with context.Pool(1) as pool:
                mark, imported_by, child = pool.apply(_what_a_forked_child_has)
            assert mark == value and imported_by != child  # the server imported it, before the fork
    finally:
        stop_fork_server()


def _what_a_forked_child_has():
    from ftis_engine import preload

    return preload.SERVER_ENVIRON.get("FTIS_TEST_MARK"), preload.IMPORTED_BY, os.getpid()
