"""Async transports (swarm.mode: async, the HeteroRL setting): a member publishes its scored rollouts of a step as
one parcel and, before its update, takes the parcels that have arrived and are due. Nobody waits for anybody,
except as far as the bounds below say; nothing grows without bound in a long run.

- **Lead** (across processes): the lead bound of exchange/pacer.py. A member at step t waits for every live peer
  to publish step t - K, and takes no parcel more than K versions ahead; a peer that has said DONE holds nobody
  back. The publication counted is the parcel's arrival (a simulated swarm.latency delays its use, not its arrival).
- **Samplers**: a sampler generates its round r only when its learner has taken its round r - 1 - K (a TAKEN
  message), so at most K + 1 of its rounds are in flight.
- **Bounded queues**: a mailbox keeps at most `capacity` parcels per sender and an outbox at most `capacity` per
  peer (pacer.queue_capacity); the oldest make room for a newer one and are counted (dropped_sequences,
  outbox_dropped).

swarm.latency adds a simulated delay to every delivery, in steps or seconds, on either transport.
"""

from __future__ import annotations

import random
import threading
import time

import torch

from ..config import LatencySettings, RunConfig
from ..topology.layout import endpoint_roles, learner_endpoints, sampler_endpoints
from ..data.rollouts import claimed_sequences
from ..topology.schedule import learner_version
from . import Arrivals, Limit, Parcel, TransportError, WeightSlot, collective, wire_bytes_sent
from .links import Links
from .messages import DATA, TAKEN, WEIGHTS
from .pacer import Pacer, queue_capacity
from .sync import Collectives


def gather_addresses(address: str, endpoints: int, group) -> list[str]:
    """Every endpoint's links address, in endpoint order: one gather over the endpoints' gloo group (its only
    traffic), each checked to be a tcp:// address."""
    import torch.distributed as dist

    addresses: list = [None] * endpoints
    with collective("gathering the links' addresses"):
        dist.all_gather_object(addresses, address, group=group)
    for endpoint, value in enumerate(addresses):
        if not (isinstance(value, str) and value.startswith("tcp://")):
            raise TransportError(f"endpoint {endpoint} announced a links address {value!r}, not tcp://HOST:PORT")
    return addresses


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
        counts from the receiver's newest step that took parcels when it arrived); in seconds: from now (its
        arrival)."""
        if self.settings.is_zero:
            return parcel
        delay = self.delay(parcel.sender, receiver, parcel.step)
        if self.settings.unit == "steps":
            parcel.due_step = (parcel.step if from_step is None else from_step) + int(delay)
        else:
            parcel.due_time = time.time() + delay
        return parcel


class Mailbox:
    """A receiver's parcels that have arrived, released when due (thread-safe: the transport's receiving thread
    fills it). At most `capacity` wait per sender: a newer one pushes out the sender's oldest (counted in its
    sequences)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._parcels: dict[int, list[Parcel]] = {}
        self._lock = threading.Lock()
        self._dropped = 0
        self.step = 0  # the receiver's newest step that took parcels (a sampler parcel's delay counts from it)

    def put(self, parcel: Parcel) -> None:
        with self._lock:
            box = self._parcels.setdefault(parcel.sender, [])
            box.append(parcel)
            if len(box) > self.capacity:
                oldest = min(range(len(box)), key=lambda i: box[i].step)
                self._dropped += claimed_sequences(box.pop(oldest).buffer)

    def take_due(self, step: int, now: float, newest_version: int | None = None) -> list[Parcel]:
        """The parcels due at the receiver's `step` (and wall time `now`) whose version is at most newest_version
        (None: any), by step then sender; the rest stay."""
        due = []
        with self._lock:
            self.step = step
            for sender, box in list(self._parcels.items()):
                ready = [p.due_step <= step and p.due_time <= now
                         and (newest_version is None or p.version <= newest_version) for p in box]
                due += [p for p, r in zip(box, ready) if r]
                rest = [p for p, r in zip(box, ready) if not r]
                if rest:
                    self._parcels[sender] = rest
                else:  # an open swarm's senders come and go: an emptied box goes with them
                    del self._parcels[sender]
        return sorted(due, key=lambda p: (p.step, p.sender))

    def take_dropped(self) -> int:
        """Sequences pushed out since the last call."""
        with self._lock:
            dropped, self._dropped = self._dropped, 0
        return dropped

    def __len__(self) -> int:
        with self._lock:
            return sum(len(box) for box in self._parcels.values())


