"""A member training in an open swarm (`ftis-engine train --config MEMBER.yaml --join tcp://HOST:PORT`).

Its config has exactly one member; the swarm's shared settings must equal the coordinator's. Its exchange
(OpenExchange) joins the coordinator, publishes each step's parcel and takes its peers' parcels into the same
receiver (admission) as every other mode; its schedule (openswarm/schedule.py) gives each member its own prompts:

- **Prompts without a global deal.** Member N's step t draws rollout.prompts_per_step prompts, whole groups, from
  a shuffle seeded by (seed, N) of the training prompts (vertical collaboration). A receiver recomputes a peer's
  deal from its name and step, so "exactly what was dealt to that peer" keeps its force with membership changing.
- **Peers by name.** Peers are numbered locally in order of first sight (the member itself is 0); a peer's
  rollouts carry member 0 (its own config's index) on the wire and are renumbered on arrival.
- **The lead bound (K, exchange/pacer.py) counts live members only.** Before its step t a member waits (at most
  swarm.timeout_s, then goes on without it, warned) until every live peer it trains on has published step t - K (its
  parcels, or the step the coordinator heard from it); a peer that left or whose lease expired holds nobody back, and
  one that made it wait swarm.timeout_s is not waited for again until it has caught up (a live peer that never
  publishes costs one time-out, not one a step). A newcomer starts at its step 1: the live members wait for it to come
  within K of them (K null: nobody waits, and its rollouts are trained on once they are within max_staleness).
- **A member on several ranks** (`--nproc R` for members.0.ranks=R, or torchrun) has its own process group: its
  leader holds the exchange (this class) and hands the shards what it admitted, as in the one-world modes.
- **A member with samplers** (members.0.samplers=S: `--nproc R+S` or torchrun) takes its learner's weights on its
  samplers by broadcast in its own process group (NCCL between GPUs, gloo on the CPU), as in one world; each
  sampler joins the coordinator under `<member>/sampler-<k>` (a name no member can take: `/` is not allowed in
  one), publishes its rounds there and receives nothing. Its rounds draw from that name's stream, so a receiver
  checks them like a learner's, with a sampler's version rules: its own member's samplers hold the resumed step or
  a multiple of its weight_sync_every up to its last step (and are its own rollouts: not screened); another
  member's hold any version up to the run's last step (their weight_sync_every is not known here). Anyone can join
  under a sampler's name, so a learner takes a parcel as its own sampler's only when k is below its
  members.0.samplers and the parcel is signed (wire.parcel_mac) with the key the learner gave its samplers at the
  start, by broadcast in their own process group (share_key): the key never crosses the coordinator; anything else
  under its samplers' names is refused and counted. Samplers do
  not count in the lead bound; a sampler waits (its backpressure) until its learner's newest step, as the
  coordinator last said, is within K + 1 of its next round, and leaves when its learner finishes (exchange/pacer.py:
  the lead bound K and its waits, as in one world).
- **Peers of another tokenizer.** A member announces where its tokenizer loads from (its `builtin:`, `packaged:` or
  hub spec; a local path is not shareable); a receiver of another tokenizer loads it on first sight, checks that
  it hashes to what the peer joined with, and trains on the peer's text re-encoded, as in one world. A peer whose
  tokenizer cannot be loaded here (a local path, no network, a hash that differs), or any peer of another
  tokenizer when members.0.accept_foreign is false, is not trained on (foreign_refused) and holds nobody back.
"""

from __future__ import annotations

import logging
import secrets
import time

import torch

from ..config import RunConfig
from ..core.errors import shown
from ..data.rollouts import claimed_sequences
from ..exchange import Arrivals, Limit, Parcel, Peers, WeightSlot, WithoutSamplers, wire_bytes_sent
from ..exchange.async_ import Mailbox
from ..exchange.pacer import Pacer, poll, queue_capacity
from ..exchange.sync import LocalCollectives
from ..model.models import ModelSpecError, load_tokenizer, vocabulary_hash
from ..topology.schedule import learner_version
from .client import SwarmClient
from .dht import DhtMembership
from .direct import PeerLinks
from .joining import KEY_BYTES, JoinError, check_joinable, dataset_hash, share_key, shareable
from .rules import max_parcel_bytes, shared_settings
from .schedule import PeerBook, sampler_name, split_sampler
from .wire import mac_matches

log = logging.getLogger("ftis_engine.exchange")

DHT_SCHEME = "dht:"  # --join dht:[MULTIADDR,...]: membership on hivemind's DHT (openswarm/dht.py)


