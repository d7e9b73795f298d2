"""The open swarm across hosts: the coordinator and each member in its own network namespace, joined through a
router by veth links with real delay and packet loss (tests/netlab.py: tc netem where the kernel has it, else a
shaper of real packets on a TUN device). Needs root; skipped with the reason where namespaces cannot be made.

Cases: a member killed with kill -9 mid-run while the others keep stepping, then resumed and rejoined; a member
joining mid-run over a link with 200 ms delay and 5% loss, trained on by both old members; the coordinator killed
with kill -9 and restarted while members train (they wait, rejoin, go on; nothing trained twice); direct exchange
(swarm.peers_per_step) with a member behind a NAT."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("zmq")

from .netlab import Link, NetLab  # noqa: E402

REASON = NetLab.unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=f"network namespaces: {REASON}")]

PORT = 5555
OVERRIDES = ("rollout.group_size=4", "rollout.prompts_per_step=2")


def serve(lab, tmp_path, steps, n, lease_s):
    """`ftis-engine swarm serve` on the coord host (its n-th start; every start writes tmp_path/coord.0, as an
    operator restarting it would), its stderr in tmp_path/coord.n.log."""
    from .helpers import ROOT

    args = [sys.executable, "-m", "ftis_engine", "swarm", "serve", "--config", str(ROOT / "configs/swarm/swarm.yaml"),
            "--bind", f"tcp://{lab.address('coord')}:{PORT}", "--output-dir", str(tmp_path / "coord.0")]
    for override in (f"train.steps={steps}", *OVERRIDES, f"swarm.lease_s={lease_s}"):
        args += ["--set", override]
    return lab.popen("coord", args, stderr=open(tmp_path / f"coord.{n}.log", "w"))


def coordinator_events(tmp_path):
    path = tmp_path / "coord.0" / "coordinator.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.is_file() else []


def live(tmp_path):
    events = coordinator_events(tmp_path)  # the newest record with the live list (a start record has none)
    return next((set(r["live"]) for r in reversed(events) if "live" in r), set())


class Members:
    """Member jobs (train --join) on their hosts; killed with the lab."""

    def __init__(self, lab, tmp_path, steps):
        self.lab, self.tmp_path, self.steps, self.started = lab, tmp_path, steps, 0
        self.address = f"tcp://{lab.address('coord')}:{PORT}"

    def start(self, name, resume=False):
        from .test_openswarm import _member_args

        self.started += 1
        log = open(self.tmp_path / f"{name}.{self.started}.log", "w")
        return self.lab.popen(name, _member_args(self.tmp_path, name, self.address, self.steps, resume=resume),
                              stdout=log, stderr=subprocess.STDOUT)

    def logs(self):
        return [f.read_text()[-1500:] for f in sorted(self.tmp_path.glob("tiny-*.log"))]


def steps_of(tmp_path, name):
    from .test_openswarm import _train_records

    return len(_train_records(tmp_path, name))


def start_swarm(lab, tmp_path, steps):
    """`swarm serve` on the coord host (lease 5 s), the metronome, and the Members of this lab."""
    from .test_openswarm import until

    coordinator = serve(lab, tmp_path, steps, 0, lease_s=5)
    until(lambda: (tmp_path / "coord.0" / "coordinator.jsonl").exists() or coordinator.poll() is not None,
          "the coordinator", timeout=120)
    return coordinator, metronome_for(lab, steps), Members(lab, tmp_path, steps)


def metronome_for(lab, steps):
    """A live member of the same tokenizer that sends no rollouts, on this test process's own link: the members
    stay within swarm.max_lead=2 of the step the test lets it publish (tiny steps take a fraction of a second)."""
    from ftis_engine.openswarm.client import SwarmClient

    from .test_openswarm import _member_hashes

    metronome = SwarmClient(f"tcp://{lab.address('coord')}:{PORT}", "metronome", *_member_hashes(steps), 1 << 22,
                            lambda *args: None)
    metronome.start(timeout=60)
    return metronome


PROBE = """
import socket, sys, time
mode, address = sys.argv[1], sys.argv[2]
if mode == "serve-tcp":
    s = socket.socket(); s.bind((address, 7000)); s.listen(); print("up", flush=True)
    while True:
        s.accept()
