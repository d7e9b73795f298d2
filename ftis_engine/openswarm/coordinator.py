"""The open swarm's coordinator: who is in the swarm (leases), whether a member may join (the shared settings and the
dataset), and the relay of every member's parcels to the other live members. A member joins under its name with its
shared settings, its tokenizer's hash and its dataset's hash; it is refused in one line naming the first field that
differs from the swarm's, when its training set differs from the swarm's, or when a live member already has its name.
The swarm's shared settings and its training set's sha256 are the coordinator's own, from its config (the training
set's computed from its `data` and `seed` as each member computes its own: joining.training_set_hash), never what a
member says: a stranger who joins first with a made-up hash fixes nothing (it is refused), and a restart takes
neither from its log (a log whose start record holds another training set is refused at start, as one of other
settings is). It stays in the live set while it is heard from (a heartbeat, a parcel) within `lease_s`; a member that
leaves says so; one that crashes is dropped when its lease expires. What every live member hears of the others (name
-> newest step heard, the lead bound's view, with each one's tokenizer, source, address and key) goes out as the
whole list (`members`, in parts of one header each past ~120 names: rules.list_parts) in the welcome and at least
once a lease, and in between as what changed (`changes`: who joined and left, the steps that moved) at each change
and every second (or lease / 4) when anything did: a member's share of the membership is then a few bytes a member a
step instead of the whole list every second (docs/scale.md), and a list a member missed is mended within a lease. A
member whose message the coordinator cannot place (unknown, e.g. after the coordinator restarted) is told to rejoin.
A coordinator restarted on the log of the one before it (the same --output-dir) holds the places of the members that
were live for a lease while they rejoin, so the first to rejoin still waits for the others (the lead bound) instead
of running ahead alone. Each coordinator's part of its log begins with a `start` record of the swarm's shared
settings: one whose settings differ from the newest there is refused at start (SwarmLogError, naming the fields),
never left to refuse every correct member with what it restored; `swarm serve` locks its --output-dir as a run locks
its directory (rundir.RunLock). A place is held for the connection that had it (its identity is in its join's log
line, a secret between it and the coordinator), so no stranger takes a member's name in that window and has the
member refused when it comes back. A member's step (in a join, a beat or a parcel) past train.steps is refused:
taken, it would turn off its peers' lead bound for it.

What a stranger can make it hold is bounded, so that each entry of the member list is under 500 bytes (a part of the
list fits one header, wire.MAX_HEADER) and a flood of bad messages cannot fill its log: a join's name is a member's
name (config.SAFE_NAME) or one of its samplers' (`<member>/sampler-<k>`), its tokenizer and dataset are sha256 hex
digests, its tokenizer source is at most MAX_SOURCE plain characters, one connection holds one name and the swarm at
most MAX_LIVE; refusals and malformed messages are logged MAX_NOISY a minute (the rest counted, in a later
`suppressed` record), without the live list; and the socket never reads a frame larger than the largest honest parcel
or header (ZMQ_MAXMSGSIZE: the connection is closed instead).

The decisions (`handle`, `expire`) take the time as an argument and return what to send, so they are tested
without sockets or clocks; `serve` runs them on a ZeroMQ ROUTER socket.
"""

from __future__ import annotations

import json
import pathlib
import secrets
import threading
import time
from dataclasses import dataclass

from ..config import value_differences
from ..core.errors import shown
from ..core.safefile import open_append
from .coordlog import restore
from .joining import training_set_hash
from .rules import (  # noqa: F401 (MAX_SOURCE, load_swarm_config, max_parcel_bytes, shared_settings: importable here)
    DIGEST,
    MAX_LIVE,
    MAX_SOURCE,
    PART_BYTES,
    _shown,
    list_parts,
    first_difference,
    join_problem,
    load_swarm_config,
    max_parcel_bytes,
    parcel_problem,
    shared_settings,
)
from .wire import MAX_HEADER, SAMPLER_MARK, WireError, ipv6, pack, unpack

MAX_NOISY = 20  # refusals and malformed messages logged a minute; the rest are counted
RECEIVE_HWM = 64  # messages read ahead per connection: memory bounded by this x the frame cap per connection