class DistributedAsync:
    """One member (or one sampler) per process. The collectives of the run's start go through the default group as
    in sync mode; rollouts, weights and the samplers' progress go point to point over `Links` (ZeroMQ)."""


    def __init__(self, collectives: Collectives, config: RunConfig, latency: Latency, endpoint: int | None = None,
                 group=None, broadcast=None):
        self.collectives = collectives
        self.rank = collectives.rank if endpoint is None else endpoint  # its endpoint: rank in the links' group
        roles = endpoint_roles(config)
        self.world_size = len(roles)  # the endpoints (layout.py): a member's further ranks never exchange
        self.member, self.sampler = roles[self.rank]
        self.targets = [r for r in learner_endpoints(config) if r != self.rank]  # rollouts go to the learners only
        self.lead_peers = self.targets if self.sampler is None else []
        self.own_samplers = sampler_endpoints(config, self.member) if self.sampler is None else []
        self.learner = self.member  # a sampler's learner is its member's rank
        self.pacer = Pacer(config, config.members[self.member].name if self.sampler is None
                           else f"{config.members[self.member].name}/sampler-{self.sampler}")
        self.steps = config.train.steps
        self.timeout_s = config.swarm.timeout_s
        self.latency = latency
        capacity = queue_capacity(config)
        self.links = Links(self.rank, self.world_size, self.timeout_s, outbox_capacity=capacity,
                           gather=lambda address: gather_addresses(address, self.world_size, group))
        self.mailbox = Mailbox(capacity)
        self._limit: Limit | None = None
        self.weights: WeightSlot | None = None
        self._published = {p: 0 for p in self.lead_peers}  # the newest step each learner peer has published
        self._taken: dict[int, int] = {}  # own sampler -> the newest of its rounds this learner has taken
        self.taken = 0  # a sampler: the newest of its rounds its learner has taken
        self._outbox_dropped = 0
        self._link_counts = (0, 0)  # the links' refused and reconnects at the last receive
        # weights.WeightBroadcast: a learner's weights to its samplers in a group of their own (None: the links)
        self.broadcast = broadcast

    def start(self, limit: Limit, start_step: int = 0, weights: WeightSlot | None = None) -> None:
        """Start the links. A restarted run counts every peer as having published the restored step (and a
        sampler's rounds up to it as taken). weights: a sampler's slot for its learner's weights."""
        self._limit = limit
        self.weights = weights
        self._published = {p: start_step for p in self.lead_peers}
        self.mailbox.step = max(self.mailbox.step, start_step)  # a resumed run's peers go on from start_step
        self._taken = {s: start_step for s in self.own_samplers}
        self.taken = start_step
        self.links.start(self, self.largest_message(limit, weights))
        if self.broadcast is not None and weights is not None:
            self.broadcast.start(weights)

    # -- the training loop's side

    def send(self, buffers: dict[int, torch.Tensor], step: int) -> dict[int, int]:
        return {self.rank: self.send_parcel(buffers[self.rank], step, learner_version(step))}

    def send_parcel(self, buffer: torch.Tensor, step: int, version: int) -> int:
        """Queue a parcel (a learner's step, or a sampler's round made with weights of `version`) to every
        learner; returns the bytes it puts on the wire."""
        buffer = buffer.to(torch.int32).contiguous()
        for peer in self.targets:
            self.links.post_parcel(peer, step, version, buffer)
        return wire_bytes_sent(buffer, len(self.targets))

    def receive(self, receiver: int, step: int) -> Arrivals:
        start = time.perf_counter()
        published = lambda: {p: self._published[p] for p in self.lead_peers  # noqa: E731  (live peers: not DONE)
                             if not self.links.peer_done(p)}
        lead = self.pacer.lead(step, published())
        lead_wait = self.pacer.hold(step, published, self.links.wait, "peer rank(s)") if self.lead_peers else 0.0
        hung = self.pacer.stalled(published())
        if hung:  # given up on a time-out ago, and not a step since: its process is stuck, its links still answer
            raise TimeoutError(f"swarm.timeout_s: peer rank(s) {', '.join(map(str, hung))} published no step for "
                               f"{2 * self.pacer.timeout_s:g} s while their links answered (hung)")
        self.links.check()
        parcels = self.mailbox.take_due(step, time.time(), self.pacer.newest_version(step))
        for parcel in parcels:  # tell each own sampler the newest of its rounds taken (its backpressure)
            if parcel.sender in self._taken and parcel.step > self._taken[parcel.sender]:
                self._taken[parcel.sender] = parcel.step
                self.links.post_slot(parcel.sender, TAKEN, parcel.step)
        outbox_dropped = sum(box.dropped_sequences for box in self.links.outboxes.values())
        counts = self.links.counts()
        arrivals = Arrivals(parcels, wait_seconds=time.perf_counter() - start, lead_wait_seconds=lead_wait,
                            lead_steps=lead, waiting=len(self.mailbox), dropped_sequences=self.mailbox.take_dropped(),
                            outbox_dropped=outbox_dropped - self._outbox_dropped,
                            link_refused=counts[0] - self._link_counts[0],
                            link_reconnects=counts[1] - self._link_counts[1])
        self._outbox_dropped, self._link_counts = outbox_dropped, counts
        return arrivals

    def weights_format(self) -> tuple[torch.dtype, torch.device]:
        """float32 words on the CPU for the links; a weight broadcast's own dtype and device."""
        if self.broadcast is None:
            return torch.float32, torch.device("cpu")
        return self.broadcast.dtype, self.broadcast.device

    def push_weights(self, samplers: list[int], flat: torch.Tensor, version: int) -> None:
        """Queue a learner's weights (flat int32 words) of `version` to its samplers; an unsent copy is replaced.
        With a weight broadcast: send them now, in its dtype (flat in any dtype)."""
        if self.broadcast is not None:
            self.broadcast.push(flat, version)
            return
        for peer in samplers:
            self.links.post_slot(peer, WEIGHTS, 0, version, flat)

    def wait_taken(self, round_: int) -> float:
        """A sampler about to generate `round_`: the lead bound's backpressure (exchange/pacer.py), until its learner
        has taken round_ - 1 - K (or has finished); returns the seconds waited."""
        def reached(need: int) -> bool:
            return self.taken >= need or self.links.peer_done(self.learner)

        waited = self.pacer.hold_sampler(round_, reached, self.links.wait, f"its learner (rank {self.learner})")
        if self.pacer.learner_stalled(reached):  # its process stuck, its links still answering
            raise TimeoutError(f"swarm.timeout_s: its learner (rank {self.learner}) took no round for "
                               f"{2 * self.pacer.timeout_s:g} s while its links answered (hung)")
        return waited

    def peer_done(self, peer: int) -> bool:
        return self.links.peer_done(peer)

    def check(self) -> None:
        self.links.check()
        if self.broadcast is not None:
            self.broadcast.check()

    def finish(self) -> None:
        if self.broadcast is not None and self.sampler is None:
            self.broadcast.close()  # its samplers' receiving threads end
        self.links.finish()
        if self.broadcast is not None and self.sampler is not None:
            self.broadcast.join(self.timeout_s)

    def largest_message(self, limit: Limit, weights: WeightSlot | None) -> int:
        """The most words one honest message to this endpoint holds (the links refuse larger ones unread): a
        learner's, the largest parcel a peer can send (a parcel's size does not depend on its step); a sampler's,
        its learner's weights."""
        if self.sampler is not None:
            return weights.words if weights is not None else 0
        return max((limit(peer, 1) for peer in self.links.peers), default=0)

    # -- the I/O thread's side (links.Handler)

    def body_limit(self, peer: int, kind: int, step: int, version: int, size: int) -> int:
        if kind == DATA:
            return self._limit(peer, step) if self._limit is not None and self.sampler is None else 0
        return self.weights.limit(peer, version) if kind == WEIGHTS and self.weights is not None else 0

    def counts_as_published(self, step: int, refused: str | None) -> bool:
        """Whether a learner peer's DATA message may advance the step it has published (what the lead bound waits on):
        one that was received (not refused for its size), of a step inside the run; it counts for at most K + 1 past
        this member's newest step (Pacer.credited)."""
        return refused is None and 1 <= step <= self.steps

    def deliver(self, peer: int, kind: int, step: int, version: int, body: torch.Tensor, refused: str | None) -> None:
        if kind == DATA:
            parcel = Parcel(peer, step, version, body, refused=refused)
            from_step = self.mailbox.step if peer not in self._published else None  # a sampler's round: our step
            self.mailbox.put(self.latency.schedule(parcel, self.rank, from_step))
            if peer in self._published and self.counts_as_published(step, refused):
                self._published[peer] = max(self._published[peer], self.pacer.credited(step, self.mailbox.step))
        elif kind == WEIGHTS and refused is None and self.weights is not None:
            self.weights.put(version, body)
        elif kind == TAKEN and peer == self.learner and self.sampler is not None:
            self.taken = max(self.taken, step)