elif mode == "serve-udp":
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((address, 7001)); s.settimeout(3)
    print("up", flush=True); n = 0
    try:
        while True:
            s.recv(100); n += 1
    except socket.timeout:
        print(n, flush=True)
elif mode == "connect":
    for _ in range(5):
        socket.create_connection((address, 7000), timeout=10).close()
    print("connected", flush=True)
else:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for i in range(int(mode)):
        s.sendto(b"x", (address, 7001)); time.sleep(0.001)
"""


def test_a_join_sent_before_a_slow_connection_is_up_goes_out_once_it_is(tmp_path):
    """ZMQ_IMMEDIATE drops what is sent before the connection is up, and over a link of 100 ms the first join always
    is: the client tries it again every turn until it leaves, instead of after two beats (every member waited 2 s
    to be welcomed; with beats of 30 s, as here, a minute). One join left and was answered: the client counts one."""
    from ftis_engine.openswarm.client import SwarmClient

    from .test_openswarm import _member_hashes, until

    with NetLab({"coord": Link(delay_ms=100)}) as lab:
        coordinator = serve(lab, tmp_path, 4, 0, lease_s=5)
        until(lambda: (tmp_path / "coord.0" / "coordinator.jsonl").exists() or coordinator.poll() is not None,
              "the coordinator", timeout=120)
        member = SwarmClient(f"tcp://{lab.address('coord')}:{PORT}", "a", *_member_hashes(4), 1 << 22,
                             lambda *args: None, beat_s=30.0)
        try:
            member.start(timeout=30)  # a join repeated only after two beats would time out here
            assert set(member.members()) == {"a"} and member.joins == 1
        finally:
            member.close()


def test_the_lab_gives_each_link_its_delay_and_loss():
    """The lab's oracle: every packet between a host with a 100 ms link and one with a 0 ms link (TCP connects, both
    ways) is held 100 ms, and one between two 0 ms links is held 0 ms, by the shaper's own record of what it did,
    not by a clock (a loaded machine adds delays of its own); of 1,000 datagrams crossing a link with 10% loss, 900
    arrive (within five standard deviations). The lab shapes with its TUN shaper here: netem keeps no such record."""
    if not os.path.exists("/dev/net/tun"):
        pytest.skip("no /dev/net/tun: the TUN shaper, whose record this test reads, cannot run here")
    with NetLab({"near": Link(), "far": Link(delay_ms=100), "lossy": Link(loss=0.10)}, shaping="tun") as lab:
        up = lab.popen("near", [sys.executable, "-c", PROBE, "serve-tcp", lab.address("near")], stdout=subprocess.PIPE,
                       text=True)
        assert up.stdout.readline().strip() == "up"
        connected = lab.popen("far", [sys.executable, "-c", PROBE, "connect", lab.address("near")],
                              stdout=subprocess.PIPE, text=True).communicate(timeout=60)[0]
        assert connected.strip() == "connected"
        sink = lab.popen("near", [sys.executable, "-c", PROBE, "serve-udp", lab.address("near")],
                         stdout=subprocess.PIPE, text=True)
        assert sink.stdout.readline().strip() == "up"
        lab.popen("lossy", [sys.executable, "-c", PROBE, "1000", lab.address("near")]).wait(60)
        received = int(sink.stdout.readline())
        assert abs(received - 900) <= 5 * (1000 * 0.9 * 0.1) ** 0.5, (received, lab.shaping)
        shaped = lab.shaped()
        # the hosts' packets only: the test process's own link ("here") may carry a stray packet of an earlier test
        # in this worker (a ZeroMQ socket that dialled 10.213.1.2, this lab's "near", in its lab), no part of this
        assert {pair: sorted(held) for pair, held in shaped.items() if "here" not in pair} == {
            ("far", "near"): [100], ("near", "far"): [100], ("lossy", "near"): [0]}, shaped
        assert shaped["far", "near"][100] >= 5 and shaped["lossy", "near"][0] >= received  # (5 SYNs, at least)


def test_a_lab_left_by_a_killed_run_is_cleared_and_a_new_lab_builds():
    """A run killed with its lab open leaves namespaces, a link and a route to the hosts' subnet (which made the next
    lab's `ip route add` fail); the next lab deletes what dead processes left and builds."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    tag = f"fs{dead.pid}"
    subprocess.run(["ip", "netns", "add", f"{tag}-router"], check=True)
    subprocess.run(["ip", "link", "add", f"{tag}l", "type", "veth", "peer", "name", "r254", "netns", f"{tag}-router"],
                   check=True)
    subprocess.run(["ip", "addr", "add", "10.213.254.2/24", "dev", f"{tag}l"], check=True)
    subprocess.run(["ip", "link", "set", f"{tag}l", "up"], check=True)
    subprocess.run(["ip", "route", "add", "10.213.0.0/16", "via", "10.213.254.1"], check=True)
    try:
        with NetLab({"a": Link()}) as lab:
            assert lab.namespaces["a"] in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                         text=True).stdout
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert tag not in names and tag not in subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    finally:
        subprocess.run(["ip", "netns", "del", f"{tag}-router"], capture_output=True)
        subprocess.run(["ip", "link", "del", f"{tag}l"], capture_output=True)


