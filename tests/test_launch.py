"""Launching several processes (launch.py): the process count is checked before anything starts, and a worker's
failure is told for what it is. The runs themselves: tests/test_swarm.py and tests/test_async_swarm.py."""

from __future__ import annotations

import os
import pathlib

import pytest

from ftis_engine.config import ConfigError
from ftis_engine.app.launch import launch_distributed

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


@pytest.mark.parametrize("message", [
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5",
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation",
    "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error",
    "Rank 1 failed to pass monitoredBarrier in 1800000 ms",
])
def test_a_collectives_failure_is_a_lost_peer_and_the_same_error_elsewhere_a_failure(monkeypatch, message):
    """gloo and NCCL raise a dead or hung peer as a plain RuntimeError: at a collective of the engine's it is
    PeerLost (its cause the backend's error), which a rank tells as a lost peer; the same RuntimeError raised
    anywhere else is a failure, told with its traceback."""
    import torch
    import torch.distributed as dist

    from ftis_engine.exchange import PeerLost
    from ftis_engine.exchange.sync import Collectives
    from ftis_engine.app.exits import outcome

    def collective(*args, **kwargs):
        raise RuntimeError(message)

    monkeypatch.setattr(dist, "all_reduce", collective)
    with pytest.raises(PeerLost) as lost:
        Collectives(0, 2, torch.device("cpu"), "gloo").all_agree(3)
    assert isinstance(lost.value.__cause__, RuntimeError) and str(lost.value) == f"all_reduce: {message}"
    told = outcome(lost.value, rank=1)
    assert told.line.startswith("rank 1 lost contact with a peer (dead, hung past swarm.timeout_s, or unreachable): "
                                f"PeerLost: all_reduce: {message[:40]}") and told.traceback is None
    told = outcome(RuntimeError(message), rank=1)
    assert told.line == f"rank 1 failed: RuntimeError: {message}" and told.traceback is not None


@pytest.mark.parametrize("env, message", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR: not set, but RANK and WORLD_SIZE are"),
    ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "RANK: 'x' is not a whole number"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, r"RANK: 2 is outside 0..1"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "99999"}, "MASTER_PORT: 99999 is outside"),
])
def test_a_half_set_torchrun_environment_is_one_line_naming_the_variable(env, message):
    from ftis_engine.config import ConfigError
    from ftis_engine.app.launch import check_rank_environment

    with pytest.raises(ConfigError, match=message):
        check_rank_environment(env)
    check_rank_environment({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})


def test_a_restart_on_any_rank_is_a_restart_on_every_rank():
    """The ranks of a node restarted for another node's failure see a count of 0: all take the restart's path
    (resume, no fresh-run check), so open_run's collectives line up."""
    import types

    from ftis_engine.app.launch import any_rank

    collectives = types.SimpleNamespace(all_gather_object=lambda flag: [False, flag, True])
    assert any_rank(collectives, False) is True
    assert any_rank(types.SimpleNamespace(all_gather_object=lambda flag: [flag, False]), False) is False


def _round(port: int, rank: int, world: int, timeout_s: float = 20.0) -> int:
    """agree_round as one rank of a world over the agent's store (a client of its own, as a worker has)."""
    import datetime

    from torch.distributed import TCPStore

    from ftis_engine.run.wiring import agree_round

    timeout = datetime.timedelta(seconds=timeout_s)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=20))
    return agree_round(store, "ftis/run", rank, world, timeout, poll_s=0.005)


def _ranks(port: int, world: int, ranks, first: int | None = None, timeout_s: float = 20.0) -> dict:
    """These ranks of a world agree a round at once, each in a thread (`first` starts alone, 0.3 s ahead of the
    others); returns rank -> round, or the exception it raised."""
    import threading
    import time

    results = {}

    def run(rank):
        try:
            results[rank] = _round(port, rank, world, timeout_s)
        except Exception as exc:  # noqa: BLE001  (a rank that times out: the test says which)
            results[rank] = exc

    threads = {rank: threading.Thread(target=run, args=(rank,)) for rank in ranks}
    if first is not None:
        threads[first].start()
        time.sleep(0.3)
    for rank, thread in threads.items():
        if rank != first:
            thread.start()
    for thread in threads.values():
        thread.join(60)
    return results