def dht_bootstrap(join: str) -> list[str]:
    """The bootstrap multiaddrs of `--join dht:A,B` ([] for `dht:`: the first member starts the DHT)."""
    return [part for part in join[len(DHT_SCHEME):].split(",") if part]


def links_host(listen: str | None) -> str:
    """The IPv4 address a member's DHT listens on: its --listen host (where its peers reach it), else every one."""
    return listen[len("tcp://"):].rpartition(":")[0] if listen else "0.0.0.0"


def announced(config: RunConfig, swarm) -> tuple[str, str, str]:
    """What a member's process joins the coordinator with, from its opened run: its tokenizer's hash, its training
    set's hash and where its tokenizer loads from ("" for a local path, which is not shareable)."""
    spec = config.members[0].tokenizer or config.members[0].model
    return vocabulary_hash(swarm.members[0].tokenizer), dataset_hash(swarm.task), spec if shareable(spec) else ""


class OpenExchange:
    """The Exchange of a member in an open swarm (see the module)."""

    rank = 0
    world_size = 1
    broadcast = None

    def __init__(self, address: str, config: RunConfig, collectives=None, broadcast=None, listen: str | None = None):
        self.address = address
        self.listen = listen  # swarm.peers_per_step: where its peers dial it (None: behind a NAT, it only dials)
        self.links: PeerLinks | None = None
        self.broadcast = broadcast  # a member with samplers: its weights to them (exchange.weights.WeightBroadcast)
        self.config = config
        self.name = config.members[0].name
        # a member on several ranks: its leader's process group (checkpoints and records gather its shards)
        self.collectives = collectives if collectives is not None else LocalCollectives()
        self.book = PeerBook(self.name)  # the schedule reads names from it; who is live goes up in Arrivals.peers
        self.mailbox = Mailbox(queue_capacity(config))
        self.pacer = Pacer(config, self.name)  # the lead bound (exchange/pacer.py)
        self.timeout_s = config.swarm.timeout_s
        self.tokenizer = ""
        self.dataset = ""
        self.source = ""
        # peer name -> its tokenizer, loaded and checked here: the receiver re-encodes with it (Arrivals.peers)
        self.foreign: dict[str, object] = {}
        self._unloadable: set[tuple[str, str]] = set()  # (peer, tokenizer hash) that cannot be loaded here
        self._tried: set[str] = set()  # peers whose tokenizer was loaded or tried since they joined: once each
        self._changed: set[str] = set()  # peers that announced another tokenizer since: not trained on until they leave
        self._announced: dict[str, str] = {}  # peer -> the tokenizer hash its loaded tokenizer was checked against
        self.client: SwarmClient | None = None
        self._limit: Limit | None = None
        self.foreign_refused = 0  # sequences of peers with another tokenizer, not trained on (the I/O thread's count)
        self._foreign_seen = 0  # of them, already reported
        self.refused = 0  # parcels refused unread (sizes, steps and versions no honest peer sends, forged samplers)
        self._dropped_seen = 0  # the client's dropped parcels already reported
        self.key: bytes | None = None  # what its own samplers sign their parcels with (share_key); None: it has none

    @property
    def _given_up(self) -> set:
        """Live peers the lead bound waited swarm.timeout_s for: not waited for until they catch up."""
        return self.pacer.given_up

    def attach(self, swarm) -> None:
        """What the member's opened run gives the exchange (wiring.Connection.opened): its tokenizer's hash and
        source and its training set's hash, which it joins with."""
        self.tokenizer, self.dataset, self.source = announced(self.config, swarm)

    # ------------------------------------------------------------------------------------------- Exchange

    def start(self, limit: Limit, start_step: int = 0, weights: WeightSlot | None = None) -> None:
        self._limit = limit
        self.mailbox.step = max(self.mailbox.step, start_step)
        if self.broadcast is not None:  # a member with samplers: theirs is the only other key that signs as them
            self.key = share_key(self.broadcast, secrets.token_bytes(KEY_BYTES))
        links = ("", "")
        if self.config.swarm.peers_per_step:  # parcels go member to member; the coordinator keeps membership
            self.links = PeerLinks(self.name, self.listen, self.config.swarm.peers_per_step, self.config.seed,
                                   max_parcel_bytes(self.config), self._deliver, self._live)
            links = (self.links.start(), self.links.public)
        if self.address.startswith(DHT_SCHEME):  # membership on hivemind's DHT: no coordinator at all
            self.client = DhtMembership(dht_bootstrap(self.address), links_host(self.listen), self.name,
                                        self.tokenizer, shared_settings(self.config), self.dataset,
                                        self.config.swarm.lease_s, self.source, links, self.config.train.steps,
                                        client_mode=not self.listen)
            self.client.step = start_step
        else:
            self.client = SwarmClient(self.address, self.name, self.tokenizer, shared_settings(self.config),
                                      self.dataset, max_parcel_bytes(self.config), self._deliver, step=start_step,
                                      source=self.source, listen=links)
        joined = False
        try:
            self.client.start(timeout=self.timeout_s)
            joined = True
        finally:
            if not joined and self.links is not None:  # refused, or nobody to join: its links close with it
                self.links.close()
        if self.address.startswith(DHT_SCHEME):
            log.warning("%s: in the swarm's DHT; another member joins through it with --join dht:%s", self.name,
                        ",".join(self.client.maddrs()))

    def send(self, buffers: dict[int, torch.Tensor], step: int) -> dict[int, int]:
        buffer = buffers[0].to(torch.int32).contiguous()
        self.client.check()
        if self.links is not None:  # to the peers it draws and those that drew it (about 2K), not through the relay
            self.links.check()
            self.client.step = max(self.client.step, step)  # its beats carry it: the peers' lead bound
            self.links.publish(step, learner_version(step), buffer.numpy().tobytes())
            return {0: wire_bytes_sent(buffer, min(2 * self.config.swarm.peers_per_step,
                                                   len(self._live_numbers()) - 1))}
        self.client.publish(step, learner_version(step), buffer.numpy().tobytes())
        return {0: wire_bytes_sent(buffer, len(self._live_numbers()) - 1)}

    def receive(self, receiver: int, step: int) -> Arrivals:
        start = time.perf_counter()
        self.client.check()
        self._forget_gone()
        self._load_foreign()
        lead = self.pacer.lead(step, self._published())
        lead_wait = self.pacer.hold(step, self._published, poll(self.client.check), "peer(s)")
        due = self.mailbox.take_due(step, time.time(), self.pacer.newest_version(step))
        # a peer of another tokenizer: admitted only with the tokenizer it sent under loaded (parcels taken in while
        # it loaded are kept only if it did; a peer that left keeps it until its name's next holder); one whose
        # tokenizer is still to be loaded (it joined after this step's _load_foreign) waits for the next
        parcels, unregistered = [], []
        for parcel in due:
            name = self.book.name(parcel.sender)
            if parcel.refused is not None or not parcel.tokenizer or (
                    name in self.foreign and self._announced.get(name) == parcel.tokenizer):
                parcels.append(parcel)
            elif self._to_load(name):
                self.mailbox.put(parcel)
            else:
                unregistered.append(parcel)
        total = self.client.dropped  # read once: the I/O thread adds to it
        dropped, self._dropped_seen = total - self._dropped_seen, total
        total = self.foreign_refused
        foreign, self._foreign_seen = total - self._foreign_seen, total
        foreign += sum(claimed_sequences(p.buffer) for p in unregistered)
        peers = Peers(tuple(self._live_numbers()), {self.book.number(n): t for n, t in self.foreign.items()})
        return Arrivals(parcels, wait_seconds=time.perf_counter() - start, lead_wait_seconds=lead_wait,
                        lead_steps=lead, waiting=len(self.mailbox), dropped_sequences=self.mailbox.take_dropped(),
                        outbox_dropped=dropped, foreign_refused=foreign, peers=peers)

    def _forget_gone(self) -> None:
        """Forget what was known of peers that are no longer live, or that left and came back since the last step
        (the client saw them leave, or come back at an older step: resumed from an earlier checkpoint, or a new
        holder of the name): such a peer is counted from what it publishes anew, waited for again by the lead bound,
        and its tokenizer loaded anew; names that come and go leave nothing behind here (their numbers stay: a peer
        that comes back keeps its own; their mailbox boxes go once emptied)."""
        live, departed = self._live(), self.client.departed() if self.client is not None else set()
        for name in [n for n in list(self.book.published) if n not in live or n in departed]:
            self.book.forget(name)
        for name in departed:  # its tokenizer stays registered for what it left in the mailbox, until replaced
            self._given_up.discard(name)
            self._tried.discard(name)
            self._changed.discard(name)
            self._unloadable = {(peer, digest) for peer, digest in self._unloadable if peer != name}

    def weights_format(self) -> tuple[torch.dtype, torch.device]:
        """The weight broadcast's dtype and device (a member without samplers pushes nothing)."""
        if self.broadcast is None:
            return torch.float32, torch.device("cpu")
        return self.broadcast.dtype, self.broadcast.device

    def push_weights(self, samplers: list[int], flat: torch.Tensor, version: int) -> None:
        """This member's new weights (version `step`) to its samplers, by broadcast in its own process group."""
        self.broadcast.push(flat, version)

    def finish(self) -> None:
        if self.broadcast is not None:
            self.broadcast.close()  # its samplers' receiving threads end, and the samplers leave
        if self.client is not None:
            self.client.close(leave=True)
        if self.links is not None:
            self.links.close()

    # ------------------------------------------------------------------------------------------- the client's thread

    def _live(self) -> dict[str, dict]:
        return self.client.members() if self.client is not None else {}

    def _live_numbers(self) -> list[int]:
        return [self.book.number(name) for name in self._live() if name == self.name or self._trained_on(name)]

    def _trained_on(self, name: str) -> bool:
        """A peer this member trains on: its tokenizer, or one loaded and checked here."""
        announced = self._live().get(name, {}).get("tokenizer")
        return announced == self.tokenizer or (name in self.foreign and self._announced.get(name) == announced)

    def _to_load(self, name: str) -> bool:
        """A live peer of another tokenizer that the receiver's next step loads (accepted, not tried yet): its
        parcels are taken in meanwhile and kept only if the load succeeds."""
        return self.config.members[0].accept_foreign and name in self._live() and name not in self._tried

    def _load_foreign(self) -> None:
        """Load (main thread) the tokenizers of live peers of another tokenizer not seen before: once a peer, until
        it leaves (_forget_gone). A peer whose announced tokenizer changes while it stays is not trained on until it
        leaves (an honest member's tokenizer never changes; a new holder of its name comes after it left): a peer
        switching hashes would otherwise have every member load a tokenizer, a download, in its step loop every
        step."""
        if not self.config.members[0].accept_foreign:
            return
        for name, view in self._live().items():
            announced = view.get("tokenizer")
            self.book.number(name)  # numbered in order of first sight
            if name in self.foreign and self._announced.get(name) != announced:  # a new holder, or changed while live
                del self.foreign[name]
                self._announced.pop(name, None)
            if name == self.name or announced == self.tokenizer or name in self.foreign or \
                    (name, announced) in self._unloadable or name in self._changed:
                continue
            if name in self._tried:
                self._changed.add(name)
                log.warning("%s: peer %s announced another tokenizer while live and is not trained on until it "
                            "leaves", self.name, name)
                continue
            source, problem = view.get("source") or "", None
            if not isinstance(source, str) or not shareable(source):
                problem = "it announced no tokenizer that loads elsewhere (a local path?)"
            else:
                try:
                    tokenizer = load_tokenizer(source)
                except ModelSpecError as exc:
                    problem = str(exc)
                else:
                    if vocabulary_hash(tokenizer) != announced:
                        problem = f"{source!r} loads here as another tokenizer than the one it joined with"
            if problem is None:
                self.foreign[name], self._announced[name] = tokenizer, announced
            # tried only once its outcome is in place: the parcels that arrive while it loads wait in the mailbox
            # (_to_load), and the receiver keeps them if it loaded
            self._tried.add(name)
            if problem is not None:
                self._unloadable.add((name, announced))
                log.warning("%s: peer %s has another tokenizer and is not trained on: %s", self.name, name,
                            shown(problem))

    def _published(self) -> dict[str, int]:
        """Each live peer's newest published step: its parcels, or the coordinator's word (a step past the run
        is no word: the coordinator refuses one, and may itself lie)."""
        out = {}
        for name, view in self._live().items():
            if name != self.name and split_sampler(name) is None and self._trained_on(name):  # the members
                step = view.get("step", 0)
                step = step if isinstance(step, int) and 0 <= step <= self.config.train.steps else 0
                out[name] = max(step, self.book.published.get(name, 0))
        return out

    def _deliver(self, name: str, step: int, version: int, body: bytes, mac: str = "") -> None:
        """A peer's parcel (the client's I/O thread): into the mailbox, or refused unread (counted in `refused`,
        and kept as an empty parcel that admission counts and names: rejected_batches, one warning)."""
        if not self._trained_on(name) and not self._to_load(name):
            self.foreign_refused += claimed_sequences(body)
            return
        sender = self.book.number(name)
        problem = self._parcel_problem(sender, name, step, version, body, mac)
        if problem is not None:
            self.refused += 1
            # version 0: due at once, so no claimed version parks it in the mailbox for good
            self.mailbox.put(Parcel(sender, step, 0, torch.empty(0, dtype=torch.int32), refused=problem))
            return
        announced = self._live().get(name, {}).get("tokenizer")
        self.mailbox.put(Parcel(sender, step, version, torch.frombuffer(bytearray(body), dtype=torch.int32),
                                tokenizer="" if announced == self.tokenizer else str(announced)))
        if 1 <= step <= self.config.train.steps:  # counted for at most K + 1 past this member's step
            self.book.publish(name, self.pacer.credited(step, self.mailbox.step))

    def _parcel_problem(self, sender: int, name: str, step: int, version: int, body: bytes, mac: str) -> str | None:
        """Why a parcel is refused unread, or None. Its body: whole words, at least one (an honest empty step is
        a buffer of 0 sequences), at most an honest step's. Its step and version: a learner's step t of the run
        carries version t - 1, a sampler's round no version after the run's last step (a parcel no step will ever
        take would stay in the mailbox). A name of this member's own samplers: one it has, signed with their key."""
        if not body or len(body) % 4:
            return f"a body of {len(body)} bytes: not whole int32 words, at least one"
        steps, parsed = self.config.train.steps, split_sampler(name)
        if parsed is None and not 1 <= step <= steps:
            return f"step {step}, outside 1..train.steps={steps}"
        if parsed is None and version != learner_version(step):
            return f"policy version {version} declared for step {step} (a learner's step t is version t - 1)"
        if parsed is not None and version > learner_version(steps):
            return f"policy version {version}: after the run's last step ({learner_version(steps)})"
        if parsed is not None and parsed[0] == self.name:
            samplers = self.config.members[0].samplers
            if parsed[1] >= samplers:
                return f"{name[:120]!r}: this member has {samplers} sampler(s) (members.0.samplers)"
            if self.key is None or not mac_matches(self.key, name, step, version, body, mac):
                return f"{name[:120]!r}: not signed with the key of this member's samplers (a forged sampler?)"
        limit = self._limit(sender, step) if self._limit is not None else 0
        if len(body) // 4 > limit:
            return f"{len(body) // 4} words, more than the {limit} an honest step {step} holds"
        return None


