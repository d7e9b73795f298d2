"""Point-to-point links between this rank and each peer, for the async transport.

A dedicated gloo process group (its traffic never interleaves with the default group's collectives) and, per
peer, one sending and one receiving thread, so a slow or finished peer holds up nobody. Rollouts are a few bytes a
token and live on the CPU, so they go over gloo even between GPUs (NCCL has no thread-safe point-to-point from a
side thread).

A message is a header of four int64 words (kind, step, version, body words) and a body sent in chunks of at most
4 MiB, so a receiver drains a body it refuses in bounded memory. Kinds:

    DATA     a parcel of rollouts (step: the sender's step or round; version: their policy version)
    WEIGHTS  a learner's trainable weights for its sampler (version: the learner's step)
    TAKEN    a learner tells its sampler the newest round it has taken (step: that round; no body)
    PING     nothing; keeps an idle direction open (gloo closes a rank's whole group when one receive waits
             longer than the group's timeout)
    DONE     the sender has finished and sends nothing more

Leaving: a rank that has finished sends DONE to every peer after everything it queued for it; a peer answers DONE
when it receives one (and sends nothing after it). A rank closes when it has sent and received DONE on every link,
so nothing is ever in flight towards a closed process. A link whose connection closes without DONE is lost
(PeerLost: the peer was killed, crashed or is unreachable); an error of this code inside a thread is a
TransportError with its own message and cause, never mistaken for a lost peer.
"""

from __future__ import annotations

import collections
import datetime
import logging
import threading
import time
from typing import Protocol

import torch
import torch.distributed as dist

from ..errors import first_line

log = logging.getLogger("ftis_engine.exchange")

CHUNK_WORDS = 1 << 20
DATA, DONE, WEIGHTS, PING, TAKEN = 0, 1, 2, 3, 4
KIND_NAMES = {DATA: "DATA", DONE: "DONE", WEIGHTS: "WEIGHTS", PING: "PING", TAKEN: "TAKEN"}


class PeerLost(RuntimeError):
    """A peer's connection closed before it said DONE (killed, crashed or unreachable)."""


class TransportError(RuntimeError):
    """A thread of the transport failed for a reason of its own (not a lost connection)."""


class Handler(Protocol):
    """The receiving side's decisions, called from the receiving threads."""

    def body_limit(self, peer: int, kind: int, step: int, version: int, size: int) -> int:
        """The most words this message's body may hold (a larger one is read through and refused)."""

    def deliver(self, peer: int, kind: int, step: int, version: int, body: torch.Tensor, refused: str | None) -> None:
        """A message has arrived (its body empty and `refused` set when its size was refused)."""


SLOT_ORDER = (TAKEN, WEIGHTS)  # the round taken (no body) never waits behind a weights transfer