def test_a_lab_waits_for_the_lab_another_process_holds_and_builds_when_it_is_gone():
    """Two test sessions on one machine: a lab opened while another process holds one waits for it (they would share
    the subnet) instead of failing, and builds once that lab is closed."""
    from .helpers import ROOT

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from tests.netlab import Link, NetLab\n"
         "with NetLab({'a': Link()}):\n    print('up', flush=True); sys.stdin.readline()"],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "up"
        timer = threading.Timer(2.0, holder.stdin.close)  # the holder closes its lab once we are waiting
        timer.start()
        with NetLab({"b": Link()}) as lab:
            assert holder.wait(30) == 0  # it closed its lab (and ours was built only then) and exited cleanly
            assert lab.namespaces["b"] in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                         text=True).stdout
        timer.join()
    finally:
        holder.kill()
        holder.wait()


def test_across_hosts_a_killed_member_rejoins_and_a_newcomer_over_a_lossy_link_is_trained_on(tmp_path):
    from .test_openswarm import _train_records, until

    steps = 30

    hosts = {"coord": Link(), "tiny-s": Link(), "tiny-m-lora": Link(), "tiny-l": Link(delay_ms=200, loss=0.05)}
    with NetLab(hosts) as lab:
        coordinator, metronome, members = start_swarm(lab, tmp_path, steps)
        try:
            a = members.start("tiny-s")
            b = members.start("tiny-m-lora")
            metronome.step = 3  # the members may step up to 5
            until(lambda: steps_of(tmp_path, "tiny-m-lora") >= 5, "tiny-m-lora's step 5", timeout=300)
            os.kill(b.pid, signal.SIGKILL)
            b.wait(10)
            killed_at = steps_of(tmp_path, "tiny-m-lora")
            until(lambda: "tiny-m-lora" not in live(tmp_path), "tiny-m-lora's lease to expire")
            metronome.step = 8
            until(lambda: steps_of(tmp_path, "tiny-s") >= 10, "tiny-s to step on without it", timeout=300)
            b = members.start("tiny-m-lora", resume=True)
            until(lambda: "tiny-m-lora" in live(tmp_path), "tiny-m-lora to rejoin", timeout=300)
            metronome.step = 13
            until(lambda: steps_of(tmp_path, "tiny-s") >= 15, "tiny-s's step 15", timeout=300)
            c = members.start("tiny-l")  # over 200 ms and 5% loss each way
            until(lambda: "tiny-l" in live(tmp_path), "tiny-l to join", timeout=300)
            metronome.step = steps
            for p in (a, b, c):
                assert p.wait(900) == 0, members.logs()
            metronome.close()
            tiny_s = _train_records(tmp_path, "tiny-s")
            assert [r["step"] for r in tiny_s] == list(range(1, steps + 1))  # never stopped, no gap
            for name in ("tiny-s", "tiny-m-lora", "tiny-l"):
                records = _train_records(tmp_path, name)
                assert all(r["rejected_batches"] == 0 for r in records), name
                used = [k for r in records for k in r["received_sha256"]]
                assert len(used) == len(set(used)), f"{name} trained on a parcel twice"
            resumed = _train_records(tmp_path, "tiny-m-lora")[killed_at:]
            assert any(k.startswith("tiny-s@") for r in resumed for k in r["received_sha256"])
            back = [int(k.split("@")[1]) for r in tiny_s for k in r["received_sha256"] if k.startswith("tiny-m-lora@")]
            assert back and max(back) > killed_at  # its rollouts after the rejoin
            for old in ("tiny-s", "tiny-m-lora"):  # the newcomer's rollouts crossed the lossy link and were used
                assert any(k.startswith("tiny-l@") for r in _train_records(tmp_path, old)
                           for k in r["received_sha256"]), old
            events = [(r["event"], r["member"]) for r in coordinator_events(tmp_path)]
            assert ("expired", "tiny-m-lora") in events and events.count(("join", "tiny-m-lora")) == 2
            assert ("join", "tiny-l") in events
        finally:
            metronome.close()