def test_the_ranks_of_each_restart_round_agree_on_a_new_round_whatever_the_agents_counted():
    """The agent's store keeps every round's keys, and each node's agent counts its own restarts: the ranks agree a
    round number over the store instead, new each round, the same on every rank: when all arrive; when a rank
    arrives long before rank 0 and finds an earlier round published and opened (a node restarted first); after a
    round in which one rank never arrived (rank 0 timed out, its number is never taken); and after one in which a
    rank acknowledged and died before the go."""
    import datetime

    from torch.distributed import TCPStore

    from ftis_engine.run.wiring import agree_round

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the agent's store
    assert _ranks(server.port, 3, [0, 1, 2]) == {0: 1, 1: 1, 2: 1}
    assert _ranks(server.port, 3, [0, 1, 2], first=2) == {0: 2, 1: 2, 2: 2}  # round 1 published, opened: not taken
    lost = _ranks(server.port, 3, [0, 1], timeout_s=1.0)  # rank 2 never comes: rank 0 gives up on round 3
    assert isinstance(lost[0], Exception) and isinstance(lost[1], TimeoutError)
    assert _ranks(server.port, 3, [0, 1, 2], first=2) == {0: 4, 1: 4, 2: 4}  # rank 2 finds 3 published: waits on
    # rank 1 acknowledges round 5 and dies before the go (rank 0 of that round dies too)
    client = TCPStore("127.0.0.1", server.port, is_master=False)
    client.add("ftis/run/rounds", 1)
    client.set("ftis/run/round", "5")
    client.add("ftis/run/acknowledged/1", 5 - client.add("ftis/run/acknowledged/1", 0))
    client.set("ftis/run/5/ack/1", "1")
    assert _ranks(server.port, 3, [0, 1, 2], first=1) == {0: 6, 1: 6, 2: 6}
    one = datetime.timedelta(seconds=5)
    assert agree_round(client, "ftis/other", 0, 1, one) == 1 and agree_round(client, "ftis/other", 0, 1, one) == 2


def test_across_nodes_gloo_listens_on_the_interface_towards_the_master_where_the_hostname_means_loopback(
        monkeypatch):
    """Gloo listens where the hostname resolves; a name that resolves to loopback (Debian's 127.0.1.1) left ranks on
    other nodes unable to connect (gloo's 'Connect timeout' after minutes): a world on several nodes then gets the
    interface that holds the address towards MASTER_ADDR; GLOO_SOCKET_IFNAME given, one node, or a name that
    resolves elsewhere: gloo's own choice; no interface with that address: one line naming GLOO_SOCKET_IFNAME."""
    import socket

    from ftis_engine.run.wiring import gloo_interface, interface_of

    two_nodes = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.delenv("FTIS_LINKS_HOST", raising=False)
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    assert interface_of("127.0.0.1") == gloo_interface(two_nodes) is not None
    assert gloo_interface({**two_nodes, "GLOO_SOCKET_IFNAME": "eth7"}) is None
    assert gloo_interface({**two_nodes, "LOCAL_WORLD_SIZE": "2"}) is None
    monkeypatch.setenv("FTIS_LINKS_HOST", "192.0.2.1")  # an address no interface here holds
    with pytest.raises(ConfigError, match=r"^GLOO_SOCKET_IFNAME: this host's name resolves to 127\.0\.1\.1, .*"
                                          r"no interface holds 192\.0\.2\.1"):
        gloo_interface(two_nodes)
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "10.0.0.7")
    assert gloo_interface(two_nodes) is None


