"""A member's side of the open swarm: one I/O thread owns a ZeroMQ DEALER socket dialled to the coordinator.

It joins (and joins again whenever the coordinator says it does not know it: a restarted coordinator), heartbeats
every second (at most lease / 4), sends the member's parcels and hands the peers' parcels to `on_parcel`. Its routing identity
stays the member's across reconnects, so a restarted coordinator sees the same member come back. Parcels that
cannot go out (no connection: the coordinator is down, or a full queue) are dropped and counted, never queued
without bound.

What comes in is untrusted (the coordinator relays strangers, and may be one): a message that breaks the wire format,
a parcel of no words or under a name no member or sampler can have, a member list whose names are not such names or
whose entries are not {step, tokenizer, source} of their types and formats (a sha256 digest, a tokenizer source:
rules.join_problem, the coordinator's own rule for a join), or a frame larger than the largest honest parcel
or header (ZMQ_MAXMSGSIZE: never read, the connection is closed and dialled again) is counted and dropped; a parcel
that makes `on_parcel` raise is counted and logged, and the thread goes on. So every name, tokenizer and source the
member logs or records is plain printable text; a refusal's reason, free text, is kept escaped and cut
(errors.shown), as it will be shown to a person.

What the coordinator announces is held to the rules a coordinator's own config obeys (rules.lease_problem,
rules.view_problem): a welcome whose lease no coordinator's config allows (1e-300 s: beats as fast as the loop
turns) is refused, the member stops with one line (CoordinatorRefused); a member list with more names than a
coordinator admits, or a member at a step past train.steps, is counted and dropped as a malformed one. A list
in parts (rules.list_parts) is taken once every part of one list is in, in order (one connection keeps the
coordinator's order: a gap is a part lost, and the parts held are dropped until the next list's first part), all of
them together held to those rules; a part that names no list, claims more than MAX_PARTS parts or a name another
part of its list holds is counted and dropped. A welcome, a rejoin and a list in one header drop a list in parts.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable

from ..core.errors import shown
from ..data.rollouts import claimed_sequences
from .rules import MAX_PARTS, join_problem, lease_problem, view_problem
from .wire import MAX_HEADER, WireError, ipv6, pack, parcel_mac, unpack

log = logging.getLogger("ftis_engine.exchange")

RECEIVE_HWM = 64  # messages read ahead from the coordinator: memory bounded by this x the frame cap
# a member list's entry (coordinator._view): its newest step, tokenizer, where that loads from, where it listens for
# its peers and its links' key ("" and "" unless swarm.peers_per_step)
VIEW_FIELDS = {"step": int, "tokenizer": str, "source": str, "address": str, "key": str}


class JoinRefused(RuntimeError):
    """The coordinator refused this member; the message is its reason (a field that differs, a name in use)."""


class CoordinatorRefused(ConnectionError):
    """This member refused the coordinator: it announced a setting no coordinator's config allows (the message
    names it). A ConnectionError: `train --join` tells it as one line, exit 2, as a coordinator it cannot dial."""


class SwarmClient:
    def __init__(self, address: str, name: str, tokenizer: str, shared: dict, dataset: str, max_body: int,
                 on_parcel: Callable[[str, int, int, bytes, str], None], step: int = 0, beat_s: float = 1.0,
                 source: str = "", key: bytes | None = None, listen: tuple[str, str] = ("", "")):
        """on_parcel(name, step, version, body, mac) takes a peer's parcel (mac: "" when it carries none) in the
        I/O thread. key: a sampler's, shared with its learner: its parcels carry their mac (wire.parcel_mac).
        listen: (address, CurveZMQ public key) where this member's peers reach it (direct exchange: PeerLinks)."""
        self.address = address
        self.name = name
        self.step = step  # the newest step this member has published (sent in joins and beats)
        # source: where peers of another tokenizer can load this member's (builtin:, packaged: or a hub id; "": none)
        self._join_header = {"name": name, "tokenizer": tokenizer, "source": source, "shared": shared,
                             "dataset": dataset, "address": listen[0], "key": listen[1]}
        steps = shared.get("train", {}).get("steps") if isinstance(shared.get("train"), dict) else None
        self._steps = steps if isinstance(steps, int) else None  # no member's step in a member list is past it
        self._max_body = max_body
        self._on_parcel = on_parcel
        self._key = key
        self._beat_s = beat_s  # until the welcome says the lease
        self._outbox: queue.Queue = queue.Queue(maxsize=64)
        self._members: dict[str, dict] = {}
        self._departed: set[str] = set()  # names seen leaving (or coming back at an older step) since asked
        self._lock = threading.Lock()
        self._joined = threading.Event()
        self._welcomed = False  # a welcome came (its list may still be in parts): joined once the list is whole
        self._parts: tuple[int, int, dict[int, dict]] | None = None  # (list, parts, the parts in) of a list in parts
        self._stop = threading.Event()
        self._leaving = threading.Event()
        self.refused: str | None = None
        self.error: BaseException | None = None
        self.dropped = 0  # sequences of the parcels not sent (no connection, or a full outbox), as one world counts
        self.malformed = 0  # messages from the coordinator that broke the wire format
        self.parcel_errors = 0  # peers' parcels that made on_parcel raise (dropped: one bad message is not fatal)
        self.joins = 0  # joins sent (the first, and each rejoin)
        self._thread = threading.Thread(target=self._run, name=f"swarm-client-{name}", daemon=True)

    # ------------------------------------------------------------------------------------------- the member's side

    def start(self, timeout: float) -> None:
        """Connect and join; raises JoinRefused with the coordinator's reason, TimeoutError, or ConnectionError
        when ZeroMQ cannot dial the address."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._joined.is_set() and self.refused is None and self.error is None:
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"no answer from the coordinator at {self.address} within {timeout:g} s")
            self._joined.wait(0.05)
        import zmq

        if isinstance(self.error, zmq.ZMQError) and not self._joined.is_set():  # the address cannot be dialled
            raise ConnectionError(f"cannot dial the coordinator at {self.address} ({self.error})")
        self.check()

    def check(self) -> None:
        if self.refused is not None:
            raise JoinRefused(self.refused)
        if isinstance(self.error, CoordinatorRefused):
            raise self.error
        if self.error is not None:
            raise RuntimeError(f"the swarm client failed: {self.error!r}") from self.error

    def members(self) -> dict[str, dict]:
        """The live members (the coordinator's last word): name -> {step, tokenizer, source}, this member
        included."""
        with self._lock:
            return dict(self._members)

    def departed(self) -> set[str]:
        """The names that left the live list, or came back in it at an older step (a member resumed from an
        earlier checkpoint, or a new holder of the name), since the last call: what the member knew of them is
        stale, even where it never saw them gone between two of its steps."""
        with self._lock:
            departed, self._departed = self._departed, set()
        return departed

    def publish(self, step: int, version: int, body: bytes) -> bool:
        """Queue a parcel; False (its sequences counted in dropped) when the outbox is full."""
        self.step = max(self.step, step)
        header = {"name": self.name, "step": step, "version": version, "words": len(body) // 4}
        if self._key is not None:
            header["mac"] = parcel_mac(self._key, self.name, step, version, body)
        try:
            self._outbox.put_nowait(pack("parcel", header, body))
            return True
        except queue.Full:
            self._count_dropped(body)
            return False

    def close(self, leave: bool = True) -> None:
        """Leave the swarm (say so to the coordinator) and stop the thread."""
        self._leaving.set()  # no heartbeat or (re)join after this: the coordinator would take one back in
        if leave and self._thread.is_alive():
            try:  # never blocks: a thread that stopped draining (it failed) leaves a full outbox
                self._outbox.put_nowait(pack("leave", {"name": self.name}))
            except queue.Full:
                pass
            deadline = time.monotonic() + 2.0
            while not self._outbox.empty() and time.monotonic() < deadline:
                time.sleep(0.01)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)

    # ------------------------------------------------------------------------------------------- the I/O thread

    def _run(self) -> None:
        import zmq

        socket = zmq.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.ROUTING_ID, f"{self.name}/{uuid.uuid4().hex[:8]}".encode())
        socket.setsockopt(zmq.IMMEDIATE, 1)  # nothing queued towards a connection that is not up: dropped instead
        socket.setsockopt(zmq.LINGER, 500)
        socket.setsockopt(zmq.SNDHWM, 64)
        socket.setsockopt(zmq.RECONNECT_IVL, 100)
        socket.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        # a frame over the largest honest one is never read (libzmq closes the connection; it is dialled again)
        socket.setsockopt(zmq.MAXMSGSIZE, self._max_body + MAX_HEADER)
        socket.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        socket.setsockopt(zmq.IPV6, ipv6(self.address))
        try:
            socket.connect(self.address)
            # a join goes out once the connection is up (IMMEDIATE drops what is sent before: tried every turn until
            # one leaves), then again every 2 beats while unanswered (the coordinator may not be up)
            join_out = self._send(socket, self._join())
            last_beat = last_join = time.monotonic()
            while not self._stop.is_set():
                if socket.poll(20, zmq.POLLIN):
                    self._read_some(socket)
                while True:
                    try:
                        frames = self._outbox.get_nowait()
                    except queue.Empty:
                        break
                    if not self._send(socket, frames) and frames[1] == b"parcel":
                        self._count_dropped(frames[3] if len(frames) > 3 else b"")
                now = time.monotonic()
                if self._leaving.is_set():
                    continue
                if not self._joined.is_set() and (not join_out or now - last_join > 2 * self._beat_s):
                    join_out = self._send(socket, self._join(count=join_out))  # no answer yet
                    last_join = now
                if self._joined.is_set() and now - last_beat > self._beat_s:
                    self._send(socket, pack("beat", {"name": self.name, "step": self.step}))
                    last_beat = now
        except BaseException as exc:  # surfaces through check()
            self.error = exc
        finally:
            socket.close()

    def _count_dropped(self, body: bytes) -> None:
        """Count an unsent parcel's sequences; the member's thread and the I/O thread both drop parcels."""
        with self._lock:
            self.dropped += claimed_sequences(body)

    def _read_some(self, socket) -> int:
        """Take what has come in, at most RECEIVE_HWM messages, then let the thread send: a steady stream relayed
        by the coordinator would otherwise keep it reading while the member's beats (its lease) and parcels wait.
        Returns how many it took."""
        import zmq

        for count in range(RECEIVE_HWM):
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return count
            self._receive(socket, frames)
        return RECEIVE_HWM

    def _join(self, count: bool = True) -> list[bytes]:
        """A join message; counted in `joins` unless it repeats one that never left (count false)."""
        self.joins += count
        return pack("join", {**self._join_header, "step": self.step})

    def _send(self, socket, frames: list[bytes]) -> bool:
        import zmq

        try:
            socket.send_multipart(frames, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _receive(self, socket, frames: list[bytes]) -> None:
        try:
            kind, header, body = unpack(frames, self._max_body)
        except WireError:
            self.malformed += 1
            return
        if kind == "welcome":
            problem = lease_problem(header["lease_s"])
            if problem is not None:  # no coordinator's config has it: a coordinator of no swarm this member is in
                self.error = CoordinatorRefused(f"the coordinator at {self.address} announced {shown(problem, 300)}; "
                                                "this member does not join it")
                self._stop.set()
                return
            self._beat_s = min(1.0, header["lease_s"] / 4)  # its step, fresh for the peers' lead bound
            self._welcomed = True
            self._parts = None  # a welcome opens a list: nothing of an earlier coordinator's lists is kept
            if self._take_list(header):
                self._joined.set()
        elif kind == "refuse":  # shown to a person as the command's error: escaped and cut here, where it enters
            self.refused = shown(header["reason"], limit=300)
            self._stop.set()
        elif kind == "members":
            if self._take_list(header) and self._welcomed:
                self._joined.set()
        elif kind == "changes":
            self._apply_changes(header)
        elif kind == "rejoin" and not self._leaving.is_set():
            self._joined.clear()
            self._welcomed = False
            self._parts = None
            self._send(socket, self._join())
        elif kind == "parcel" and header["name"] != self.name:
            # an honest empty step is one word; a name is a member's or a sampler's (what the coordinator admits)
            if header["words"] >= 1 and len(body) == 4 * header["words"] and _named_as_admitted(header["name"]):
                self._deliver(header, body)
            else:
                self.malformed += 1
        else:
            self.malformed += 1

    def _deliver(self, header: dict, body: bytes) -> None:
        self.parcel_errors = hand_over(self._on_parcel, self.name, header, body, self.parcel_errors)

    def _apply_changes(self, changes: dict) -> None:
        """Take what changed in the coordinator's list since the last it sent (joined: whole entries; left: names;
        steps: name -> newest step), held to the rules a whole list is once applied. Each change sets a value, so
        one seen twice changes nothing, and one about a name this member does not hold (a change it missed: the
        whole list mends it within a lease) is passed over."""
        left, steps = changes["left"], changes["steps"]
        if not (all(isinstance(name, str) for name in left) and all(
                isinstance(step, int) and not isinstance(step, bool) and step >= 0 for step in steps.values())):
            self.malformed += 1
            return
        with self._lock:
            members = {name: entry for name, entry in self._members.items() if name not in left}
        members.update(changes["joined"])
        for name, step in steps.items():
            if name in members and isinstance(members[name], dict):
                members[name] = {**members[name], "step": step}
        self._set_members(members)

    def _take_list(self, header: dict) -> bool:
        """Take a whole list ({members}) or one part of one (with part, parts and list); True once a whole list
        was taken or refused, False while parts of one are missing (or this part was malformed)."""
        fields = [header.get(f) for f in ("part", "parts", "list")]
        if all(f is None for f in fields):
            self._parts = None
            self._set_members(header["members"])
            return True
        part, parts, number = fields
        if None in fields or not 2 <= parts <= MAX_PARTS or part >= parts:
            self.malformed += 1
            return False
        if part == 0:  # a list's first part: whatever was held of another is dropped
            self._parts = (number, parts, {})
        elif self._parts is None or self._parts[:2] != (number, parts) or part != len(self._parts[2]):
            self._parts = None  # a part after a gap (one was lost): nothing of this list is taken
            return False
        got = self._parts[2]
        got[part] = header["members"]
        if len(got) < parts:
            return False
        self._parts = None
        whole: dict = {}
        for k in range(parts):
            if whole.keys() & got[k].keys():  # one name in two parts: no coordinator cuts a list so
                self.malformed += 1
                return True
            whole.update(got[k])
        self._set_members(whole)
        return True

    def _set_members(self, members: dict) -> None:
        """Take the coordinator's member list if every name is one a join may take and every entry is {step,
        tokenizer, source} of their types and formats (a list that breaks it is counted and the last good one
        kept)."""
        if all(isinstance(v, dict) and set(v) == set(VIEW_FIELDS) and all(
                isinstance(v[f], t) and not isinstance(v[f], bool) for f, t in VIEW_FIELDS.items())
               and _named_as_admitted(name, v["tokenizer"], v["source"], v["address"], v["key"])
               for name, v in members.items()) and \
                view_problem(members, self._steps) is None:
            with self._lock:
                self._departed.update(name for name, seen in self._members.items()
                                      if name not in members or members[name]["step"] < seen["step"])
                self._members = members
        else:
            self.malformed += 1


def hand_over(on_parcel: Callable[[str, int, int, bytes, str], None], receiver: str, header: dict, body: bytes,
              errors: int) -> int:
    """Hand a peer's parcel (its header checked against the wire's schema) to on_parcel in an I/O thread: whatever
    on_parcel raises is this message's fault, counted and logged (the first three), never the thread's. Returns the
    count of such errors, `errors` plus this one's."""
    try:
        on_parcel(header["name"], header["step"], header["version"], body, header.get("mac", ""))
    except Exception as exc:  # a peer's bytes through the receiver's checks: any error is that parcel's
        errors += 1
        if errors <= 3:
            log.warning("%s: a parcel of %r (step %d) could not be taken and was dropped: %s: %s%s", receiver,
                        header["name"], header["step"], type(exc).__name__, shown(exc),
                        " (further ones are counted, not logged)" if errors == 3 else "")
    return errors


def _named_as_admitted(name: str, tokenizer: str = "0" * 64, source: str = "", address: str = "", key: str = ""
                       ) -> bool:
    """Whether a name (and a member list entry's tokenizer digest, source, address and key) is one the coordinator
    admits at a join (rules.join_problem): a member's or a sampler's name, a sha256, a source of plain characters,
    a listening address with its key or none."""
    return join_problem({"name": name, "tokenizer": tokenizer, "source": source, "dataset": "0" * 64,
                         "address": address, "key": key}) is None