class OpenSampler(WithoutSamplers):
    """The exchange of a sampler rank of a member in an open swarm (see the module): its learner's weights by
    broadcast in the member's process group, its rounds to the coordinator under its sampler name."""


    def __init__(self, address: str, config: RunConfig, collectives, broadcast, endpoint: int, index: int):
        self.address, self.config, self.collectives, self.broadcast = address, config, collectives, broadcast
        self.rank = endpoint  # its endpoint in its member's config (layout.endpoint_roles): the schedule's number for it
        self.member = config.members[0].name
        self.name = sampler_name(self.member, index)
        self.pacer, self.timeout_s = Pacer(config, self.name), config.swarm.timeout_s
        self.tokenizer = self.dataset = self.source = ""
        self.client: SwarmClient | None = None
        self.weights = None

    def attach(self, swarm) -> None:
        """As its member's exchange: what it joins with (announced)."""
        self.tokenizer, self.dataset, self.source = announced(self.config, swarm)

    def start(self, limit: Limit, start_step: int = 0, weights: WeightSlot | None = None) -> None:
        self.weights = weights
        key = share_key(self.broadcast)  # before the weights' receiving thread: the group's first collective
        self.broadcast.start(weights)
        self.client = SwarmClient(self.address, self.name, self.tokenizer, shared_settings(self.config), self.dataset,
                                  max_parcel_bytes(self.config), lambda *parcel: None, step=start_step,
                                  source=self.source, key=key)
        self.client.start(timeout=self.timeout_s)

    def check(self) -> None:
        self.broadcast.check()
        if self.client is not None:
            self.client.check()

    def peer_done(self, learner: int) -> bool:
        """Its learner has finished (closed the weight broadcast)."""
        return self.broadcast.done

    def wait_taken(self, round_: int) -> float:
        """Before round `round_`: the lead bound's backpressure (exchange/pacer.py), until its learner's newest step
        (the coordinator's word) is at least round_ - 1 - K, or it finished. Returns the seconds."""
        def reached(need: int) -> bool:
            step = self.client.members().get(self.member, {}).get("step", 0)
            return self.peer_done(0) or (isinstance(step, int) and step >= need)

        return self.pacer.hold_sampler(round_, reached, poll(self.check), "its learner")

    def send_parcel(self, buffer: torch.Tensor, round_: int, version: int) -> int:
        buffer = buffer.to(torch.int32).contiguous()
        self.client.check()
        self.client.publish(round_, version, buffer.numpy().tobytes())
        peers = [n for n in self.client.members() if n != self.name and split_sampler(n) is None]
        return wire_bytes_sent(buffer, len(peers))

    def finish(self) -> None:
        self.broadcast.join(self.timeout_s)
        if self.client is not None:
            self.client.close(leave=True)


__all__ = ["JoinError", "OpenExchange", "OpenSampler", "check_joinable", "dataset_hash", "share_key"]
