"""exchange/links.py in one process, over real ZeroMQ sockets on loopback: ranks' links whose address gather is an
in-memory stand-in for the gloo collective, so leaving (DONE), a lost peer (killed, silent, never up), what a
liar can send and a failure of this code are each tested without launching processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from ftis_engine.exchange import links as links_module
from ftis_engine.exchange.links import DATA, DONE, HEADER, MAGIC, TAKEN, Links, PeerLost, TransportError

from .ports import free_port

zmq = pytest.importorskip("zmq")


class Gather:
    """all_gather_object over threads: each rank's address, once all have given theirs."""

    def __init__(self, world: int, fixed: dict[int, str] | None = None):
        self.addresses: dict[int, str] = dict(fixed or {})
        self.barrier = threading.Barrier(world - len(self.addresses))

    def of(self, rank: int):
        def gather(address: str) -> list[str]:
            self.addresses[rank] = address
            self.barrier.wait(10)
            return [self.addresses[r] for r in sorted(self.addresses)]
        return gather


class Handler:
    def __init__(self, fail: bool = False, limit: int = 100):
        self.delivered: list[tuple[int, int, int, list[int], str | None]] = []
        self.fail = fail
        self.limit = limit

    def body_limit(self, peer, kind, step, version, size):
        return self.limit

    def deliver(self, peer, kind, step, version, body, refused):
        if self.fail:
            raise ValueError("injected fault in deliver")
        self.delivered.append((peer, kind, step, body.tolist(), refused))


class Clock:
    """The links' clock (Links(clock=...)), moved by the test alone; every read is counted, so a test can wait until
    the I/O thread has taken whole turns of its loop (one read each) on the time it set."""

    def __init__(self):
        self.now = 0.0
        self.reads = 0
        self.read = threading.Condition()

    def __call__(self) -> float:
        with self.read:
            self.reads += 1
            self.read.notify_all()
            return self.now

    def set(self, now: float) -> None:
        """Move the clock to `now`, then wait until the I/O thread has read it twice: the turn that read it first
        has finished by its second read, so whatever it decides on that time has been decided."""
        with self.read:
            self.now = now
            seen = self.reads
            assert self.read.wait_for(lambda: self.reads >= seen + 2, 10.0), "the links' I/O thread stopped turning"


def wait_until(links: Links, ready, timeout_s: float, what: str) -> float:
    """Links.wait, raising TimeoutError naming `what` after timeout_s (as the pacer's waits do); the seconds waited."""
    seconds, held = links.wait(ready, timeout_s, what)
    if not held:
        raise TimeoutError(f"swarm.timeout_s: waited {timeout_s:g} s for {what}")
    return seconds


