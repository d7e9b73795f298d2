"""Point-to-point links between this endpoint and each peer, for the async transport of one world, on ZeroMQ.

The same library as the open swarm's (openswarm/client.py, coordinator.py): every endpoint binds one ROUTER socket
on the address that routes towards MASTER_ADDR (its advertised address; the addresses are gathered once over the
endpoints' gloo group at the start) and dials one DEALER to each peer's ROUTER. A message goes out on its sender's
DEALER and comes in on its receiver's ROUTER, so each direction of a link is one connection of its own. One I/O
thread per process owns every socket (ZeroMQ sockets are not thread-safe): it sends what the training loop posts,
in each peer's order, and hands what arrives to the receiving side's Handler. Rollouts are a few bytes a token and
live on the CPU, so they go over TCP even between GPUs.

What ZeroMQ does that this module no longer does by hand: a message is whole or absent (no chunking: a receiver's
socket refuses any frame over `max_bytes`, ZMQ_MAXMSGSIZE, by closing that connection, so a lying peer cannot make
it allocate more); liveness is ZMTP heartbeats on every connection (ZMQ_HEARTBEAT_*: answered by libzmq's own
threads, so a rank busy in Python for minutes still answers, and a connection silent past swarm.timeout_s is
closed); each DEALER's socket monitor says when its connection is up (its handshake succeeded) and when it closed.

A message's kinds (DATA, WEIGHTS, TAKEN, DONE) and frames, and the Outbox of what waits for a peer: messages.py.

Leaving: a rank that has finished sends DONE to every peer after everything it queued for it; a peer answers DONE
when it receives one (and sends nothing after it). A rank closes when it has sent and received DONE on every link
(its sockets linger until what they hold has gone out), so nothing is ever in flight towards a closed process. A
link whose connection closes without DONE and does not come back within LOST_GRACE_S, or that never comes up
within swarm.timeout_s, is lost (PeerLost: the peer was killed, crashed, hung or is unreachable); an error of this
code inside the I/O thread is a TransportError with its own message and cause, never mistaken for a lost peer.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

from ..core.errors import first_line
from ..core.threads import Worker
from . import PeerLost, TransportError
from .messages import (
    DATA,
    DONE,
    HEADER,
    KIND_NAMES,
    MAGIC,  # noqa: F401 (importable from here: the tests import it)
    TAKEN,
    WEIGHTS,
    Outbox,
    frames,
    parse,
)

log = logging.getLogger("ftis_engine.exchange")

MIN_FRAME_BYTES = 1024  # the cap of a link's frames when no body may come (headers, a peer's stray DONE)
LOST_GRACE_S = 3.0  # a closed connection that comes back within this is a blip, not a lost peer
SEND_HWM = 4  # messages ZeroMQ queues per peer: the Outbox, not the socket, decides what waits (and what is dropped)
RECEIVE_HWM = 4  # messages ZeroMQ reads ahead per connection: memory bounded by this x max_bytes per peer
READ_BURST = 64  # messages read in one turn of the links thread before it sends (a steady stream cannot starve sends)


class Handler(Protocol):
    """The receiving side's decisions, called from the I/O thread."""

    def body_limit(self, peer: int, kind: int, step: int, version: int, size: int) -> int:
        """The most words this message's body may hold (a larger one is refused)."""

    def deliver(self, peer: int, kind: int, step: int, version: int, body: torch.Tensor, refused: str | None) -> None:
        """A message has arrived (its body empty and `refused` set when its size was refused)."""


def advertised_host() -> str:
    """This host's address on the route towards MASTER_ADDR (what its peers dial; 127.0.0.1 for a world on one
    machine). FTIS_LINKS_HOST overrides it (a host with several networks that routes elsewhere)."""
    if os.environ.get("FTIS_LINKS_HOST"):
        return os.environ["FTIS_LINKS_HOST"]
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    family, _, _, _, address = socket.getaddrinfo(master, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)  # UDP: nothing is sent, the kernel only picks the route
        return probe.getsockname()[0]


