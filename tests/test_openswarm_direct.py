"""The open swarm's direct exchange (openswarm/direct.py, swarm.peers_per_step): members send their parcels to the
peers they draw and to those that drew them, over CurveZMQ links that admit only live members' keys."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

pytest.importorskip("zmq")

from ftis_engine.openswarm.direct import PeerLinks, draw_peers  # noqa: E402

from .test_openswarm import until  # noqa: E402


def test_draws_are_k_distinct_live_peers_the_same_from_any_view_order_and_fresh_each_step():
    peers = [f"m{i}" for i in range(20)]
    draw = draw_peers(0, "m3", 5, peers, 4)
    assert len(set(draw)) == 4 and set(draw) <= set(peers)
    assert draw_peers(0, "m3", 5, list(reversed(peers)), 4) == draw  # every member computes the same draw
    assert draw_peers(0, "m3", 6, peers, 4) != draw or draw_peers(0, "m3", 7, peers, 4) != draw
    assert draw_peers(0, "m3", 5, peers[:2], 4) == sorted(peers[:2]) or set(draw_peers(0, "m3", 5, peers[:2], 4)) \
        == set(peers[:2])  # fewer than K listening: all of them
    # over many steps every peer is drawn about as often (each member is drawn by ~K others a step)
    counts = {p: 0 for p in peers}
    for step in range(1, 2001):
        for p in draw_peers(1, "m0", step, peers, 4):
            counts[p] += 1
    assert min(counts.values()) > 0.7 * 2000 * 4 / 20 and max(counts.values()) < 1.3 * 2000 * 4 / 20


class Swarm:
    """PeerLinks of several members in this process, over loopback, with one shared view (the membership's)."""

    def __init__(self, listening: list[str], behind_nat: list[str], k: int):
        self.view: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.got: dict[str, list] = {n: [] for n in [*listening, *behind_nat]}
        self.links: dict[str, PeerLinks] = {}
        for name in [*listening, *behind_nat]:
            def on_parcel(sender, step, version, body, mac, name=name):
                self.got[name].append((sender, step, version, body))

            links = PeerLinks(name, "tcp://127.0.0.1:*" if name in listening else None, k, 0, 1 << 20, on_parcel,
                              self.members)
            address = links.start()
            with self.lock:
                self.view[name] = {"step": 0, "tokenizer": "", "source": "", "address": address, "key": links.public}
            self.links[name] = links

    def members(self):
        with self.lock:
            return dict(self.view)

    def close(self):
        for links in self.links.values():
            links.close()


def body(step: int) -> bytes:
    return (b"\x01\x00\x00\x00" + bytes([step]) * 8)  # an honest parcel's size: whole words, at least one


def test_every_member_takes_the_parcels_of_the_peers_it_drew_and_of_those_that_drew_it_even_behind_a_nat():
    """K = 1 among four listening members and one behind a NAT: each sends its parcel of step 1 to the peer it
    draws; the one drawn answers over the same connection; so each member takes the parcel of every member it drew
    or that drew it, and one that only dials (nat) takes its drawn peer's."""
    swarm = Swarm(["a", "b", "c", "d"], ["nat"], k=1)
    try:
        listening = ["a", "b", "c", "d"]
        drawn = {n: draw_peers(0, n, 1, [p for p in listening if p != n], 1) for n in swarm.links}
        for n, links in swarm.links.items():
            links.publish(1, 0, body(1))
        expect = {n: set(drawn[n]) | {m for m in swarm.links if n in drawn[m]} for n in swarm.links}
        until(lambda: all({s for s, *_ in swarm.got[n]} == expect[n] for n in swarm.links), "every parcel")
        time.sleep(0.5)  # what else would come: a parcel twice (both routes share what each peer was sent)
        assert all(sorted(s for s, *_ in swarm.got[n]) == sorted(expect[n]) for n in swarm.links), swarm.got
        assert all(all(step == 1 and data == body(1) for _, step, _, data in swarm.got[n]) for n in swarm.links)
        assert all(links.refused == 0 for links in swarm.links.values())
    finally:
        swarm.close()


def test_a_stranger_cannot_connect_and_a_member_cannot_send_under_another_members_name():
    """Only live members' keys are admitted: a stranger's handshake fails (ZAP), so its parcel never arrives. A live
    member whose parcel names another live member is refused (counted), never taken under that name."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    from ftis_engine.openswarm.wire import pack

    swarm = Swarm(["a", "b", "c"], [], k=2)  # b sends to both others
    context = zmq.Context()
    try:
        target = swarm.view["a"]
        sockets = {}
        for name, (public, secret) in {"stranger": zmq.curve_keypair(),
                                       "b": (swarm.links["b"].public.encode(), swarm.links["b"].secret.encode())}.items():
            socket = sockets[name] = context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.curve_publickey, socket.curve_secretkey = public, secret
            socket.curve_serverkey = target["key"].encode()
            monitor = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED)
            socket.connect(target["address"])
            assert monitor.poll(30_000), "no handshake within 30 s"
            event = recv_monitor_message(monitor)["event"]
            assert event == (zmq.EVENT_HANDSHAKE_FAILED_AUTH if name == "stranger" else zmq.EVENT_HANDSHAKE_SUCCEEDED)
            # the stranger claims b's name (its connection failed: whatever it queues goes nowhere); b, live,
            # claims to be c, live too
            frames = pack("parcel", {"name": "b" if name == "stranger" else "c", "step": 1, "version": 0,
                                     "words": 3}, body(1))
            try:
                socket.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:  # no connection to queue on
                assert name == "stranger"
        until(lambda: swarm.links["a"].refused == 1, "b's forged name refused")
        swarm.links["b"].publish(1, 0, body(1))  # b's own parcel, under its own name, is taken
        until(lambda: ("b", 1, 0, body(1)) in swarm.got["a"], "b's parcel")
        assert all(sender == "b" for sender, *_ in swarm.got["a"])  # nothing of the stranger's, nothing under c
    finally:
        context.destroy(0)
        swarm.close()


DIRECT = ["--set", "swarm.peers_per_step=2"]


@pytest.mark.parametrize("argv, said", [
    (["--listen", "tcp://127.0.0.1:6000"], "error: --listen: only with --join"),
    (["--join", "tcp://127.0.0.1:5555", "--listen", "tcp://127.0.0.1:6000"],
     "error: --listen: this swarm's parcels go through its coordinator (swarm.peers_per_step is null)"),
    (["--join", "tcp://127.0.0.1:5555", "--listen", "tcp://*:6000", *DIRECT],
     "error: --listen: 'tcp://*:6000' has '*' for its host"),
    (["--join", "tcp://127.0.0.1:5555", "--listen", "ipc:///tmp/x", *DIRECT],
     "error: --listen: 'ipc:///tmp/x' is not an address like tcp://HOST:PORT"),
    (["--join", "tcp://127.0.0.1:5555", "--listen", "tcp://" + "h" * 60 + ":6000", *DIRECT],
     "error: --listen: 'tcp://hhh"),
    (["--join", "tcp://127.0.0.1:5555", *DIRECT, "--set", "members.0.ranks=2"],
     "error: members.0.ranks: a member on several ranks exchanges through the coordinator's relay only"),
])
def test_a_listen_address_or_setting_that_cannot_be_is_one_line_and_leaves_nothing(tmp_path, capsys, argv, said):
    from .helpers import ROOT, command_here

    done = command_here(capsys, "train", "--config", ROOT / "configs/swarm/tiny-s.yaml", *argv, "--output-dir",
                        tmp_path / "runs")
    (line,) = done.stderr.splitlines()
    assert done.returncode == 2 and line.startswith(said), done.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("hivemind, argv, said", [
    (False, ["--join", "dht:", *DIRECT],
     "error: --join: 'dht:' needs hivemind for its DHT: pip install 'ftis-engine[dht]'"),
    (True, ["--join", "dht:"],
     "error: --join: 'dht:' has no coordinator to relay parcels: a swarm on a DHT exchanges directly (set "
     "swarm.peers_per_step)"),
    (True, ["--join", "dht:/ip4/10.0.0.1/tcp/4000/p2p/Qm,10.0.0.2:4000", *DIRECT],
     "error: --join: 'dht:/ip4/10.0.0.1/tcp/4000/p2p/Qm,10.0.0.2:4000' has '10.0.0.2:4000', which is no multiaddr"),
    (True, ["--join", "dht:", "--listen", "tcp://localhost:6000", *DIRECT],
     "error: --listen: 'tcp://localhost:6000' is not at an IPv4 address, where a member on a DHT listens for it too"),
])
def test_a_dht_join_that_cannot_be_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch, hivemind, argv,
                                                                  said):
    """`--join dht:` (openswarm/dht.py) refuses before anything starts: hivemind absent (with it or without it here:
    find_spec is patched either way), a swarm relayed through a coordinator, a bootstrap that is no multiaddr, a
    --listen host that is a name."""
    import importlib.util

    from .helpers import ROOT, command_here

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: (object() if hivemind else None)
                        if name == "hivemind" else find_spec(name, *rest))
    done = command_here(capsys, "train", "--config", ROOT / "configs/swarm/tiny-s.yaml", *argv, "--output-dir",
                        tmp_path / "runs")
    (line,) = done.stderr.splitlines()
    assert done.returncode == 2 and line.startswith(said), done.stderr
    assert not (tmp_path / "runs").exists()


def test_links_that_cannot_listen_at_an_address_say_so_in_one_line():
    """An address in use (another socket holds the port): ListenError naming it, not a thread's traceback."""
    import socket

    from ftis_engine.openswarm.direct import ListenError

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    links = PeerLinks("a", f"tcp://127.0.0.1:{port}", 2, 0, 1 << 20, lambda *a: None, dict)
    try:
        with pytest.raises(ListenError, match=f"'tcp://127.0.0.1:{port}': cannot listen there"):
            links.start()
    finally:
        links.close()
        holder.close()


@pytest.mark.slow
def test_two_members_one_behind_a_nat_train_on_each_others_rollouts_sent_directly_and_nothing_is_relayed(tmp_path):
    """Two member jobs with swarm.peers_per_step=1: tiny-s listens, tiny-m-lora only dials (no --listen, as behind a
    NAT). Each trains on the other's parcels (admitted: dealt by name and step, re-scored, none rejected), and the
    coordinator, which keeps membership only, relays nothing."""
    from ftis_engine.openswarm.client import SwarmClient
    from ftis_engine.openswarm.coordinator import Coordinator

    from .ports import free_port
    from .test_openswarm import Running, _member_args, _member_hashes, assert_trained_on_each_other

    steps, direct = 6, "swarm.peers_per_step=1"
    tokenizer, shared, dataset = _member_hashes(steps, direct)
    coordinator = Coordinator(shared, lease_s=600.0, max_body=1 << 22)
    running = Running(coordinator=coordinator)
    # a member alone has nobody to wait for: a metronome (it sends nothing, listens nowhere) holds both at step 2
    metronome = SwarmClient(running.address, "metronome", tokenizer, shared, dataset, 1 << 22, lambda *args: None)
    metronome.start(timeout=30)
    procs = []
    try:
        for name, listen in (("tiny-s", ["--listen", f"tcp://127.0.0.1:{free_port()}"]), ("tiny-m-lora", [])):
            log = open(tmp_path / f"{name}.log", "w")
            procs.append(subprocess.Popen([*_member_args(tmp_path, name, running.address, steps, direct), *listen],
                                          stdout=log, stderr=subprocess.STDOUT))
        until(lambda: {"tiny-s", "tiny-m-lora"} <= set(metronome.members()), "both to join", timeout=300)
        assert metronome.members()["tiny-s"]["address"] and not metronome.members()["tiny-m-lora"]["address"]
        metronome.step = steps
        assert all(p.wait(600) == 0 for p in procs), (tmp_path / "tiny-s.log").read_text()[-2000:]
        assert_trained_on_each_other(tmp_path, steps)
        assert coordinator.relayed == 0 and coordinator.refused == 0  # nobody sent it a parcel
    finally:
        metronome.close()
        for p in procs:
            p.kill()
        running.close()


def test_a_key_that_is_not_one_or_is_another_live_members_is_refused_at_join():
    """A key of 40 Z85 characters that decodes past 2^32 a chunk (libzmq refuses it: a socket given one raises, which
    ended the dialling member's thread) is refused at join; so is a key another live member announced (its peers
    would take one member's parcels as the other's and refuse the rest)."""
    import zmq

    from ftis_engine.openswarm.coordinator import Coordinator
    from ftis_engine.openswarm.rules import join_problem
    from ftis_engine.openswarm.wire import pack, unpack

    from .test_openswarm import DATA, SHARED, TOKENIZER

    good = zmq.curve_keypair()[0].decode()
    fields = {"name": "a", "tokenizer": TOKENIZER, "source": "", "dataset": DATA, "address": "tcp://10.0.0.1:6000"}
    assert join_problem({**fields, "key": good}) is None
    assert "not a CurveZMQ public key" in join_problem({**fields, "key": "#" * 40})
    assert "IPv6" in join_problem({**fields, "address": "tcp://[::1]:6000", "key": good})
    shared = {**SHARED, "swarm": {"peers_per_step": 2}}
    coordinator = Coordinator(shared, lease_s=10, max_body=100)

    def join(identity, name):
        header = {**fields, "name": name, "shared": shared, "step": 0, "key": good}
        out = coordinator.handle(identity, pack("join", header), 0.0)
        return unpack(out[0][1], 100)

    assert join(b"1", "a")[0] == "welcome"
    kind, header, _ = join(b"2", "b")
    assert kind == "refuse" and header["reason"].startswith("key: another live member announced this link key")

