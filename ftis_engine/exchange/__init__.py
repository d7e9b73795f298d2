"""How members exchange rollouts: one protocol, a sync and an async implementation, and one receiver.

Every step a member `send`s its scored rollouts (one wire buffer, rollouts.encode) and `receive`s what its peers
sent as parcels; admission.py then decides what it trains on (the same checks in both modes). The transports:

    local.InProcess           every member in this process (async: deliveries delayed by swarm.latency only)
    sync.DistributedSync      one endpoint (member) per process; every member waits for every member each step
    async_.DistributedAsync   one member (or sampler) per process; nobody waits for anybody, except as far as
                              the lead bound (pacer.py) keeps a member from its slowest live peer
    Silent                    nothing on the wire: collaboration: alone (over any of them), and a member's further
                              rank (members.N.ranks > 1), whose leader exchanges for it

The collectives of a run's start and checkpoints (barrier, all_agree, gather_records, all_gather_object) are the
transport's `collectives`: sync.Collectives for both distributed transports, sync.LocalCollectives in one process.
A transport fails with PeerLost (a peer is gone, or hung past swarm.timeout_s) or TransportError (its own failure);
each torch.distributed collective of the engine runs in `collective`, which names its failure PeerLost.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..core.dist import PeerLost, collective  # noqa: F401  (re-exported: the transports fail with them)

Limit = Callable[[int, int], int]  # (sender rank, step) -> the most words an honest parcel holds (0: none)


@dataclass
class Parcel:
    """One sender's rollouts of one step (a sampler's: of one round), on their way to one receiver."""

    sender: int  # the sender's rank (in one process: its member index)
    step: int  # the sender's step (a sampler's round) that made them
    version: int  # the policy version the sender declares for them (a learner's: step - 1)
    buffer: torch.Tensor  # the wire buffer; empty when the transport refused it (see `refused`)
    due_step: int = 0  # simulated latency: the receiver's first step that may use it
    due_time: float = 0.0  # simulated latency: the first wall time it may be used
    refused: str | None = None  # why the transport refused it unread (its size), or None
    tokenizer: str = ""  # open swarm: its sender's tokenizer hash where not the receiver's (admitted only with it)


@dataclass(frozen=True)
class Peers:
    """Who a member's peers are as of one receive, where membership changes (an open swarm's transport says it in
    Arrivals.peers; one world's is fixed by the config): the receiver and the schedule read it from there, and no
    transport writes into them."""

    live: tuple[int, ...]  # the live members it trains on, by local number (itself, 0, included)
    foreign: dict[int, object]  # the peers of another tokenizer whose tokenizer loaded and checked here, by number


@dataclass
class Arrivals:
    """What one receive() brought a member, and what it cost."""

    parcels: list[Parcel] = field(default_factory=list)  # the peers' parcels, never the member's own
    wait_seconds: float = 0.0  # waiting for peers (sync: the slowest peer's step; async: lead waits and locks)
    lead_wait_seconds: float = 0.0  # async: of wait_seconds, the wait at the lead bound (pacer.py)
    lead_steps: int | None = None  # async across processes: how far this member's step was ahead of its slowest
    # live peer's newest published step when it asked (None: no live peer)
    seconds: float = 0.0  # the transfer itself (sync)
    waiting: int = 0  # parcels that arrived and are not due yet (simulated latency, or ahead of the lead bound)
    dropped_sequences: int = 0  # sequences the transport dropped unread since the last receive (a full mailbox)
    outbox_dropped: int = 0  # sequences of this rank's parcels dropped unsent since the last receive (a full outbox)
    link_refused: int = 0  # one-world async: messages from peers the links refused since the last receive
    link_reconnects: int = 0  # one-world async: connections to peers that closed and came back since then
    foreign_refused: int = 0  # open swarm: sequences of peers of another tokenizer refused unread (not trained on)
    peers: Peers | None = None  # open swarm: its membership as of this receive (None: fixed by the config)


class TransportError(RuntimeError):
    """The transport failed for a reason of its own (not a lost connection)."""


class Collectives(Protocol):
    """The few collectives a run's start and its checkpoints need (sync.Collectives across processes,
    sync.LocalCollectives in one process)."""

    def barrier(self) -> None: ...

    def all_agree(self, value: int) -> int: ...

    def gather_records(self, records: list[dict]) -> list[dict]: ...

    def all_gather_object(self, value: object) -> list: ...

    def close(self) -> None: ...


class Exchange(Protocol):
    """What the step loop, the samplers and the run's start need from a transport."""

    rank: int
    world_size: int
    collectives: Collectives

    def start(self, limit: Limit, start_step: int = 0, weights: WeightSlot | None = None) -> None:
        """Begin exchanging (after every rank has opened the run): limit(sender, step) bounds what a receiver
        allocates for a peer's parcel; start_step is the step the run (re)starts after; weights: a sampler's slot
        for its learner's weights (None for a learner)."""

    def send(self, buffers: dict[int, torch.Tensor], step: int) -> dict[int, int]:
        """Send each local member's buffer of `step` to its peers; returns the bytes each put on the wire."""

    def receive(self, receiver: int, step: int) -> Arrivals:
        """The parcels that local member `receiver` may use at `step`."""

    def weights_format(self) -> tuple[torch.dtype, torch.device]:
        """How push_weights takes a learner's flat trainable weights (samplers.flatten_weights): float32 (as int32
        words) on the CPU for the links, or a weight broadcast's dtype and device."""

    def push_weights(self, samplers: list[int], flat: torch.Tensor, version: int) -> None:
        """Send a learner's weights of `version` (flat, in weights_format) to its samplers (their endpoints)."""

    def finish(self) -> None:
        """Leave the exchange (async: say DONE to every peer and drain what they still send)."""


