"""Launching several processes (launch.py): the process count is checked before anything starts, and a worker's
failure is told for what it is. The runs themselves: tests/test_swarm.py and tests/test_async_swarm.py."""

from __future__ import annotations

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


def test_a_divergence_is_not_restarted_it_ends_the_swarm_once_with_its_one_line(tmp_path):
    """The elastic agent restarts on any failure: with swarm.max_restarts 2 a member whose step 1 blows its weights up
    (lr 1e30) resumed and diverged again, twice, printing its error three times (and, on a GPU, replaying every step
    since the checkpoint each time). A failure no restart mends ends the swarm at the first: one line, exit 1."""
    import os
    import subprocess
    import sys

    from .helpers import SHORT, TINY

    leftovers = set(pathlib.Path(tempfile.gettempdir()).glob("ftis-*.final-exit"))
    args = ["train", "--config", str(TINY), "--output-dir", str(tmp_path)]
    for o in [*SHORT, "run_name=swarm", "eval.every=0", "members.0.lr=1e30"]:
        args += ["--set", o]
    result = subprocess.run([sys.executable, "-m", "ftis_engine", *args, "--nproc", "2", "--max-restarts", "2"],
                            env={**os.environ, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    diverged = [line for line in result.stderr.splitlines() if "diverged" in line]
    assert len(diverged) == 1 and diverged[0].startswith("error: step 2: members.0 (tiny-s) diverged:"), result.stderr
    assert set(pathlib.Path(tempfile.gettempdir()).glob("ftis-*.final-exit")) == leftovers  # the launcher's is gone
