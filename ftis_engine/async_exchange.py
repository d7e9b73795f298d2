"""Asynchronous exchange (swarm.mode: async, the HeteroRL setting): nobody waits for anybody.

A member publishes its scored rollouts of a step as one parcel (the wire buffer of rollouts.py) and, before each
update, collects the parcels that have arrived and are due. A parcel carries the sender's step (its rollouts'
policy version + 1) and the time it was made; the receiver (run.py) drops what is older than swarm.max_staleness
steps or swarm.max_delay_s seconds, and validates and re-scores the rest exactly as in sync mode.

Apart from exchange.py because it is a different protocol (mailboxes and threads, not collectives):
    LocalAsyncExchange        every member in this process; deliveries delayed by swarm.latency only
    DistributedAsyncExchange  one member per process; a dedicated gloo process group, one sending and one
                              receiving thread per peer (point-to-point), so a slow or finished peer holds up
                              nobody. Rollouts are a few bytes a token and live on the CPU, so they go over gloo
                              even between GPUs (NCCL has no thread-safe point-to-point from a side thread).
swarm.latency adds a simulated delay to every delivery, in steps or seconds, on either transport.

Leaving: a member that has finished sends DONE to every peer (after everything it queued for it); a peer answers
DONE when it receives one (and sends nothing after it). A member closes when it has sent DONE to every peer and
received DONE from every peer, so no buffer is ever in flight towards a closed process and a peer's late buffers
are drained, never waited for. A peer whose connection closes without DONE is lost: the next collect raises
PeerLost (the rank stops, and the elastic agent restarts the swarm from the newest complete checkpoint).
"""

from __future__ import annotations

import datetime
import logging
import queue
import random
import threading
import time
from dataclasses import dataclass

import torch

from .config import LatencySettings
from .exchange import DistributedExchange, LocalExchange

log = logging.getLogger("ftis_engine.exchange")

CHUNK_WORDS = 1 << 20  # a body goes in pieces of at most 4 MiB: a receiver drains a refused body in bounded memory
DATA, DONE, WEIGHTS, PING = 0, 1, 2, 3


class PeerLost(RuntimeError):
    """A peer's connection closed before it said DONE (killed, crashed or unreachable)."""


@dataclass
class Parcel:
    """One member's rollouts of one step, on their way to one receiver."""

    sender: int
    step: int  # the sender's step that made them (their policy version + 1)
    buffer: torch.Tensor  # the wire buffer (rollouts.encode, whose rollouts carry when they were made); empty
    # when the receiver refused its size
    due_step: int = 0  # the receiver's first step that may use it (latency in steps)
    due_time: float = 0.0  # the first wall time it may be used (latency in seconds)


class Latency:
    """swarm.latency: the simulated delay of each (sender, receiver, step) delivery, drawn reproducibly."""

    def __init__(self, settings: LatencySettings, seed: int):
        self.settings = settings
        self.seed = seed

    def delay(self, sender: int, receiver: int, step: int) -> float:
        low, high = self.settings.min, self.settings.max
        if low == high:
            return low
        rng = random.Random(f"{self.seed}-latency-{sender}-{receiver}-{step}")
        return float(rng.randint(int(low), int(high))) if self.settings.unit == "steps" else rng.uniform(low, high)

    def schedule(self, parcel: Parcel, receiver: int, from_step: int | None = None) -> Parcel:
        """Set when the parcel becomes usable. No simulated delay: as soon as it has arrived. In steps: from the
        sender's step (from_step: another step to count from, e.g. a sampler's parcel, whose step is its round,
        counts from the receiver's step at arrival); in seconds: from now (its arrival)."""
        if self.settings.is_zero:
            return parcel
        delay = self.delay(parcel.sender, receiver, parcel.step)
        if self.settings.unit == "steps":
            parcel.due_step = (parcel.step if from_step is None else from_step) + int(delay)
        else:
            parcel.due_time = time.time() + delay
        return parcel


class Mailbox:
    """A receiver's parcels that have arrived, released when due (thread-safe: a receiving thread fills it)."""

    def __init__(self) -> None:
        self._parcels: list[Parcel] = []
        self._lock = threading.Lock()
        self.step = 0  # the receiver's newest step that collected (a sampler parcel's delay counts from it)

    def put(self, parcel: Parcel) -> None:
        with self._lock:
            self._parcels.append(parcel)

    def take_due(self, step: int, now: float) -> list[Parcel]:
        due, waiting = [], []
        with self._lock:
            self.step = step
            for parcel in self._parcels:
                (due if parcel.due_step <= step and parcel.due_time <= now else waiting).append(parcel)
            self._parcels = waiting
        return sorted(due, key=lambda p: (p.step, p.sender))

    def __len__(self) -> int:
        with self._lock:
            return len(self._parcels)