class Links:
    """This endpoint's links to every peer. `start(handler, max_words)` binds, gathers the addresses and starts the
    I/O thread; `post_*` never block. gather(address) -> every endpoint's address, in endpoint order (a collective
    over the endpoints' gloo group: async_.DistributedAsync). clock: what the I/O thread reads, in seconds, to tell
    a lost peer (a link not up within timeout_s, one closed for over LOST_GRACE_S); a test passes one it moves."""

    def __init__(self, rank: int, world_size: int, timeout_s: float, outbox_capacity: int,
                 gather: Callable[[str], list[str]], clock: Callable[[], float] = time.monotonic):
        self.rank = rank
        self.clock = clock
        self.timeout_s = timeout_s
        self.gather = gather
        self.peers = [p for p in range(world_size) if p != rank]
        self._peer_ids = {str(p).encode(): p for p in self.peers}  # a peer's routing id -> its rank
        self.heartbeat_s = max(0.05, min(60.0, timeout_s / 4))
        self.outboxes = {p: Outbox(outbox_capacity) for p in self.peers}
        self._done_sent = {p: threading.Event() for p in self.peers}
        self._done_received = {p: threading.Event() for p in self.peers}
        self._finishing = threading.Event()
        self._stop = threading.Event()
        self._lost: dict[int, str] = {}
        self._reading: int | None = None  # the peer whose message the handler is taking (a failure there is its)
        self.refused: dict[int, int] = {}  # peer -> messages refused
        self.reconnects = {p: 0 for p in self.peers}  # connections to a peer that closed and came back
        self.up = {p: False for p in self.peers}  # this rank's connection to the peer is up (handshake done)
        self._last_taken: dict[int, tuple[int, int]] = {}  # peer -> the last TAKEN handed to ZeroMQ (step, version)
        self._again: dict[int, list[list]] = {}  # peer -> messages that go again (a reconnection may have lost them)
        self.changed = threading.Condition()  # notified whenever a message arrives or a link ends
        self._handler: Handler | None = None
        # the I/O thread: its failure is this code's own, not a connection's (check raises it, never as a lost peer)
        self._worker = Worker(self._run, name=f"ftis-links-{rank}", on_error=self._failed)
        self._flush = True
        self._wake_read, self._wake_write = socket.socketpair()  # a post wakes the I/O thread's poll
        self._wake_read.setblocking(False)
        self._wake_write.setblocking(False)
        self.addresses: list[str] = []

    def start(self, handler: Handler, max_words: int) -> None:
        """Bind this endpoint's socket (frames over max_words words refused by ZeroMQ), gather every endpoint's
        address and start the I/O thread."""
        import zmq

        self._handler = handler
        host = advertised_host()
        router = zmq.Context.instance().socket(zmq.ROUTER)
        router.setsockopt(zmq.MAXMSGSIZE, max(MIN_FRAME_BYTES, 4 * max_words))
        router.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        router.setsockopt(zmq.LINGER, 0)  # nothing is sent on it
        # (no ROUTER_HANDOVER: a second connection claiming a connected peer's id is turned away, not handed it)
        self._heartbeat(router)
        if ":" in host:
            router.setsockopt(zmq.IPV6, 1)
        router.bind(f"tcp://[{host}]:*" if ":" in host else f"tcp://{host}:*")
        self.addresses = list(self.gather(router.getsockopt_string(zmq.LAST_ENDPOINT)))
        self._worker.start(router)

    def _heartbeat(self, sock) -> None:
        import zmq

        sock.setsockopt(zmq.HEARTBEAT_IVL, int(1000 * self.heartbeat_s))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(1000 * self.timeout_s))
        sock.setsockopt(zmq.HEARTBEAT_TTL, int(1000 * self.timeout_s))
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(1000 * self.timeout_s))

    # -- the training loop's side

    def post_parcel(self, peer: int, step: int, version: int, buffer: torch.Tensor) -> bool:
        """Queue a parcel for a peer; False (nothing queued) when the peer has left."""
        if self.peer_done(peer):
            return False
        self.outboxes[peer].put_parcel(step, version, buffer)
        self._wake()
        return True

    def post_slot(self, peer: int, kind: int, step: int, version: int = 0, buffer: torch.Tensor | None = None) -> None:
        if not self.peer_done(peer):
            self.outboxes[peer].put_slot(kind, step, version, buffer)
            self._wake()

    def counts(self) -> tuple[int, int]:
        """Messages refused so far (every sender, unknown ones included) and reconnections (every peer)."""
        return sum(list(self.refused.values())), sum(list(self.reconnects.values()))  # list(): one copy, GIL held

    def peer_done(self, peer: int) -> bool:
        """The peer said DONE (or its link ended): it sends nothing more and holds nobody back."""
        return self._done_received[peer].is_set()

    def check(self) -> None:
        """Raise what went wrong on a link: TransportError (this code's own failure, with its cause) or PeerLost."""
        self._worker.check(self._transport_error)
        if self._lost:
            peer, reason = next(iter(dict(self._lost).items()))
            raise PeerLost(f"peer rank {peer} is gone without finishing ({reason})")

    def wait(self, ready, timeout_s: float, what: str) -> tuple[float, bool]:
        """Block until ready() holds (re-checked whenever a message arrives) or timeout_s passes (exchange/pacer.py's
        Wait; `what` is the pacer's, for its warning); returns the seconds waited and whether ready() held. Raises
        what check() raises."""
        start = time.perf_counter()
        deadline = start + timeout_s
        with self.changed:
            while True:
                self.check()
                if ready():
                    return time.perf_counter() - start, True
                left = deadline - time.perf_counter()
                if left <= 0:
                    return time.perf_counter() - start, False
                self.changed.wait(min(left, 1.0))

    def finish(self) -> None:
        """Say DONE on every link and wait for every peer's DONE (a peer answers as soon as it reads ours; what
        arrives meanwhile is drained, not used), then close. Bounded by swarm.timeout_s."""
        self._finishing.set()
        for peer in self.peers:
            self.outboxes[peer].put_done()
        self._wake()
        deadline = time.time() + self.timeout_s
        for peer in self.peers:
            while not (self._done_received[peer].is_set() or peer in self._lost or self._worker.error is not None):
                if time.time() > deadline:
                    log.warning("rank %d: peer rank %d did not say DONE in time; leaving anyway", self.rank, peer)
                    break
                self._done_received[peer].wait(0.05)
        for peer in self.peers:
            self._done_sent[peer].wait(max(0.0, deadline - time.time()))
        self.close()

    def close(self, flush: bool = True) -> None:
        """Stop the I/O thread; its sockets linger (at most a few seconds) until what they hold has gone out
        (flush=False: closed at once, as when the process dies)."""
        self._flush = flush
        self._stop.set()
        self._wake()
        self._worker.join(self.linger_s() + 5.0)
        self._wake_read.close()
        self._wake_write.close()

    def linger_s(self) -> float:
        return min(self.timeout_s, 5.0)

    # -- the I/O thread

    def _wake(self) -> None:
        try:
            self._wake_write.send(b"x")
        except OSError:  # full (the thread is woken already), or closed (the links have closed)
            pass

    def _notify(self) -> None:
        with self.changed:
            self.changed.notify_all()

    def _failed(self, exc: BaseException) -> None:
        """The I/O thread ended with `exc` (kept by its Worker; its sockets closed): nothing more comes from anyone
        or goes to anyone, and every wait wakes to find it (check)."""
        for peer in self.peers:
            self._done_received[peer].set()
            self._done_sent[peer].set()
        self._notify()

    def _transport_error(self, exc: BaseException) -> TransportError:
        """The I/O thread's failure as check raises it: where it failed (the handler, receiving from a peer), what."""
        place = "the links' I/O thread" if self._reading is None else f"receiving from peer rank {self._reading}"
        return TransportError(f"rank {self.rank}: {place} failed: {type(exc).__name__}: {first_line(exc)}")

    def _run(self, router) -> None:
        import zmq

        context = zmq.Context.instance()
        dealers, monitors = {}, {}
        up = self.up
        down_since: dict[int, float] = {}  # peer -> when its connection closed (it may come back)
        pending: dict[int, list] = {}  # peer -> a message ZeroMQ would not take yet
        started = self.clock()
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        try:
            for peer in self.peers:
                dealer = context.socket(zmq.DEALER)
                dealer.setsockopt(zmq.ROUTING_ID, str(self.rank).encode())
                dealer.setsockopt(zmq.IMMEDIATE, 1)  # nothing queued towards a connection that is not up
                dealer.setsockopt(zmq.SNDHWM, SEND_HWM)
                dealer.setsockopt(zmq.LINGER, int(1000 * self.linger_s()))
                dealer.setsockopt(zmq.RECONNECT_IVL, 100)
                dealer.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
                self._heartbeat(dealer)
                if self.addresses[peer].startswith("tcp://["):
                    dealer.setsockopt(zmq.IPV6, 1)
                # up: its ZMTP handshake succeeded (a stopped process's kernel still accepts TCP connections)
                monitors[peer] = dealer.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
                dealer.connect(self.addresses[peer])
                dealers[peer] = dealer
                poller.register(monitors[peer], zmq.POLLIN)
            while not self._stop.is_set():
                blocked = any(peer in pending or len(self.outboxes[peer]) for peer in self.peers if up[peer])
                events = dict(poller.poll(10 if blocked else 100))
                if self._wake_read.fileno() in events:
                    try:
                        while self._wake_read.recv(4096):
                            pass
                    except BlockingIOError:
                        pass
                for peer, monitor in monitors.items():
                    if monitor in events:
                        self._monitor(peer, monitor, up, down_since)
                if router in events:  # at most a burst: a peer's steady stream must not hold back this rank's sends
                    for _ in range(READ_BURST):
                        try:
                            message = router.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._receive(message)
                now = self.clock()
                for peer in self.peers:
                    if self._done_received[peer].is_set():
                        continue
                    if not up[peer] and peer not in down_since and now - started > self.timeout_s:
                        self._lose(peer, f"no connection to {self.addresses[peer]} within swarm.timeout_s="
                                         f"{self.timeout_s:g}")
                    elif peer in down_since and now - down_since[peer] > LOST_GRACE_S:
                        self._lose(peer, "its connection closed")
                for peer in self.peers:
                    if up[peer]:
                        self._send_ready(peer, dealers[peer], pending)
        finally:
            # the monitors stop before their sockets close: libzmq's own thread may be sending an event (a peer's
            # disconnection) to a monitor, and with the reading end closed first that send would wait forever,
            # holding the lock disable_monitor then waits for
            for dealer in dealers.values():
                dealer.disable_monitor()
            for monitor in monitors.values():
                monitor.close(0)
            for dealer in dealers.values():
                dealer.close(None if self._flush else 0)  # lingers until what it holds (a DONE answer) has gone out
            router.close(0)

    def _monitor(self, peer: int, monitor, up: dict, down_since: dict) -> None:
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if peer in down_since:
                    self._reconnected(peer)
                up[peer] = True
                down_since.pop(peer, None)
                self._notify()
            elif event == zmq.EVENT_DISCONNECTED:
                up[peer] = False
                down_since.setdefault(peer, self.clock())

    def _reconnected(self, peer: int) -> None:
        """A connection that closed is back (a network blip, or the peer's socket refused a message of ours over
        its cap): what it held is gone. Parcels lost so are lost (fresh ones follow); the control messages a peer
        must not miss go again: this rank's DONE (the peer would wait for it until its time-out) and the newest
        round taken (a sampler would wait for it). A receiver takes either twice alike."""
        self.reconnects[peer] += 1
        log.info("rank %d: the connection to peer rank %d is back (reconnection %d)", self.rank, peer,
                 self.reconnects[peer])
        again = []
        if peer in self._last_taken:  # (a newer one still waiting in the outbox follows it)
            again.append(frames(TAKEN, *self._last_taken[peer], None))
        if self._done_sent[peer].is_set() and peer not in self._lost:
            again.append(frames(DONE, 0, 0, None))
        self._again[peer] = again

    def _lose(self, peer: int, reason: str) -> None:
        self._lost.setdefault(peer, reason)
        self._done_received[peer].set()  # nothing more will come from it
        self._done_sent[peer].set()
        self._notify()

    def _send_ready(self, peer: int, dealer, pending: dict) -> None:
        """Hand ZeroMQ this peer's next messages while it takes them (DONE last, then nothing more but a DONE sent
        again after a reconnection)."""
        import zmq

        again = self._again.get(peer, [])
        while again:
            try:
                dealer.send_multipart(again[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            again.pop(0)
        while not self._done_sent[peer].is_set():
            message = pending.pop(peer, None)
            if message is None:
                item = self.outboxes[peer].take()
                if item is None:
                    return
                message = (item[0], frames(*item))
            kind, parts = message
            try:
                dealer.send_multipart(parts, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                pending[peer] = message  # its queue is full: the next round of the loop tries again
                return
            if kind == DONE:
                self._done_sent[peer].set()
                self._notify()
            elif kind == TAKEN:
                self._last_taken[peer] = HEADER.unpack(bytes(parts[1]))[1:3]

    def _receive(self, message: list[bytes]) -> None:
        sender, *rest = message
        # exactly the id a peer's DEALER sets (str(rank)): int() would also take "01", " 1", "+1" or "0_1", and a
        # second connection under such an alias would pass for a connected peer
        peer = self._peer_ids.get(sender, -1)
        if peer not in self._done_received:
            self._refused(-1, -1, 0, f"a message from an unknown sender {sender[:16]!r}")
            return
        if self._done_received[peer].is_set():
            return  # it said DONE (or was lost, or failed): nothing more from it is used
        try:
            kind, step, version, raw = parse(rest)
        except ValueError as exc:
            self._refused(peer, -1, 0, str(exc))
            return
        if kind == DONE:
            self._done_received[peer].set()
            self.outboxes[peer].clear_parcels()  # nothing more is used there: answer at once
            self.outboxes[peer].put_done()  # (a no-op if ours went already)
            self._notify()
            return
        size = len(raw) // 4
        with_body = kind in (DATA, WEIGHTS)
        self._reading = peer  # the handler's failure from here (it ends the I/O thread) is "receiving from" this peer
        limit = self._handler.body_limit(peer, kind, step, version, size) if with_body else 0
        refused = None
        if size > limit:
            refused = f"{size} words, an honest one holds at most {limit}"
        elif with_body and size < 1:
            refused = "an empty body"
        if refused is not None:
            self._refused(peer, kind, step, refused)
        if self._finishing.is_set() or (kind == TAKEN and refused):
            self._reading = None
            return  # drained, not used: this rank has finished
        body = torch.frombuffer(bytearray(raw), dtype=torch.int32) if refused is None and size else \
            torch.empty(0, dtype=torch.int32)
        self._handler.deliver(peer, kind, step, version, body, refused)
        self._reading = None
        self._notify()

    def _refused(self, peer: int, kind: int, step: int, reason: str) -> None:
        """Log a refused message: the first few of each peer, then only their count (a peer cannot flood the log)."""
        count = self.refused.get(peer, 0) + 1
        if count <= 3:
            log.warning("rank %d: %s sent %s of step %d: %s; refused%s", self.rank,
                        "an unknown sender" if peer < 0 else f"peer rank {peer}",
                        KIND_NAMES.get(kind, "a message"), step, reason,
                        "" if count < 3 else " (further refusals from this peer are counted, not logged)")
        self.refused[peer] = count  # after the log: a reader that sees the count finds its line
        self._notify()