@dataclass
class Live:
    identity: bytes  # b"": restored from the log of a coordinator that restarted, not yet rejoined
    tokenizer: str
    step: int
    last_seen: float
    joined_at: float
    source: str = ""  # where its tokenizer loads from (builtin:, packaged: or a hub id), for peers of another one
    claim: bytes = b""  # restored: the connection that held it (logged at its join), the only one that may rejoin
    # as it for its lease (b"": a log written before identities were logged, any connection may)
    address: str = ""  # where it listens for its peers (swarm.peers_per_step), "" for none: it only dials
    key: str = ""  # its links' CurveZMQ public key: its peers admit this key, under this name only


Outgoing = list[tuple[bytes, list[bytes]]]  # (routing identity, frames)


class SwarmLogError(ValueError):
    """A coordinator's log that is not this swarm's to restart on (its output directory holds another swarm's)."""


class Coordinator:
    def __init__(self, shared: dict, lease_s: float, max_body: int, log_path: pathlib.Path | None = None,
                 echo=None, now: float | None = None, dataset: str | None = None):
        """shared: the swarm's shared settings (rules.shared_settings of its config); dataset: its training set's
        sha256, the operator's word; None: computed from shared's data and seed (joining.training_set_hash, which
        raises TaskError when the set cannot be read here)."""
        if dataset is None:
            dataset = training_set_hash(shared.get("data", {}), shared.get("seed", 0))
        if not DIGEST.fullmatch(dataset):
            raise ValueError(f"dataset: {_shown(repr(dataset))} is not a sha256 hex digest (64 of 0-9a-f)")
        self.shared = shared
        self.direct = bool(shared.get("swarm", {}).get("peers_per_step"))  # membership only: no relay
        self.lease_s = lease_s
        self.max_body = max_body  # the largest parcel body an honest member can send (bytes)
        self.live: dict[str, Live] = {}
        self.dataset = dataset  # the swarm's training set: its own config's, never a joiner's or its log's
        self.relayed = 0  # parcels relayed (one per receiver)
        self.undeliverable = 0  # relays a receiver's full queue (or its vanished connection) refused
        self.refused = 0  # messages refused (a malformed one, a join refused, a parcel from no live member)
        self.suppressed = 0  # refusals and malformed messages not logged (over MAX_NOISY a minute)
        self._noisy: tuple[float, int] = (float("-inf"), 0)  # (start of the current minute, noisy records in it)
        self._sent: dict | None = None  # the list as every live member last heard it (changes are against it)
        self._whole_at = float("-inf")  # when the whole list goes out again
        # the number of the last list sent in parts (each part names its list: a member never mixes two lists); from
        # a random start, so a restarted coordinator's lists are not its predecessor's numbers
        self._lists = secrets.randbelow(1 << 30)
        self._echo = echo
        self._log_path, self._log = log_path, None  # opened by the first record, or by serve once it is bound
        restored, logged_dataset, recorded, logged = restore(log_path) if log_path is not None else \
            ({}, None, None, False)
        if logged and recorded is None:
            raise SwarmLogError(f"{log_path} holds the log of a coordinator that recorded no shared settings (an "
                                "earlier version), so nothing says it was this swarm's; give this swarm a fresh "
                                "--output-dir")
        changes = value_differences(recorded, shared) if recorded is not None else []
        if changes:
            said = ", ".join(f"{_shown(str(k))} ({_shown(repr(a))} there, {_shown(repr(b))} here)"
                             for k, a, b in changes[:3])
            said += f" and {len(changes) - 3} more" if len(changes) > 3 else ""
            raise SwarmLogError(f"{log_path} is the log of a swarm with other shared settings: {said}; restart it "
                                "with that swarm's settings, or give this swarm a fresh --output-dir")
        if logged_dataset is not None and logged_dataset != self.dataset:
            raise SwarmLogError(f"{log_path} is the log of a swarm that trained on another training set (sha256 "
                                f"{logged_dataset[:12]}... there, {self.dataset[:12]}... from this config's data): "
                                "restore that swarm's data files, or give this swarm a fresh --output-dir")
        self._restored = sorted(restored)
        if restored:  # a restarted coordinator: its members hold their places for a lease while they rejoin
            now = time.monotonic() if now is None else now
            for name, (tokenizer, step, source, claim, address, key) in restored.items():
                self.live[name] = Live(b"", tokenizer, step, now, now, source, claim, address, key)

    def open_log(self, now: float) -> None:
        """Start this coordinator's part of the log: a `start` record with the swarm's shared settings and lease
        (what a restart on this log must have: coordlog.restore), then, restarted, the members whose places it holds.
        Called by serve once its socket is bound (a coordinator that cannot bind writes nothing), else by the first
        record."""
        if self._log is not None or self._log_path is None:
            return
        self._log = open_append(self._log_path)  # never through a link at its name (safefile)
        self._log.write(json.dumps({"time": time.time(), "event": "start", "member": None, "shared": self.shared,
                                    "lease_s": self.lease_s, "dataset": self.dataset}) + "\n")
        self._log.flush()
        if self._restored:
            self._record(now, "restored", None, members=self._restored, dataset=self.dataset)

    # ---------------------------------------------------------------------------------------------- decisions

    def handle(self, identity: bytes, frames: list[bytes], now: float) -> Outgoing:
        """What to send in answer to one received message."""
        try:
            kind, header, body = unpack(frames, self.max_body)
        except WireError as exc:
            self.refused += 1
            self._record(now, "malformed", None, reason=str(exc))
            return []
        if kind == "join":
            return self._join(identity, header, now)
        name = header.get("name")
        entry = self.live.get(name)
        if kind not in ("beat", "parcel", "leave"):
            self.refused += 1
            return []
        if entry is None or entry.identity != identity:
            self.refused += 1
            return [(identity, pack("rejoin", {"reason": f"{_shown(repr(name))} is not a live member here"}))]
        entry.last_seen = now
        if kind in ("beat", "parcel") and self._past_the_run(name, header["step"]):
            self.refused += 1
            self._record(now, "malformed", name, reason=f"step {header['step']}, past train.steps={self._steps}")
            return []
        if kind == "beat":
            entry.step = max(entry.step, header["step"])
            return []
        if kind == "leave":
            del self.live[name]
            self._record(now, "leave", name, step=entry.step)
            return self._members(now)
        # a parcel: to every other live member (with swarm.peers_per_step the members send theirs to each other)
        problem = "the swarm's members exchange parcels directly (swarm.peers_per_step): nothing is relayed" \
            if self.direct else parcel_problem(header, body)
        if problem is not None:
            self.refused += 1
            self._record(now, "malformed", name, reason=problem)
            return []
        entry.step = max(entry.step, header["step"])
        relay = pack("parcel", header, body)
        # to every other live member; a member's sampler (named <member>/sampler-<k>) only sends
        return [(peer.identity, relay) for peer_name, peer in self.live.items()
                if peer_name != name and peer.identity and SAMPLER_MARK not in peer_name]

    def _join(self, identity: bytes, header: dict, now: float) -> Outgoing:
        name = header["name"]
        problem = join_problem(header)
        if problem is None and self._past_the_run(name, header["step"]):
            problem = f"step: {header['step']}, past train.steps={self._steps}"
        if problem is None:
            problem = first_difference(self.shared, header["shared"])
        if problem is None and header["dataset"] != self.dataset:
            problem = (f"data: this member's training set (sha256 {header['dataset'][:12]}...) differs from the "
                       f"swarm's ({self.dataset[:12]}...)")
        current = self.live.get(name)
        held_by = current.identity or current.claim if current is not None else b""
        if problem is None and held_by not in (identity, b""):
            if now - current.last_seen <= self.lease_s:
                problem = (f"a live member is already named {name!r}; choose another members.0.name"
                           if current.identity else
                           f"{name!r} is held for its member, which had it before the coordinator restarted, for a "
                           "lease")
            else:  # its lease ran out unnoticed: it is gone
                self._drop(name, now, "expired")
        if problem is None:
            problem = self._room_for(identity, name)
        key = header.get("key", "")
        if problem is None and key and any(other != name and entry.key == key for other, entry in self.live.items()):
            problem = "key: another live member announced this link key (each member makes its own)"
        if problem is not None:
            self.refused += 1
            self._record(now, "refuse", name, reason=problem)
            return [(identity, pack("refuse", {"reason": problem}))]
        rejoined = name in self.live and current.identity != b"" and \
            (current.address, current.key) == (header.get("address", ""), key)  # else logged: a restart restores it
        address = header.get("address", "")
        self.live[name] = Live(identity, header["tokenizer"], header["step"], now,
                               current.joined_at if current else now, header["source"], address=address, key=key)
        if not rejoined:
            self._record(now, "join" if current is None or current.identity != b"" else "rejoin", name,
                         step=header["step"], tokenizer=header["tokenizer"], source=header["source"],
                         address=address, key=key, dataset=header["dataset"], identity=identity.hex())
        first, *rest = self._whole(self._view())
        welcome = (identity, pack("welcome", {"lease_s": self.lease_s, **first}))
        return [welcome, *((identity, pack("members", part)) for part in rest), *self._members(now)]

    @property
    def _steps(self) -> int | None:
        return self.shared.get("train", {}).get("steps")

    def _past_the_run(self, name: str, step: int) -> bool:
        """A member's step past train.steps (a sampler's rounds are its own count): no honest member says one, and
        one taken would turn off its peers' lead bound for it (they never wait for a peer ahead of them)."""
        return SAMPLER_MARK not in name and self._steps is not None and step > self._steps

    def _room_for(self, identity: bytes, name: str) -> str | None:
        """Why a valid join cannot take a place: its connection holds another name (one connection is one member
        or sampler), or the swarm holds MAX_LIVE names (what a coordinator holds and sends is bounded); None if it
        can."""
        held = next((other for other, entry in self.live.items() if entry.identity == identity and other != name),
                    None)
        if held is not None:
            return f"name: this connection already holds {held!r}; one connection joins under one name"
        if name not in self.live and len(self.live) >= MAX_LIVE:
            return f"the swarm is full: {MAX_LIVE} live names, the most a coordinator admits"
        return None

    def expire(self, now: float) -> Outgoing:
        """Drop the members not heard from within the lease; tell the rest."""
        gone = [name for name, entry in self.live.items() if now - entry.last_seen > self.lease_s]
        for name in gone:
            self._drop(name, now, "expired")
        return self._members(now) if gone else []

    def _drop(self, name: str, now: float, event: str) -> None:
        entry = self.live.pop(name)
        self._record(now, event, name, step=entry.step, silent_s=round(now - entry.last_seen, 3))

    def _view(self) -> dict:
        return {name: {"step": e.step, "tokenizer": e.tokenizer, "source": e.source, "address": e.address,
                       "key": e.key} for name, e in sorted(self.live.items())}

    def _whole(self, view: dict) -> list[dict]:
        """The headers of a whole list: {members} when it fits one part, else each part with its index, the count
        and this list's number."""
        parts = list_parts(view)
        if len(parts) == 1:
            return [{"members": view}]
        self._lists = (self._lists + 1) % (1 << 31)
        return [{"members": part, "part": k, "parts": len(parts), "list": self._lists} for k, part in enumerate(parts)]

    def _members(self, now: float) -> Outgoing:
        """What every live member is to hear of the others: the whole list once a lease, else what changed since
        it was last told (nothing when nothing did). A joiner's welcome holds the whole list, so a change it had
        already seen there is set again, which changes nothing."""
        view = self._view()
        messages = None
        if self._sent is None or now >= self._whole_at:
            self._whole_at = now + self.lease_s
        else:
            sent = self._sent
            joined = {name: entry for name, entry in view.items()
                      if name not in sent or {**sent[name], "step": entry["step"]} != entry}
            steps = {name: entry["step"] for name, entry in view.items()
                     if name in sent and name not in joined and entry["step"] != sent[name]["step"]}
            left = sorted(name for name in sent if name not in view)
            if not (joined or steps or left):
                return []
            message = pack("changes", {"joined": joined, "left": left, "steps": steps})
            # most names changed at once (or more than a header holds): the whole list instead
            whole = len(json.dumps({"members": view}, separators=(",", ":")))  # as pack writes the whole list
            if len(message[2]) <= PART_BYTES and len(message[2]) < whole:
                messages = [message]
        if messages is None:
            messages = [pack("members", header) for header in self._whole(view)]
        self._sent = view
        return [(entry.identity, message) for entry in self.live.values() if entry.identity for message in messages]

    def _record(self, now: float, event: str, name: str | None, **fields) -> None:
        """One log line (and an echo). Refusals and malformed messages (a stranger's doing) carry no live list, their
        names are cut, and past MAX_NOISY a minute they are only counted (a `suppressed` record with the count comes
        before the first one logged in a later minute)."""
        noisy = event in ("refuse", "malformed")
        if noisy and not self._may_log(now):
            return
        record = {"time": time.time(), "event": event, "member": _shown(name) if noisy and name else name, **fields}
        if not noisy:
            record["live"] = sorted(self.live)  # what a restarted coordinator restores from (the newest one)
        self.open_log(now)
        if self._log is not None:
            self._log.write(json.dumps(record) + "\n")
            self._log.flush()
        if self._echo is not None and event != "malformed":
            extra = " ".join(f"{k}={v}" for k, v in fields.items())
            self._echo(shown(f"{event}: {record['member']} {extra} | live: {', '.join(sorted(self.live)) or '-'}",
                             limit=None))

    def _may_log(self, now: float) -> bool:
        """Whether one more refusal or malformed message may be logged this minute (else it is counted)."""
        start, count = self._noisy
        if now - start >= 60.0:
            if self.suppressed:
                self._log_suppressed()
            start, count = now, 0
        self._noisy = (start, count + 1)
        if count < MAX_NOISY:
            return True
        self.suppressed += 1
        return False

    def _log_suppressed(self) -> None:
        self.open_log(time.monotonic())
        if self._log is not None:
            self._log.write(json.dumps({"time": time.time(), "event": "suppressed", "member": None,
                                        "count": self.suppressed}) + "\n")
            self._log.flush()
        if self._echo is not None:
            self._echo(f"suppressed: {self.suppressed} refusals or malformed messages in the last minute, not logged")
        self.suppressed = 0

    # ---------------------------------------------------------------------------------------------- sockets

    def serve(self, address: str, stop: threading.Event, bound: list | None = None) -> None:
        """Run on a ROUTER socket bound to `address` until `stop` is set. bound: receives the endpoint actually
        bound (a port of 0 or * picks a free one)."""
        import zmq

        context = zmq.Context.instance()
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable or full receiver raises: counted, not silent
        socket.setsockopt(zmq.SNDHWM, 64)
        # a frame over the largest honest one (a parcel's body, or a header) is never read: libzmq closes that
        # connection instead. (libzmq has no cap on frames per message; unpack refuses any but 3 or 4.)
        socket.setsockopt(zmq.MAXMSGSIZE, self.max_body + MAX_HEADER)
        socket.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.IPV6, ipv6(address))  # an [IPv6] host; set for others, it would rename their endpoint
        try:
            deadline = time.monotonic() + 5.0
            while True:  # a coordinator restarted at once may find its old socket's port not yet released
                try:
                    socket.bind(address)
                    break
                except zmq.ZMQError as exc:
                    if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline or stop.is_set():
                        raise
                    time.sleep(0.1)
            endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
            if self._echo is not None:
                self._echo(f"coordinator listening on {endpoint} (lease {self.lease_s:g} s)")
            self.open_log(time.monotonic())
            if bound is not None:
                bound.append(endpoint)
            poller = zmq.Poller()
            poller.register(socket, zmq.POLLIN)
            next_expiry = next_view = time.monotonic()
            while not stop.is_set():
                if poller.poll(50):
                    while True:
                        try:
                            identity, *frames = socket.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._send(socket, self.handle(identity, frames, time.monotonic()))
                now = time.monotonic()
                if now >= next_expiry:
                    self._send(socket, self.expire(now))
                    next_expiry = now + min(0.2, self.lease_s / 4)
                if now >= next_view:  # the members' newest steps, heard from beats too (the lead bound's view)
                    self._send(socket, self._members(now))
                    next_view = now + min(1.0, self.lease_s / 4)
        finally:
            socket.close(0)
            if self._log is not None:
                self._log.close()

    def _send(self, socket, outgoing: Outgoing) -> None:
        import zmq

        for identity, frames in outgoing:
            try:
                socket.send_multipart([identity, *frames], zmq.NOBLOCK)
            except (zmq.Again, zmq.ZMQError):  # its queue is full, or its connection is gone
                self.undeliverable += 1
            else:
                if frames[1] == b"parcel":
                    self.relayed += 1


