"""exchange/links.py in one process: two ranks' links over an in-memory stand-in for gloo's send and recv, so that
leaving (DONE), a lost peer and a thread's own failure are each tested without processes or timing."""

from __future__ import annotations

import queue
import threading

import pytest
import torch

from ftis_engine.exchange import links as links_module
from ftis_engine.exchange.links import DATA, Links, PeerLost, TransportError


class Fabric:
    """dist.send / dist.recv between ranks of one process: a queue per (source, destination, tag). A rank that is
    'killed' makes every receive from it and every send to it fail, as gloo does when a connection closes."""

    def __init__(self):
        self.queues: dict[tuple[int, int, int], queue.Queue] = {}
        self.dead: set[int] = set()
        self.lock = threading.Lock()

    def _queue(self, src: int, dst: int, tag: int) -> queue.Queue:
        with self.lock:
            return self.queues.setdefault((src, dst, tag), queue.Queue())

    def send(self, tensor, group, tag, group_dst):
        if group_dst in self.dead or group.rank in self.dead:
            raise RuntimeError("Connection closed by peer")
        self._queue(group.rank, group_dst, tag).put(tensor.clone())

    def recv(self, tensor, group, tag, group_src):
        box = self._queue(group_src, group.rank, tag)
        while True:
            if group_src in self.dead or group.rank in self.dead:
                raise RuntimeError("Connection closed by peer")
            try:
                tensor.copy_(box.get(timeout=0.02))
                return
            except queue.Empty:
                continue


class Group:
    def __init__(self, rank: int):
        self.rank = rank


class Handler:
    def __init__(self, fail: bool = False):
        self.delivered: list[tuple[int, int, int, list[int]]] = []
        self.fail = fail

    def body_limit(self, peer, kind, step, version, size):
        return 100

    def deliver(self, peer, kind, step, version, body, refused):
        if self.fail:
            raise ValueError("injected fault in deliver")
        self.delivered.append((peer, kind, step, body.tolist()))


@pytest.fixture
def pair(monkeypatch):
    fabric = Fabric()
    monkeypatch.setattr(links_module, "dist", fabric)

    def make(fail_at: int | None = None):
        handlers = [Handler(fail=rank == fail_at) for rank in (0, 1)]
        ranks = [Links(rank, 2, timeout_s=5.0, outbox_capacity=4, group=Group(rank)) for rank in (0, 1)]
        for link, handler in zip(ranks, handlers):
            link.start(handler)
        return fabric, ranks, handlers

    return make


def test_a_parcel_arrives_and_both_ranks_leave_after_saying_done(pair):
    fabric, (zero, one), (_, handler) = pair()
    assert zero.post_parcel(1, 3, 2, torch.arange(5, dtype=torch.int32))
    one.wait_until(lambda: handler.delivered, 5.0, "the parcel")
    assert handler.delivered == [(0, DATA, 3, [0, 1, 2, 3, 4])]
    leaving = threading.Thread(target=zero.finish)
    leaving.start()
    one.wait_until(lambda: one.peer_done(0), 5.0, "rank 0's DONE")
    assert not one.post_parcel(0, 4, 3, torch.ones(2, dtype=torch.int32))  # nothing is queued for a peer that left
    one.finish()
    leaving.join(5.0)
    assert not leaving.is_alive() and zero.peer_done(1)
    zero.check()
    one.check()  # leaving is no error


def test_a_peer_whose_connection_closes_without_done_is_lost_and_check_says_so(pair):
    fabric, (zero, one), _ = pair()
    fabric.dead.add(1)  # rank 1 is killed
    with pytest.raises(PeerLost, match=r"peer rank 1 is gone without finishing \(receive failed: Connection closed"):
        zero.wait_until(lambda: False, 5.0, "nothing")
    assert zero.peer_done(1)  # it holds nobody back any more


def test_an_error_in_a_receive_thread_is_a_transport_error_with_its_cause_not_a_lost_peer(pair):
    fabric, (zero, one), _ = pair(fail_at=1)
    zero.post_parcel(1, 1, 0, torch.ones(3, dtype=torch.int32))
    with pytest.raises(TransportError, match=r"rank 1: the receive thread for peer rank 0 failed: ValueError: "
                                             r"injected fault in deliver") as caught:
        one.wait_until(lambda: False, 5.0, "nothing")
    assert isinstance(caught.value.__cause__, ValueError)