def test_across_hosts_the_coordinator_killed_and_restarted_members_wait_rejoin_and_train_nothing_twice(tmp_path):
    from .test_openswarm import _train_records, until

    steps = 16

    hosts = {"coord": Link(delay_ms=20), "tiny-s": Link(delay_ms=20), "tiny-m-lora": Link(delay_ms=50, loss=0.02)}
    with NetLab(hosts) as lab:
        coordinator, metronome, members = start_swarm(lab, tmp_path, steps)
        try:
            a = members.start("tiny-s")
            b = members.start("tiny-m-lora")
            metronome.step = 3
            until(lambda: min(steps_of(tmp_path, name) for name in ("tiny-s", "tiny-m-lora")) >= 5, "both at step 5",
                  timeout=300)
            coordinator.kill()
            coordinator.wait(10)
            down_at = {name: steps_of(tmp_path, name) for name in ("tiny-s", "tiny-m-lora")}
            metronome.step = steps  # nothing holds them now but the coordinator's absence
            time.sleep(3)
            coordinator = serve(lab, tmp_path, steps, 1, lease_s=5)

            def rejoined():
                events = coordinator_events(tmp_path)
                restored = [i for i, r in enumerate(events) if r["event"] == "restored"]
                return {r["member"] for r in events[restored[0]:] if r["event"] == "rejoin"} if restored else set()

            until(lambda: {"tiny-s", "tiny-m-lora"} <= rejoined(), "both to rejoin the new coordinator", timeout=120)
            for p in (a, b):
                assert p.wait(900) == 0, members.logs()
            metronome.close()
            for me, peer in (("tiny-s", "tiny-m-lora"), ("tiny-m-lora", "tiny-s")):
                records = _train_records(tmp_path, me)
                assert [r["step"] for r in records] == list(range(1, steps + 1))  # each step trained once
                used = [k for r in records for k in r["received_sha256"]]
                assert len(used) == len(set(used)), f"{me} trained on a parcel twice"
                after = [k for r in records[down_at[me] + 1:] for k in r["received_sha256"]]
                assert any(k.startswith(f"{peer}@") for k in after), f"{me} got nothing from {peer} after the restart"
            assert coordinator.poll() is None  # still serving; the lab kills it
        finally:
            metronome.close()