class Outbox:
    """What this rank still has to send one peer: rollout parcels, of which at most `capacity` wait (a newer one
    replaces the oldest, counted in `dropped_sequences`: a receiver prefers fresh rollouts), slots in which only
    the newest value matters (the round taken, then weights), and DONE, which goes after everything else."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._parcels: collections.deque = collections.deque()
        self._slots: dict[int, tuple[int, int, torch.Tensor | None]] = {}
        self._done = False
        self._cond = threading.Condition()
        self.dropped_sequences = 0

    def put_parcel(self, step: int, version: int, buffer: torch.Tensor) -> None:
        with self._cond:
            if len(self._parcels) >= self.capacity:
                _, _, oldest = self._parcels.popleft()
                self.dropped_sequences += int(oldest[0]) if oldest.numel() else 0
            self._parcels.append((step, version, buffer))
            self._cond.notify()

    def put_slot(self, kind: int, step: int, version: int, buffer: torch.Tensor | None) -> None:
        with self._cond:
            self._slots[kind] = (step, version, buffer)
            self._cond.notify()

    def put_done(self) -> None:
        with self._cond:
            self._done = True
            self._cond.notify()

    def take(self, timeout: float) -> tuple[int, int, int, torch.Tensor | None]:
        """The next message (kind, step, version, body); PING when nothing came within `timeout`."""
        with self._cond:
            self._cond.wait_for(lambda: self._slots or self._parcels or self._done, timeout)
            if self._slots:
                kind = next(k for k in SLOT_ORDER if k in self._slots)
                return (kind, *self._slots.pop(kind))
            if self._parcels:
                return (DATA, *self._parcels.popleft())
            if self._done:
                return DONE, 0, 0, None
            return PING, 0, 0, None

    def clear_parcels(self) -> None:
        """The peer has left: what still waits for it is dropped (counted), so its DONE answer goes at once."""
        with self._cond:
            self.dropped_sequences += sum(int(b[0]) for _, _, b in self._parcels if b.numel())
            self._parcels.clear()

    def __len__(self) -> int:
        with self._cond:
            return len(self._parcels)


class Links:
    """This rank's links to every peer. `start(handler)` starts the threads; `post_*` never block."""

    def __init__(self, rank: int, world_size: int, timeout_s: float, outbox_capacity: int, group=None):
        # a group of its own: its point-to-point traffic never interleaves with the default group's collectives
        # (group: the endpoints' gloo group, fsdp.make_groups; a peer is its rank in the group: its endpoint)
        self.group = group if group is not None else dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.rank = rank
        self.timeout_s = timeout_s
        self.peers = [p for p in range(world_size) if p != rank]
        self.ping_every_s = max(0.05, min(60.0, timeout_s / 4))
        self.outboxes = {p: Outbox(outbox_capacity) for p in self.peers}
        self._done_sent = {p: threading.Event() for p in self.peers}
        self._done_received = {p: threading.Event() for p in self.peers}
        self._finishing = threading.Event()
        self._lost: dict[int, str] = {}
        self._failed: dict[int, tuple[str, BaseException]] = {}
        self.refused: dict[int, int] = {}  # peer -> messages refused
        self.changed = threading.Condition()  # notified whenever a message arrives or a link ends
        self._handler: Handler | None = None

    def start(self, handler: Handler) -> None:
        self._handler = handler
        for peer in self.peers:
            for target in (self._send_loop, self._receive_loop):
                threading.Thread(target=target, args=(peer,), daemon=True,
                                 name=f"ftis-{target.__name__[1:]}-{peer}").start()

    # -- the training loop's side

    def post_parcel(self, peer: int, step: int, version: int, buffer: torch.Tensor) -> bool:
        """Queue a parcel for a peer; False (nothing queued) when the peer has left."""
        if self.peer_done(peer):
            return False
        self.outboxes[peer].put_parcel(step, version, buffer)
        return True

    def post_slot(self, peer: int, kind: int, step: int, version: int = 0, buffer: torch.Tensor | None = None) -> None:
        if not self.peer_done(peer):
            self.outboxes[peer].put_slot(kind, step, version, buffer)

    def peer_done(self, peer: int) -> bool:
        """The peer said DONE (or its link ended): it sends nothing more and holds nobody back."""
        return self._done_received[peer].is_set()

    def check(self) -> None:
        """Raise what went wrong on a link: TransportError (a thread's own failure, with its cause) or PeerLost."""
        if self._failed:
            peer, (where, exc) = next(iter(dict(self._failed).items()))
            raise TransportError(f"rank {self.rank}: the {where} thread for peer rank {peer} failed: "
                                 f"{type(exc).__name__}: {first_line(exc)}") from exc
        if self._lost:
            peer, reason = next(iter(dict(self._lost).items()))
            raise PeerLost(f"peer rank {peer} is gone without finishing ({reason})")

    def wait_until(self, ready, timeout_s: float, what: str) -> float:
        """Block until ready() holds (re-checked whenever a message arrives); returns the seconds waited. Raises
        what check() raises, or TimeoutError naming `what` after timeout_s."""
        start = time.perf_counter()
        deadline = start + timeout_s
        with self.changed:
            while True:
                self.check()
                if ready():
                    return time.perf_counter() - start
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise TimeoutError(f"swarm.timeout_s: waited {timeout_s:g} s for {what}")
                self.changed.wait(min(left, 1.0))

    def finish(self) -> None:
        """Say DONE on every link and wait for every peer's DONE (a peer answers as soon as it reads ours; what
        arrives meanwhile is drained, not used). Bounded by the group's timeout."""
        self._finishing.set()
        for peer in self.peers:
            self.outboxes[peer].put_done()
        deadline = time.time() + self.timeout_s
        for peer in self.peers:
            while not (self._done_received[peer].is_set() or peer in self._lost or peer in self._failed):
                if time.time() > deadline:
                    log.warning("rank %d: peer rank %d did not say DONE in time; leaving anyway", self.rank, peer)
                    break
                self._done_received[peer].wait(0.05)
        for peer in self.peers:
            self._done_sent[peer].wait(max(0.0, deadline - time.time()))

    # -- the threads

    def _notify(self) -> None:
        with self.changed:
            self.changed.notify_all()

    def _send_loop(self, peer: int) -> None:
        try:
            while True:
                kind, step, version, buffer = self.outboxes[peer].take(self.ping_every_s)
                if self._done_sent[peer].is_set():
                    return
                size = 0 if buffer is None else buffer.numel()
                header = torch.tensor([kind, step, version, size], dtype=torch.int64)
                if not self._send(peer, header, tag=0):
                    return
                for start in range(0, size, CHUNK_WORDS):
                    if not self._send(peer, buffer[start : start + CHUNK_WORDS], tag=1):
                        return
                if kind == DONE:
                    self._done_sent[peer].set()
                    return
        except Exception as exc:  # this code's own failure, not the connection's
            self._failed.setdefault(peer, ("send", exc))
            self._done_sent[peer].set()
            self._notify()

    def _send(self, peer: int, tensor: torch.Tensor, tag: int) -> bool:
        """Send `tensor`; False when the connection closed (the peer is lost unless it said DONE)."""
        try:
            dist.send(tensor, group=self.group, tag=tag, group_dst=peer)
            return True
        except Exception as exc:
            if not self._done_received[peer].is_set():
                self._lost.setdefault(peer, f"send failed: {first_line(exc)}")
            self._done_sent[peer].set()
            self._notify()
            return False

    def _receive_loop(self, peer: int) -> None:
        try:
            while True:
                header = torch.zeros(4, dtype=torch.int64)
                if not self._recv(peer, header, tag=0):
                    return
                kind, step, version, size = (int(x) for x in header)
                with_body = kind in (DATA, WEIGHTS)
                limit = self._handler.body_limit(peer, kind, step, version, size) if with_body else 0
                body, refused = self._read_body(peer, size, limit)  # a body where none belongs is drained
                if body is None:
                    return  # the connection closed while draining
                if refused is None and with_body and size < 1:
                    refused = "an empty body"
                if refused is not None:
                    self._refused(peer, kind, step, refused)
                if kind == PING:
                    continue
                if kind == DONE:
                    self._done_received[peer].set()
                    self.outboxes[peer].clear_parcels()  # nothing more is used there: answer at once
                    self.outboxes[peer].put_done()  # (a no-op if ours went already)
                    self._notify()
                    return
                if self._finishing.is_set() or kind not in KIND_NAMES or (kind == TAKEN and refused):
                    continue  # drained, not used: this rank has finished, or a kind it does not know
                self._handler.deliver(peer, kind, step, version, body, refused)
                self._notify()
        except Exception as exc:  # this code's own failure (a handler's), not the connection's
            self._failed.setdefault(peer, ("receive", exc))
            self._done_received[peer].set()
            self._notify()

    def _refused(self, peer: int, kind: int, step: int, reason: str) -> None:
        """Log a refused message: the first few of each peer, then only their count (a peer cannot flood the log)."""
        self.refused[peer] = self.refused.get(peer, 0) + 1
        count = self.refused[peer]
        if count <= 3:
            log.warning("rank %d: peer rank %d sent %s of step %d: %s; refused%s", self.rank, peer,
                        KIND_NAMES.get(kind, f"an unknown kind {kind}"), step, reason,
                        "" if count < 3 else " (further refusals from this peer are counted, not logged)")

    def _recv(self, peer: int, tensor: torch.Tensor, tag: int) -> bool:
        """Receive into `tensor`; False when the connection closed (the peer is lost unless it said DONE)."""
        try:
            dist.recv(tensor, group=self.group, tag=tag, group_src=peer)
            return True
        except Exception as exc:
            if not self._done_received[peer].is_set():
                self._lost.setdefault(peer, f"receive failed: {first_line(exc)}")
                self._done_received[peer].set()  # nothing more will come from it
            self._notify()
            return False

    def _read_body(self, peer: int, size: int, limit: int) -> tuple[torch.Tensor | None, str | None]:
        """The body, received whole if 0 <= size <= limit, else read through and refused (empty, with a reason);
        None when the connection closed."""
        honest = 0 <= size <= limit
        body = torch.empty(size if honest else 0, dtype=torch.int32)
        scratch = None if honest else torch.empty(max(0, min(size, CHUNK_WORDS)), dtype=torch.int32)
        for start in range(0, max(size, 0), CHUNK_WORDS):
            n = min(CHUNK_WORDS, size - start)
            if not self._recv(peer, body[start : start + n] if honest else scratch[:n], tag=1):
                return None, None
        refused = None if honest else f"{size} words announced, an honest one holds at most {limit}"
        return body, refused