class LocalAsyncExchange(LocalExchange):
    """Every member in this process: a parcel goes straight into each peer's mailbox, delayed by the latency
    (the start's collectives are LocalExchange's: there is nobody to wait for)."""

    def __init__(self, members: list[int], latency: Latency):
        self.latency = latency
        self.mailboxes = {m: Mailbox() for m in members}

    def publish(self, buffers: dict[int, torch.Tensor], step: int) -> dict[int, int]:
        """Post each local member's buffer of `step` to every peer; returns the bytes each put on the wire."""
        for sender, buffer in buffers.items():
            for receiver, box in self.mailboxes.items():
                if receiver != sender:
                    box.put(self.latency.schedule(Parcel(sender, step, buffer), receiver))
        return {m: 4 * b.numel() if len(self.mailboxes) > 1 else 0 for m, b in buffers.items()}

    def collect(self, receiver: int, step: int) -> list[Parcel]:
        return self.mailboxes[receiver].take_due(step, time.time())

    def in_flight(self, receiver: int) -> int:
        return len(self.mailboxes[receiver])

    def finish(self) -> None:
        """Nothing crosses a process: what is still in a mailbox is simply not used."""


class DistributedAsyncExchange(DistributedExchange):
    """One member per process. The collectives of the run's start (agreeing on prompts, vocabulary, the
    checkpoint to resume) go through the default group as in sync mode; rollouts go point to point over a
    dedicated gloo group, by background threads. `start(limit)` begins the exchange: limit(sender, step) is the
    most words an honest buffer of that sender's step holds (a larger one is drained and refused unread)."""

    def __init__(self, rank: int, world_size: int, device: torch.device, backend: str, latency: Latency,
                 timeout_s: float, learners: int | None = None):
        """learners: ranks 0..learners-1 train (the rest are sampler ranks, which receive no rollouts)."""
        super().__init__(rank, world_size, device, backend)
        import torch.distributed as dist

        # a group of its own: its point-to-point traffic never interleaves with the default group's collectives
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.timeout_s = timeout_s
        self.latency = latency
        self.peers = [p for p in range(world_size) if p != rank]
        self.learners = learners if learners is not None else world_size
        self.targets = [p for p in range(self.learners) if p != rank]
        # a sampler rank: the one peer it takes weights from (its learner), their size, and the newest version
        self.weights_from: int | None = None
        self.weights_words = 0
        self.weights_version = -1
        self.last_version = 1 << 62  # the largest version an honest learner pushes (train.steps - 1)
        self._weights: tuple[int, torch.Tensor] | None = None
        self._weights_lock = threading.Lock()
        self._pending_weights: dict[int, tuple[int, torch.Tensor]] = {}  # peer -> (version, words): the newest
        # rollouts and pings keep every direction busy: gloo closes a rank's whole group when one receive waits
        # longer than the group's timeout, and some directions (a sampler to another sampler) carry nothing else
        self.ping_every_s = max(0.05, min(60.0, timeout_s / 4))
        self.mailbox = Mailbox()
        self._outboxes: dict[int, queue.Queue] = {p: queue.Queue() for p in self.peers}
        self._done_sent = {p: threading.Event() for p in self.peers}
        self._done_received = {p: threading.Event() for p in self.peers}
        self._finishing = threading.Event()
        self._lost: dict[int, str] = {}
        self._limit = None

    def start(self, limit) -> None:
        self._limit = limit
        for peer in self.peers:
            for target in (self._send_loop, self._receive_loop):
                threading.Thread(target=target, args=(peer,), daemon=True,
                                 name=f"ftis-{target.__name__[1:]}-{peer}").start()

    # -- the training loop's side: never blocks

    def publish(self, buffers: dict[int, torch.Tensor], step: int) -> dict[int, int]:
        buffer = buffers[self.rank].to(torch.int32).contiguous()
        for peer in self.targets:
            if not self._done_received[peer].is_set():  # a peer that left gets nothing more
                self._outboxes[peer].put((DATA, step, buffer))
        return {self.rank: 4 * buffer.numel() if self.targets else 0}

    def push_weights(self, samplers: list[int], flat: torch.Tensor, version: int) -> None:
        """Queue a learner's weights (flat int32 words, see samplers.flatten_weights) of `version` to its samplers.
        One slot per sampler: weights not yet sent are replaced by newer ones (a slow link never piles copies)."""
        for peer in samplers:
            if not self._done_received[peer].is_set():
                with self._weights_lock:
                    queued = peer in self._pending_weights
                    self._pending_weights[peer] = (version, flat)
                if not queued:
                    self._outboxes[peer].put((WEIGHTS, 0, None))

    def check(self) -> None:
        """Raise PeerLost if a peer's connection closed before it said DONE."""
        lost = dict(self._lost)
        if lost:
            peer, reason = next(iter(lost.items()))
            raise PeerLost(f"peer rank {peer} is gone without finishing ({reason})")

    def take_weights(self) -> tuple[int, torch.Tensor] | None:
        """The newest weights that arrived since the last call (version, flat words), or None."""
        with self._weights_lock:
            newest, self._weights = self._weights, None
        return newest

    def peer_done(self, peer: int) -> bool:
        return self._done_received[peer].is_set()

    def collect(self, receiver: int, step: int) -> list[Parcel]:
        self.check()
        return self.mailbox.take_due(step, time.time())

    def in_flight(self, receiver: int) -> int:
        return len(self.mailbox)

    def finish(self) -> None:
        """Say DONE to every peer and wait for every peer's DONE (a peer answers as soon as it reads ours; what
        arrives meanwhile is drained, not used). Bounded by the group's timeout."""
        self._finishing.set()
        for peer in self.peers:
            self._outboxes[peer].put((DONE, 0, None))
        deadline = time.time() + self.timeout_s
        for peer in self.peers:
            while not (self._done_received[peer].is_set() or peer in self._lost):
                if time.time() > deadline:
                    log.warning("rank %d: peer rank %d did not say DONE in time; leaving anyway", self.rank, peer)
                    break
                self._done_received[peer].wait(0.05)
        for peer in self.peers:
            self._done_sent[peer].wait(max(0.0, deadline - time.time()))

    # -- the threads

    def _send_loop(self, peer: int) -> None:
        import torch.distributed as dist

        try:
            while True:
                try:
                    kind, step, buffer = self._outboxes[peer].get(timeout=self.ping_every_s)
                except queue.Empty:
                    kind, step, buffer = PING, 0, None
                if self._done_sent[peer].is_set():
                    continue
                if kind == WEIGHTS:
                    with self._weights_lock:
                        step, buffer = self._pending_weights.pop(peer)
                size = 0 if buffer is None else buffer.numel()
                dist.send(torch.tensor([kind, step, size], dtype=torch.int64), dst=peer, group=self.group, tag=0)
                for start in range(0, size, CHUNK_WORDS):
                    dist.send(buffer[start : start + CHUNK_WORDS], dst=peer, group=self.group, tag=1)
                if kind == DONE:
                    self._done_sent[peer].set()
                    return
        except Exception as exc:  # the peer's connection closed
            if not self._done_received[peer].is_set():
                self._lost.setdefault(peer, f"send failed: {_first_line(exc)}")
            self._done_sent[peer].set()

    def _receive_loop(self, peer: int) -> None:
        import torch.distributed as dist

        try:
            while True:
                header = torch.zeros(3, dtype=torch.int64)  # kind, step (a weight push: its version), body words
                dist.recv(header, src=peer, group=self.group, tag=0)
                kind, step, size = (int(x) for x in header)
                if kind == PING:
                    continue
                if kind == DONE:
                    self._done_received[peer].set()
                    self._outboxes[peer].put((DONE, 0, None))  # answer (a no-op if ours went already)
                    return
                body = self._read_body(peer, step, size, kind)
                if self._finishing.is_set():
                    continue  # drained, not used: this member has finished
                if kind == WEIGHTS:
                    if body.numel():
                        with self._weights_lock:
                            self._weights = (step, body)  # the newest wins: a sampler skips versions it missed
                            self.weights_version = step
                    continue
                if kind != DATA:
                    continue  # an unknown kind: read through, refused
                parcel = Parcel(peer, step, body)
                sampler = peer >= self.learners  # its step is a round: a simulated delay counts from our step
                self.mailbox.put(self.latency.schedule(parcel, self.rank, self.mailbox.step if sampler else None))
        except Exception as exc:
            if not self._done_received[peer].is_set():
                self._lost.setdefault(peer, f"receive failed: {_first_line(exc)}")
                self._done_received[peer].set()  # nothing more will come from it

    def _read_body(self, peer: int, step: int, size: int, kind: int = DATA) -> torch.Tensor:
        """The body of a DATA (or WEIGHTS) message: received whole if its size is honest, else read through and
        refused. Weights are accepted only in exactly the size of this rank's model."""
        import torch.distributed as dist

        size = max(size, 0)  # a negative size announces an empty body
        if kind == WEIGHTS:  # only from this sampler's learner, in the model's size, a newer version it can use
            limit = self.weights_words
            honest = (size == limit > 0 and peer == self.weights_from
                      and self.weights_version < step <= self.last_version)
        elif kind == DATA:
            limit = self._limit(peer, step) if self._limit is not None else size
            honest = 1 <= size <= limit
        else:
            limit, honest = 0, False
        body = torch.empty(size if honest else 0, dtype=torch.int32)
        scratch = None if honest else torch.empty(min(size, CHUNK_WORDS), dtype=torch.int32)
        for start in range(0, max(size, 0), CHUNK_WORDS):
            n = min(CHUNK_WORDS, size - start)
            dist.recv(body[start : start + n] if honest else scratch[:n], src=peer, group=self.group, tag=1)
        if not honest:
            log.warning("rank %d: peer rank %d sent a message of kind %d, %d words for step %d (an honest one holds "
                        "at most %d); refused", self.rank, peer, kind, size, step, limit)
        return body

    def close(self) -> None:
        super().close()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__
