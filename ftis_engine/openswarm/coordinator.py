"""The open swarm's coordinator: who is in the swarm (leases), whether a member may join (the shared settings and
the dataset), and the relay of every member's parcels to the other live members.

A member joins under its name with its shared settings, its tokenizer's hash and its dataset's hash; it is refused
in one line naming the first field that differs from the swarm's, when its training set differs from the one the
swarm has, or when a live member already has its name. It stays in the live set while it is heard from (a
heartbeat, a parcel) within `lease_s`; a member that leaves says so; one that crashes is dropped when its lease
expires. Every change, and every second (or lease / 4), goes to every live member as a `members` message (name ->
newest step heard: the lead bound's view). A member whose message the coordinator cannot place (unknown, e.g.
after the coordinator restarted) is told to rejoin. A coordinator restarted on the log of the one before it
(the same --output-dir) holds the places of the members that were live for a lease while they rejoin, so the
first to rejoin still waits for the others (the lead bound) instead of running ahead alone.

The decisions (`handle`, `expire`) take the time as an argument and return what to send, so they are tested
without sockets or clocks; `serve` runs them on a ZeroMQ ROUTER socket.
"""

from __future__ import annotations

import json
import pathlib
import threading
import time
from dataclasses import dataclass

from ..config import RunConfig, value_differences
from .wire import SAMPLER_MARK, WireError, pack, unpack

# What every member of one open swarm must agree on (the rest of a member's config is its own: its model, LoRA,
# optimizer, loss, ranks). Vertical collaboration only: each member generates whole groups of its own prompts.
SHARED = ("seed", "collaboration", "rollout.group_size", "rollout.prompts_per_step", "rollout.max_new_tokens",
          "rollout.temperature", "rollout.top_p", "rollout.top_k", "data", "train.steps", "swarm.max_lead",
          "swarm.max_staleness", "swarm.max_delay_s")
MAX_NAME = 100


def shared_settings(config: RunConfig) -> dict:
    """The SHARED fields of a config, as a nested dict of JSON values."""
    dumped = config.model_dump(mode="json")
    out: dict = {}
    for path in SHARED:
        *parents, leaf = path.split(".")
        source, target = dumped, out
        for part in parents:
            source, target = source[part], target.setdefault(part, {})
        target[leaf] = source[leaf]
    return out


def first_difference(swarm: dict, member: dict) -> str | None:
    """'field: the swarm says X, this member Y' for the first shared field that differs, or None."""
    differences = value_differences(swarm, member)
    if not differences:
        return None
    field, ours, theirs = differences[0]
    return f"{field}: the swarm says {ours!r}, this member {theirs!r}"


@dataclass
class Live:
    identity: bytes  # b"": restored from the log of a coordinator that restarted, not yet rejoined
    tokenizer: str
    step: int
    last_seen: float
    joined_at: float
    source: str = ""  # where its tokenizer loads from (builtin:, packaged: or a hub id), for peers of another one


Outgoing = list[tuple[bytes, list[bytes]]]  # (routing identity, frames)