class SamplerExchange(Exchange, Protocol):
    """What a sampler rank's loop (samplers.run_sampler) needs of its transport, besides the Exchange's: one world's
    async_.DistributedAsync and an open swarm's openswarm.member.OpenSampler."""

    broadcast: object | None  # its learner's weight broadcast (exchange.weights.WeightBroadcast), or None: links

    def check(self) -> None:
        """Raise what ended the transport (a learner lost, a link failed); nothing while it is well."""

    def peer_done(self, learner: int) -> bool:
        """Its learner has finished."""

    def wait_taken(self, round_: int) -> float:
        """Before round `round_`: the lead bound's backpressure (pacer.py); returns the seconds waited."""

    def send_parcel(self, buffer: torch.Tensor, round_: int, version: int) -> int:
        """Publish one round's rollouts (a wire buffer) made with weights `version`; returns the bytes sent."""


class WithoutSamplers:
    """The weight side of the Exchange protocol for a transport that has no samplers (config allows them only in
    async mode across processes): nothing to start, and a push is a bug."""

    def weights_format(self) -> tuple[torch.dtype, torch.device]:
        return torch.float32, torch.device("cpu")

    def push_weights(self, samplers: list[int], flat: torch.Tensor, version: int) -> None:
        raise RuntimeError(f"{type(self).__name__} has no samplers to push weights to")


class WeightSlot:
    """A sampler's inbox for its learner's weights: accepted only from that learner (`source`), exactly `words`
    long, of a version newer than the one it holds and at most `last_version` (an honest learner pushes none after
    its last step). The newest replaces one not yet taken: a sampler skips versions it missed."""

    def __init__(self, source: int, words: int, version: int, last_version: int):
        self.source = source
        self.words = words
        self.version = version  # the newest version received (or the start's)
        self.last_version = last_version
        self._newest: tuple[int, torch.Tensor] | None = None
        self._lock = threading.Lock()

    def limit(self, peer: int, version: int) -> int:
        with self._lock:
            fits = peer == self.source and self.words > 0 and self.version < version <= self.last_version
        return self.words if fits else 0

    def put(self, version: int, words: torch.Tensor) -> None:
        with self._lock:
            if version > self.version and words.numel() == self.words:
                self._newest, self.version = (version, words), version

    def take(self) -> tuple[int, torch.Tensor] | None:
        """The newest weights that arrived since the last call (version, flat words), or None."""
        with self._lock:
            newest, self._newest = self._newest, None
        return newest


def wire_bytes_sent(buffer: torch.Tensor, receivers: int) -> int:
    """What a buffer costs on the wire: 4 bytes a word when anyone receives it, else nothing."""
    return 4 * buffer.numel() if receivers > 0 else 0


class Silent(WithoutSamplers):
    """A transport that puts nothing on the wire and delivers nothing: a run with collaboration: alone (`alone`,
    over the transport it would have had, whose start, collectives and DONE handshake still run), and a member's
    further rank (`shard`: its leader exchanges for it and hands it what it admitted; the run's start and
    checkpoints still gather every rank)."""

    def __init__(self, collectives: Collectives, rank: int, world_size: int, underneath: Exchange | None = None):
        self.collectives = collectives
        self.rank = rank
        self.world_size = world_size
        self.underneath = underneath

    @classmethod
    def alone(cls, transport: Exchange) -> Silent:
        return cls(transport.collectives, transport.rank, transport.world_size, transport)

    @classmethod
    def shard(cls, collectives: Collectives, member: int, endpoints: int) -> Silent:
        """A further rank of `member`: its endpoint is its leader's (the member's index)."""
        return cls(collectives, member, endpoints)

    def start(self, limit: Limit, start_step: int = 0, weights: WeightSlot | None = None) -> None:
        if self.underneath is not None:
            self.underneath.start(limit, start_step)

    def send(self, buffers: dict[int, torch.Tensor], step: int) -> dict[int, int]:
        return {m: 0 for m in buffers}

    def receive(self, receiver: int, step: int) -> Arrivals:
        return Arrivals()

    def finish(self) -> None:
        if self.underneath is not None:  # async: say DONE; a shard's leader says it for the member
            self.underneath.finish()