def start(world: int = 2, timeout_s: float = 10.0, fail_at: int | None = None, max_words: int = 100,
          fixed: dict[int, str] | None = None, limit: int = 100, clock=time.monotonic):
    gather = Gather(world, fixed)
    ranks = [r for r in range(world) if r not in (fixed or {})]
    handlers = {r: Handler(fail=r == fail_at, limit=limit) for r in ranks}
    links = {r: Links(r, world, timeout_s=timeout_s, outbox_capacity=4, gather=gather.of(r), clock=clock)
             for r in ranks}
    threads = [threading.Thread(target=links[r].start, args=(handlers[r], max_words)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return links, handlers


def kill(link: Links) -> None:
    """The process dies: its sockets close at once, nothing said (no DONE, no linger)."""
    link.close(flush=False)


def waits_that_block(events: list[threading.Event]) -> list[threading.Event]:
    """From now on, a wait on one of these events that finds it unset is listed (and returns at once, unset, as a
    wait that timed out would), instead of blocking: the list says whether the waits would have blocked."""
    blocked = []
    for event in events:
        def wait(timeout=None, event=event, wait=event.wait):
            if not event.is_set():
                blocked.append(event)
                return False
            return wait(timeout)
        event.wait = wait
    return blocked


def listener() -> tuple[object, str]:
    """A bare ROUTER standing in for a peer that is up and says nothing."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    return router, router.getsockopt_string(zmq.LAST_ENDPOINT)


def test_a_parcel_arrives_and_both_ranks_leave_after_saying_done():
    links, handlers = start()
    zero, one = links[0], links[1]
    assert zero.post_parcel(1, 3, 2, torch.arange(5, dtype=torch.int32))
    wait_until(one, lambda: handlers[1].delivered, 10.0, "the parcel")
    assert handlers[1].delivered == [(0, DATA, 3, [0, 1, 2, 3, 4], None)]
    leaving = threading.Thread(target=zero.finish)
    leaving.start()
    wait_until(one, lambda: one.peer_done(0), 10.0, "rank 0's DONE")
    assert not one.post_parcel(0, 4, 3, torch.ones(2, dtype=torch.int32))  # nothing is queued for a peer that left
    one.finish()
    leaving.join(10.0)
    assert not leaving.is_alive() and zero.peer_done(1)
    zero.check()
    one.check()  # leaving is no error
    assert not zero._worker.is_alive() and not one._worker.is_alive()


def test_what_is_queued_before_done_arrives_in_order_and_slots_keep_only_their_newest_value():
    links, handlers = start()
    zero, one = links[0], links[1]
    for step in (1, 2, 3):
        zero.post_parcel(1, step, step - 1, torch.full((3,), step, dtype=torch.int32))
    zero.post_slot(1, TAKEN, 7)
    zero.finish_thread = threading.Thread(target=zero.finish)
    zero.finish_thread.start()
    wait_until(one, lambda: one.peer_done(0), 10.0, "rank 0's DONE")
    one.finish()
    zero.finish_thread.join(10)
    kinds = [(kind, step) for _, kind, step, _, _ in handlers[1].delivered]
    assert (TAKEN, 7) in kinds and [s for k, s in kinds if k == DATA] == [1, 2, 3]  # all, in order, before DONE


def test_a_killed_peer_is_seen_closed_at_once_and_lost_when_its_grace_has_passed_and_check_says_so():
    """The closed connection is seen when it closes (not by heartbeats: swarm.timeout_s is an hour here), and the
    peer is lost once LOST_GRACE_S has passed on the links' clock since then, not before (a blip may come back)."""
    clock = Clock()  # stands still unless the test moves it
    links, _ = start(timeout_s=3600.0, clock=clock)
    wait_until(links[0], lambda: links[0].up[1], 10.0, "the connection")  # killed before: never up, lost as such
    kill(links[1])
    wait_until(links[0], lambda: not links[0].up[1], 20.0, "the closed connection")
    clock.set(links_module.LOST_GRACE_S)  # the grace, not more
    links[0].check()
    assert not links[0].peer_done(1)
    clock.set(links_module.LOST_GRACE_S + 0.01)
    with pytest.raises(PeerLost, match=r"peer rank 1 is gone without finishing \(its connection closed\)"):
        wait_until(links[0], lambda: False, 20.0, "nothing")
    assert links[0].peer_done(1)  # it holds nobody back any more
    links[0].close()


def test_a_peer_that_never_comes_up_is_lost_after_the_timeout():
    address = f"tcp://127.0.0.1:{free_port()}"  # an address nobody listens on
    links, _ = start(timeout_s=1.0, fixed={1: address})
    with pytest.raises(PeerLost, match=r"peer rank 1 is gone without finishing \(no connection to tcp://127.0.0.1:"
                                       r"\d+ within swarm.timeout_s=1\)"):
        wait_until(links[0], lambda: False, 20.0, "nothing")
    links[0].close()


@pytest.mark.integration
def test_a_stopped_peer_process_is_lost_by_heartbeat_though_its_kernel_still_accepts_connections():
    """A peer that hangs (SIGSTOP): its libzmq threads stop answering heartbeats, the connection is closed after
    swarm.timeout_s, and the reconnections never finish their handshake: lost, not mistaken for a blip."""
    peer = subprocess.Popen([sys.executable, "-c", (
        "import zmq, sys\n"
        "r = zmq.Context.instance().socket(zmq.ROUTER); r.bind('tcp://127.0.0.1:*')\n"
        "print(r.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)\n"
        "while True: r.recv_multipart()\n")], stdout=subprocess.PIPE, text=True)
    try:
        address = peer.stdout.readline().strip()
        links, _ = start(timeout_s=1.0, fixed={1: address})
        wait_until(links[0], lambda: links[0].up[1], 10.0, "the connection")  # up and heartbeating
        links[0].check()
        peer.send_signal(signal.SIGSTOP)
        with pytest.raises(PeerLost, match=r"peer rank 1 is gone without finishing \(its connection closed\)"):
            wait_until(links[0], lambda: False, 30.0, "nothing")
        links[0].close()
    finally:
        peer.kill()
        peer.wait()


def test_an_error_in_the_receiving_handler_is_a_transport_error_with_its_cause_not_a_lost_peer():
    links, _ = start(fail_at=1)
    links[0].post_parcel(1, 1, 0, torch.ones(3, dtype=torch.int32))
    with pytest.raises(TransportError, match=r"rank 1: receiving from peer rank 0 failed: ValueError: "
                                             r"injected fault in deliver") as caught:
        wait_until(links[1], lambda: False, 10.0, "nothing")
    assert isinstance(caught.value.__cause__, ValueError)
    for link in links.values():
        kill(link)


def test_a_failure_of_the_io_thread_itself_is_a_transport_error_with_its_type_and_every_wait_ends(monkeypatch):
    """An error in the I/O thread's own code (not the handler's, not a connection's) ends the thread: check raises it
    as a TransportError whose cause is the error itself, and the rank waiting, or finishing, is not left waiting."""
    send_ready = Links._send_ready

    def broken(self, peer, dealer, pending):
        if self.rank == 0:
            raise AttributeError("'NoneType' object has no attribute 'send_multipart'")
        send_ready(self, peer, dealer, pending)

    monkeypatch.setattr(Links, "_send_ready", broken)
    links, _ = start(timeout_s=30.0)
    with pytest.raises(TransportError, match=r"^rank 0: the links' I/O thread failed: AttributeError: 'NoneType' "
                                             r"object has no attribute 'send_multipart'$") as caught:
        wait_until(links[0], lambda: False, 10.0, "nothing")
    assert isinstance(caught.value.__cause__, AttributeError) and not links[0]._worker.is_alive()
    blocked = waits_that_block([*links[0]._done_received.values(), *links[0]._done_sent.values()])
    links[0].finish()  # nothing more comes from anyone: finishing waits for no peer's DONE (each up to 30 s here)
    assert blocked == []
    kill(links[1])


def test_a_body_over_the_receivers_limit_is_refused_and_one_over_the_socket_cap_never_read():
    """Over the handler's limit: received (within the cap), refused and counted, delivered empty with the reason.
    Over max_words: ZeroMQ closes that connection unread (ZMQ_MAXMSGSIZE); the sender's connection comes back
    and what it sends next arrives: a blip, not a lost peer."""
    links, handlers = start(max_words=50, limit=10)
    zero, one = links[0], links[1]
    zero.post_parcel(1, 1, 0, torch.ones(20, dtype=torch.int32))  # 20 > limit 10, within the cap
    wait_until(one, lambda: handlers[1].delivered, 10.0, "the refused parcel")
    assert handlers[1].delivered == [(0, DATA, 1, [], "20 words, an honest one holds at most 10")]
    assert one.refused == {0: 1}
    zero.post_parcel(1, 2, 1, torch.ones(1000, dtype=torch.int32))  # 4000 bytes > the cap: never read
    time.sleep(1.0)
    zero.post_parcel(1, 3, 2, torch.ones(5, dtype=torch.int32))
    wait_until(one, lambda: len(handlers[1].delivered) == 2, 10.0, "the next parcel")
    assert [step for _, _, step, _, _ in handlers[1].delivered] == [1, 3]  # step 2 never arrived
    assert one.counts()[0] == 1 and zero.counts()[1] >= 1  # refused by one; zero's cut connection came back
    time.sleep(links_module.LOST_GRACE_S + 0.5)
    zero.check()
    one.check()
    for link in links.values():
        kill(link)


def test_a_done_lost_with_a_cut_connection_goes_again_once_it_is_back():
    """A message over the receiver's cap cuts the connection, and what followed it on that connection is gone; the
    sender's DONE goes again on the new connection (and its newest round taken), so the receiver does not wait for
    a DONE that never comes (until swarm.timeout_s). Everything is queued before the links start, so the parcel
    and the DONE go out back to back on the first connection."""
    gather = Gather(2)
    handlers = {r: Handler() for r in (0, 1)}
    links = {r: Links(r, 2, timeout_s=60.0, outbox_capacity=4, gather=gather.of(r)) for r in (0, 1)}
    zero, one = links[0], links[1]
    zero.post_slot(1, TAKEN, 5)
    zero.post_parcel(1, 1, 0, torch.ones(1000, dtype=torch.int32))  # 4000 bytes over rank 1's cap of 1024
    leaving = threading.Thread(target=zero.finish)  # its DONE follows the parcel
    leaving.start()
    starting = [threading.Thread(target=links[r].start, args=(handlers[r], 50)) for r in (0, 1)]
    for t in starting:
        t.start()
    for t in starting:
        t.join(10)
    wait_until(one, lambda: one.peer_done(0), 20.0, "rank 0's DONE")
    one.finish()
    leaving.join(20)
    assert not leaving.is_alive() and zero.reconnects[1] >= 1  # the cut happened and the link came back
    delivered = {(kind, step) for _, kind, step, _, _ in handlers[1].delivered}
    assert delivered == {(TAKEN, 5)}  # no parcel; the TAKEN once or twice
    zero.check()
    one.check()


@pytest.mark.parametrize("frames, reason", [
    ([MAGIC, HEADER.pack(DATA, 1, 0, 3), b"\x00" * 8], "a header that does not match its body"),
    ([MAGIC, HEADER.pack(9, 1, 0, 0)], "an unknown kind 9"),
    ([MAGIC, b"\x00" * 5], "a header of 5 bytes"),
    ([b"pickle", HEADER.pack(DATA, 1, 0, 0)], "not a links message"),
    ([MAGIC, HEADER.pack(DATA, -1, 0, 0)], "a header that does not match"),
])
def test_a_malformed_message_is_refused_and_counted_and_the_link_goes_on(frames, reason, caplog):
    """Rank 0 is a raw socket that sends what it likes under rank 0's id."""
    silent, address = listener()
    links, handlers = start(fixed={0: address})
    forger = zmq.Context.instance().socket(zmq.DEALER)
    forger.setsockopt(zmq.ROUTING_ID, b"0")
    forger.setsockopt(zmq.LINGER, 1000)
    forger.connect(links[1].addresses[1])
    forger.send_multipart(frames)
    wait_until(links[1], lambda: links[1].refused, 10.0, "the refusal")
    assert links[1].refused == {0: 1} and handlers[1].delivered == []
    assert reason in caplog.text
    forger.send_multipart([MAGIC, HEADER.pack(DATA, 2, 1, 2), torch.ones(2, dtype=torch.int32).numpy().tobytes()])
    wait_until(links[1], lambda: handlers[1].delivered, 10.0, "a parcel")  # a well-formed one is still heard
    assert handlers[1].delivered == [(0, DATA, 2, [1, 1], None)]
    forger.close()
    kill(links[1])
    silent.close()


def test_a_second_connection_claiming_a_connected_peers_id_is_turned_away():
    links, handlers = start()
    forger = zmq.Context.instance().socket(zmq.DEALER)
    forger.setsockopt(zmq.ROUTING_ID, b"0")  # rank 0 is connected under this id
    forger.setsockopt(zmq.LINGER, 0)
    forger.connect(links[0].addresses[1])
    forger.send_multipart([MAGIC, HEADER.pack(DATA, 9, 8, 1), b"\x07\x00\x00\x00"])
    links[0].post_parcel(1, 2, 1, torch.ones(2, dtype=torch.int32))
    wait_until(links[1], lambda: handlers[1].delivered, 10.0, "rank 0's parcel")
    time.sleep(1.0)
    assert handlers[1].delivered == [(0, DATA, 2, [1, 1], None)]  # the forged step 9 never arrived
    forger.close()
    for link in links.values():
        kill(link)


@pytest.mark.parametrize("alias", [b"00", b" 0", b"+0", b"0_0", b"0 "])
def test_a_connection_under_an_alias_of_a_peers_id_is_an_unknown_sender(alias):
    """int() reads each of these as 0: a second connection under one would pass for rank 0."""
    links, handlers = start()
    forger = zmq.Context.instance().socket(zmq.DEALER)
    forger.setsockopt(zmq.ROUTING_ID, alias)
    forger.setsockopt(zmq.LINGER, 1000)
    forger.connect(links[0].addresses[1])
    forger.send_multipart([MAGIC, HEADER.pack(DATA, 9, 8, 1), b"\x07\x00\x00\x00"])
    wait_until(links[1], lambda: links[1].refused, 10.0, "the refusal")
    assert links[1].refused == {-1: 1} and handlers[1].delivered == []
    forger.close()
    for link in links.values():
        kill(link)


def test_a_message_from_an_unknown_sender_is_refused_and_a_done_is_not_taken_from_it():
    links, handlers = start()
    stranger = zmq.Context.instance().socket(zmq.DEALER)
    stranger.setsockopt(zmq.ROUTING_ID, b"intruder")
    stranger.setsockopt(zmq.LINGER, 1000)
    stranger.connect(links[0].addresses[1])
    stranger.send_multipart([MAGIC, HEADER.pack(DONE, 0, 0, 0)])
    wait_until(links[1], lambda: links[1].refused, 10.0, "the refusal")
    assert links[1].refused == {-1: 1} and links[1].counts()[0] == 1 and not links[1].peer_done(0)
    stranger.close()
    for link in links.values():
        kill(link)


def test_the_advertised_address_is_the_one_routing_towards_master_addr(monkeypatch):
    monkeypatch.delenv("FTIS_LINKS_HOST", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert links_module.advertised_host() == "127.0.0.1"
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    assert links_module.advertised_host() in ("127.0.0.1", "::1")
    monkeypatch.setenv("FTIS_LINKS_HOST", "10.1.2.3")
    assert links_module.advertised_host() == "10.1.2.3"