@pytest.mark.integration
def test_a_divergence_is_not_restarted_it_ends_the_swarm_once_with_its_one_line(tmp_path):
    """The elastic agent restarts on any failure: with swarm.max_restarts 2 a member whose step 1 blows its weights up
    (lr 1e30) resumed and diverged again, twice, printing its error three times (and, on a GPU, replaying every step
    since the checkpoint each time). A failure no restart mends ends the swarm at the first: one line, exit 1."""
    import subprocess
    import sys

    from .helpers import SHORT, TINY

    own_tmp = tmp_path / "tmp"  # the launcher's temp folder goes here: other tests running beside make theirs in /tmp
    own_tmp.mkdir()
    args = ["train", "--config", str(TINY), "--output-dir", str(tmp_path)]
    for o in [*SHORT, "run_name=swarm", "eval.every=0", "members.0.lr=1e30"]:
        args += ["--set", o]
    result = subprocess.run([sys.executable, "-m", "ftis_engine", *args, "--nproc", "2", "--max-restarts", "2"],
                            env={**os.environ, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1", "TMPDIR": str(own_tmp)},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    diverged = [line for line in result.stderr.splitlines() if "diverged" in line]
    assert len(diverged) == 1 and diverged[0].startswith("error: step 2: members.0 (tiny-s) diverged:"), result.stderr
    assert not [p for p in own_tmp.iterdir() if p.name.startswith("ftis-")]  # the launcher's exit-code folder is gone


def test_a_rank_killed_with_signal_9_ends_the_launch_with_one_line_naming_it_and_how_to_go_on(tmp_path, monkeypatch,
                                                                                                 capsys):
    """What the launcher says when the elastic agent reports a worker killed (kill -9 of one rank): its rank, member
    and signal, that the swarm stopped, and --resume (exit 1). In process, with the agent's failure report made up:
    test_swarm's kill -9 test (slow tier) proves it on real processes."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    from torch.distributed.launcher import api

    from ftis_engine.app.exits import FAILED
    from ftis_engine.app.launch import _launch

    inherited = []  # what the workers the agent starts would find in the environment

    def elastic_launch(config, entrypoint):
        def run(*args):
            inherited.append(os.environ.get("FTIS_FINAL_EXIT_FILE"))
            raise ChildFailedError("run_worker", {1: ProcessFailure(local_rank=1, pid=4242, exitcode=-9, error_file="")})
        return run

    monkeypatch.setattr(api, "elastic_launch", elastic_launch)
    monkeypatch.delenv("FTIS_FINAL_EXIT_FILE", raising=False)
    assert _launch(short_config(), tmp_path / "run", False, 2) == FAILED
    assert inherited[0].endswith("/final-exit") and not pathlib.Path(inherited[0]).parent.exists()  # its folder went
    err = capsys.readouterr().err
    assert "rank 1 (tiny-m-lora) failed with signal 9" in err, err
    assert err.startswith("error: swarm stopped: ") and "continue with --resume" in err
    assert os.environ.get("FTIS_FINAL_EXIT_FILE") is None  # the launcher's own setting does not outlive it


def test_the_process_count_is_checked_against_the_layout_in_one_place():
    """layout.check_processes: every rule on how many processes a run starts in, one line naming the field or the
    flag: one process takes neither samplers nor a member on several ranks (an eval takes anything, in one
    process), an eval across processes runs the members' ranks only, and a world's size is the layout's."""
    from ftis_engine.topology.layout import check_processes

    samplers, ranked = short_config("swarm.mode=async", "members.1.samplers=1"), short_config("members.0.ranks=2")
    with pytest.raises(ConfigError, match=r"^members\.1\.samplers: sampler ranks run in processes of their own: "
                                          r"--nproc 3 \(one per member rank and sampler\) or torchrun$"):
        check_processes(samplers, None)
    with pytest.raises(ConfigError, match=r"^members\.0\.ranks: a member on 2 ranks runs in processes of its own: "
                                          r"--nproc 3 \(or torchrun\)$"):
        check_processes(ranked, None)
    check_processes(samplers, None, evaluating=True)
    check_processes(ranked, None, evaluating=True)
    with pytest.raises(ConfigError, match=r"^members\.1\.samplers: eval runs the members' ranks only; add --set "
                                          r"members\.1\.samplers=0 \(samplers do not change the model\)$"):
        check_processes(samplers, 3, evaluating=True, given="--nproc 3")
    check_processes(samplers, 3, given="--nproc 3")
    with pytest.raises(ConfigError, match=r"^WORLD_SIZE=2: the config needs 3 processes \(one per member rank and "
                                          r"sampler: tiny-s on 2 rank\(s\), tiny-m-lora\)$"):
        check_processes(ranked, 2, given="WORLD_SIZE=2")
    check_processes(short_config(), None)