def test_one_world_async_ranks_on_two_hosts_reach_each_other_over_zeromq_on_their_advertised_addresses(tmp_path):
    """The one-world async mode (not the open swarm) across two hosts: rank 0 on host a, rank 1 on host b behind a
    link with 50 ms delay and 2% loss, launched as torchrun would (MASTER_ADDR: host a). Each binds its links
    socket on its address towards MASTER_ADDR and dials the other's: both train on each other's rollouts to the
    end. A wrong advertised address (loopback) would leave each peer unreachable: lost, exit 1."""
    from .test_async_swarm import ASYNC
    from .ports import free_port
    from .helpers import run_records
    from .test_swarm import _args, _env

    with NetLab({"a": Link(), "b": Link(delay_ms=50, loss=0.02)}) as lab:
        port, procs = free_port(), []
        args = _args(tmp_path, "train.steps=6", *ASYNC, "swarm.timeout_s=60")
        for rank, host in enumerate(("a", "b")):
            env = _env(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
                       MASTER_ADDR=lab.address("a"), MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="v0")
            procs.append(lab.popen(host, [sys.executable, os.path.join(os.path.dirname(__file__), "swarm_worker.py"),
                                          "none", *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   text=True))
        results = [(p.wait(timeout=400), p.stderr.read()[-2000:]) for p in procs]
    assert [code for code, _ in results] == [0, 0], results
    records = run_records(tmp_path / "swarm", "train")
    for name in ("tiny-s", "tiny-m-lora"):
        mine = [r for r in records if r["member"] == name]
        assert [r["step"] for r in mine] == list(range(1, 7)), name
        assert sum(r["peer_sequences"] for r in mine) > 0 and all(r["rejected_batches"] == 0 for r in mine), name


def test_across_hosts_a_member_behind_a_nat_exchanges_directly_with_one_that_listens(tmp_path):
    """swarm.peers_per_step=1 across hosts: tiny-s listens on its host; tiny-m-lora's host is behind a NAT (the lab
    drops every connection dialled to it: a TCP connect to it times out, where a host without a listener would refuse
    at once). The member behind the NAT only dials: what it takes of tiny-s comes back over the connection it dialled
    (none can be dialled to it), what tiny-s takes of it goes out over that same connection; both train on each
    other's parcels, none rejected, over links of 50 ms each way."""
    import socket

    from ftis_engine.openswarm.client import SwarmClient

    from .helpers import ROOT
    from .test_openswarm import _member_args, _member_hashes, assert_trained_on_each_other, until

    if not os.path.exists("/dev/net/tun"):
        pytest.skip("no /dev/net/tun: the TUN shaper, which plays the NAT, cannot run here")
    steps, direct = 6, "swarm.peers_per_step=1"
    hosts = {"coord": Link(), "tiny-s": Link(delay_ms=50), "tiny-m-lora": Link(delay_ms=50, dial_out_only=True)}
    with NetLab(hosts) as lab:
        address = f"tcp://{lab.address('coord')}:{PORT}"
        serve_args = [sys.executable, "-m", "ftis_engine", "swarm", "serve", "--config",
                      str(ROOT / "configs/swarm/swarm.yaml"), "--bind", address, "--output-dir", str(tmp_path / "c")]
        for override in (f"train.steps={steps}", *OVERRIDES, "swarm.lease_s=5", direct):
            serve_args += ["--set", override]
        coordinator = lab.popen("coord", serve_args, stderr=open(tmp_path / "coord.log", "w"))
        until(lambda: (tmp_path / "c" / "coordinator.jsonl").exists() or coordinator.poll() is not None,
              "the coordinator", timeout=120)
        metronome = SwarmClient(address, "metronome", *_member_hashes(steps, direct), 1 << 22, lambda *args: None)
        metronome.start(timeout=60)
        procs = []
        try:
            for name in ("tiny-s", "tiny-m-lora"):
                listen = ["--listen", f"tcp://{lab.address(name)}:{PORT + 1}"] if name == "tiny-s" else []
                procs.append(lab.popen(name, [*_member_args(tmp_path, name, address, steps, direct), *listen],
                                       stdout=open(tmp_path / f"{name}.log", "w"), stderr=subprocess.STDOUT))
            until(lambda: {"tiny-s", "tiny-m-lora"} <= set(metronome.members()), "both to join", timeout=300)
            with pytest.raises((TimeoutError, socket.timeout)):  # behind the NAT: nothing dialled to it opens
                socket.create_connection((lab.address("tiny-m-lora"), PORT + 1), timeout=2)
            metronome.step = steps
            assert all(p.wait(600) == 0 for p in procs), (tmp_path / "tiny-m-lora.log").read_text()[-2000:]
            assert_trained_on_each_other(tmp_path, steps)
            assert lab.shaped()[("here", "tiny-m-lora")].get("syn-dropped", 0) >= 1
        finally:
            metronome.close()

