"""The open swarm's direct exchange (openswarm/direct.py, swarm.peers_per_step): members send their parcels to the
peers they draw and to those that drew them, over CurveZMQ links that admit only live members' keys."""

from __future__ import annotations

import threading

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
        assert all(all(step == 1 and data == body(1) for _, step, _, data in swarm.got[n]) for n in swarm.links)
        assert all(links.refused == 0 for links in swarm.links.values())
    finally:
        swarm.close()


def test_a_stranger_cannot_connect_and_a_member_cannot_send_under_another_members_name():
    """Only live members' keys are admitted: a stranger's parcel never arrives. A live member whose parcel says it is
    another member is refused (counted), never taken under that name."""
    import zmq

    from ftis_engine.openswarm.wire import pack

    swarm = Swarm(["a", "b"], [], k=1)
    context = zmq.Context()
    try:
        target = swarm.view["a"]
        for name, (public, secret) in {"stranger": zmq.curve_keypair(),
                                       "b": (swarm.links["b"].public.encode(), swarm.links["b"].secret.encode())}.items():
            socket = context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.curve_publickey, socket.curve_secretkey = public, secret
            socket.curve_serverkey = target["key"].encode()
            socket.connect(target["address"])
            # the stranger claims b's name; b (a live member) claims to be a third member
            claimed = "b" if name == "stranger" else "c"
            socket.send_multipart(pack("parcel", {"name": claimed, "step": 1, "version": 0, "words": 3}, body(1)))
        until(lambda: swarm.links["a"].refused == 1, "b's forged name refused")
        swarm.links["b"].publish(1, 0, body(1))  # b's own parcel, under its own name, is taken
        until(lambda: swarm.got["a"], "b's parcel")
        assert swarm.got["a"] == [("b", 1, 0, body(1))]  # nothing of the stranger's, nothing under "c"
    finally:
        context.destroy(0)
        swarm.close()