class Coordinator:
    def __init__(self, shared: dict, lease_s: float, max_body: int, log_path: pathlib.Path | None = None,
                 echo=None, now: float | None = None):
        self.shared = shared
        self.lease_s = lease_s
        self.max_body = max_body  # the largest parcel body an honest member can send (bytes)
        self.live: dict[str, Live] = {}
        self.dataset: str | None = None  # the first joined member's training-set hash: the swarm's
        self.relayed = 0  # parcels relayed (one per receiver)
        self.undeliverable = 0  # relays a receiver's full queue (or its vanished connection) refused
        self.refused = 0  # messages refused (a malformed one, a join refused, a parcel from no live member)
        self._echo = echo
        restored = self._restore(log_path) if log_path is not None else {}
        self._log = open(log_path, "a", encoding="utf-8") if log_path is not None else None
        if restored:  # a restarted coordinator: its members hold their places for a lease while they rejoin
            now = time.monotonic() if now is None else now
            for name, (tokenizer, step, source) in restored.items():
                self.live[name] = Live(b"", tokenizer, step, now, now, source)
            self._record(now, "restored", None, members=sorted(restored))

    @staticmethod
    def _restore(log_path: pathlib.Path) -> dict[str, tuple[str, int, str]]:
        """The members live when the previous coordinator of this log stopped, killed or not (name -> (tokenizer,
        newest step logged, tokenizer source)); {} for a new log. A member that is gone holds its place for one lease at most."""
        if not log_path.is_file():
            return {}
        tokenizers: dict[str, str] = {}
        sources: dict[str, str] = {}
        steps: dict[str, int] = {}
        live: list[str] = []
        for line in log_path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # a line the killed coordinator did not finish
                continue
            name = record.get("member")
            if record.get("tokenizer") is not None and name is not None:
                tokenizers[name] = record["tokenizer"]
                sources[name] = record.get("source", "")
            if isinstance(record.get("step"), int) and name is not None:
                steps[name] = record["step"]
            live = record.get("live", live)
        return {name: (tokenizers[name], steps.get(name, 0), sources[name]) for name in live if name in tokenizers}

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
            return [(identity, pack("rejoin", {"reason": f"{name!r} is not a live member here"}))]
        entry.last_seen = now
        if kind == "beat":
            entry.step = max(entry.step, header["step"])
            return []
        if kind == "leave":
            del self.live[name]
            self._record(now, "leave", name, step=entry.step)
            return self._members()
        # a parcel: to every other live member
        if len(body) != 4 * header["words"]:
            self.refused += 1
            self._record(now, "malformed", name, reason=f"parcel of {len(body)} bytes announced as "
                                                        f"{header['words']} words")
            return []
        entry.step = max(entry.step, header["step"])
        relay = pack("parcel", header, body)
        # to every other live member; a member's sampler (named <member>/sampler-<k>) only sends
        return [(peer.identity, relay) for peer_name, peer in self.live.items()
                if peer_name != name and peer.identity and SAMPLER_MARK not in peer_name]

    def _join(self, identity: bytes, header: dict, now: float) -> Outgoing:
        name = header["name"]
        problem = None
        if not 0 < len(name) <= MAX_NAME:
            problem = f"a member's name has 1 to {MAX_NAME} characters, not {len(name)}"
        if problem is None:
            problem = first_difference(self.shared, header["shared"])
        if problem is None and self.dataset is not None and header["dataset"] != self.dataset:
            problem = (f"data: this member's training set (sha256 {header['dataset'][:12]}...) differs from the "
                       f"swarm's ({self.dataset[:12]}...)")
        current = self.live.get(name)
        if problem is None and current is not None and current.identity not in (identity, b""):
            if now - current.last_seen <= self.lease_s:
                problem = f"a live member is already named {name!r}; choose another members.0.name"
            else:  # its lease ran out unnoticed: it is gone
                self._drop(name, now, "expired")
        if problem is not None:
            self.refused += 1
            self._record(now, "refuse", name, reason=problem)
            return [(identity, pack("refuse", {"reason": problem}))]
        self.dataset = self.dataset or header["dataset"]
        rejoined = name in self.live and current.identity != b""
        self.live[name] = Live(identity, header["tokenizer"], header["step"], now,
                               current.joined_at if current else now, header["source"][:MAX_NAME * 10])
        if not rejoined:
            self._record(now, "join" if current is None or current.identity != b"" else "rejoin", name,
                         step=header["step"], tokenizer=header["tokenizer"], source=header["source"][:MAX_NAME * 10])
        welcome = (identity, pack("welcome", {"lease_s": self.lease_s, "members": self._view()}))
        return [welcome, *self._members()]

    def expire(self, now: float) -> Outgoing:
        """Drop the members not heard from within the lease; tell the rest."""
        gone = [name for name, entry in self.live.items() if now - entry.last_seen > self.lease_s]
        for name in gone:
            self._drop(name, now, "expired")
        return self._members() if gone else []

    def _drop(self, name: str, now: float, event: str) -> None:
        entry = self.live.pop(name)
        self._record(now, event, name, step=entry.step, silent_s=round(now - entry.last_seen, 3))

    def _view(self) -> dict:
        return {name: {"step": e.step, "tokenizer": e.tokenizer, "source": e.source}
                for name, e in sorted(self.live.items())}

    def _members(self) -> Outgoing:
        message = pack("members", {"members": self._view()})
        return [(entry.identity, message) for entry in self.live.values() if entry.identity]

    def _record(self, now: float, event: str, name: str | None, **fields) -> None:
        record = {"time": time.time(), "event": event, "member": name, **fields, "live": sorted(self.live)}
        if self._log is not None:
            self._log.write(json.dumps(record) + "\n")
            self._log.flush()
        if self._echo is not None and event != "malformed":
            extra = " ".join(f"{k}={v}" for k, v in fields.items())
            self._echo(f"{event}: {name} {extra} | live: {', '.join(sorted(self.live)) or '-'}")

    # ---------------------------------------------------------------------------------------------- sockets

    def serve(self, address: str, stop: threading.Event, bound: list | None = None) -> None:
        """Run on a ROUTER socket bound to `address` until `stop` is set. bound: receives the endpoint actually
        bound (a port of 0 or * picks a free one)."""
        import zmq

        context = zmq.Context.instance()
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable or full receiver raises: counted, not silent
        socket.setsockopt(zmq.SNDHWM, 64)
        socket.setsockopt(zmq.LINGER, 0)
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
            if bound is not None:
                bound.append(endpoint)
            if self._echo is not None:
                self._echo(f"coordinator listening on {endpoint} (lease {self.lease_s:g} s)")
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
                    self._send(socket, self._members())
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


def load_swarm_config(path: pathlib.Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """A coordinator's config: the swarm's shared settings (SHARED) and swarm.lease_s, in a run config's format
    without `members` (each member brings its own). Checked as a run config is; a ConfigError names the field."""
    from ..config import ConfigError, apply_override, read_yaml_mapping, validate_config

    raw = read_yaml_mapping(path)
    for assignment in overrides:
        apply_override(raw, assignment)
    if "members" in raw:
        raise ConfigError(f"members: a swarm config has none (each member joins with its own config): {path}")
    if raw.get("collaboration", "vertical") != "vertical":
        raise ConfigError(f"collaboration: an open swarm is vertical (each member generates whole groups of its "
                          f"own prompts), not {raw['collaboration']!r}")
    # a run config needs a member: a stand-in, never used (nothing of a member is shared)
    return validate_config({**raw, "members": [{"name": "coordinator", "model": "builtin:tiny-s"}]})


def max_parcel_bytes(config: RunConfig) -> int:
    """The largest parcel an honest member sends: one step's whole groups of rollout.prompts_per_step prompts."""
    from ..rollouts import max_buffer_words

    sequences = config.rollout.prompts_per_step * config.rollout.group_size
    return 4 * max_buffer_words(sequences, config.rollout.max_new_tokens)
