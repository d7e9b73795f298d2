"""A member's parcels straight to and from its peers (swarm.peers_per_step = K): the open swarm past one coordinator.

The membership (the coordinator, or any view of who is live) keeps who is live, where each listens and its links'
public key; it relays nothing. Each step a member sends its parcel to K live peers drawn afresh (`draw_peers`:
seeded by the run seed, its name and the step, so it cannot choose whom it sends to, and every member is drawn by
about K others a step) and to the peers that drew it since its last parcel, over the connection they dialled; it
takes theirs the same ways. A member's traffic is so about 2K parcels each way a step however large the swarm, and
it trains on its own groups and those of the peers it met (vertical collaboration: each parcel is whole groups of
its sender's own prompts, so any subset of peers is a valid batch; horizontal collaboration, where one prompt's
group is split over members, would have to draw prompts, not peers: the open swarm is vertical).

Every link is CurveZMQ (ZeroMQ's CURVE, libsodium): a member's ROUTER admits only the keys of live members (its
membership's view: name -> key), and a parcel's name must be the name that key joined under; a member dials a peer
with the peer's key, so what comes back over that connection is the peer's own. A stranger, or a member that lost
its place, cannot connect; a member cannot send under another's name. A member behind a NAT (no listen address)
only dials: it sends to the K it draws and takes their parcels back on the same connections.

What is received goes to `on_parcel(name, step, version, body, mac)`: the same checks as a relayed parcel
(openswarm/member.py's `_deliver`, then admission), so the wire format, the validation and the defenses are those
of every other transport.
"""

from __future__ import annotations

import queue
import random
import threading
import zlib
from collections.abc import Callable

from ..core.threads import Worker
from ..data.rollouts import claimed_sequences
from ..topology.schedule import mix_seed
from .client import hand_over
from .rules import parcel_problem
from .wire import MAX_HEADER, SAMPLER_MARK, WireError, pack, unpack

HWM = 64  # messages read ahead on its listening socket, per connection (only live members' keys connect)
DIAL_HWM = 4  # parcels queued towards one dialled peer: a peer that does not take them holds no more


class ListenError(ConnectionError):
    """Its peer links cannot listen at the address given (in use, not this machine's): one line, the address named."""


def draw_peers(seed: int, name: str, step: int, candidates: list[str], k: int) -> list[str]:
    """The K peers `name` sends its step's parcel to: a uniform draw without replacement from the live members that
    listen (sorted, so that every member computes the same draw from the same view), seeded by (seed, name, step)."""
    pool = sorted(candidates)
    rng = random.Random(mix_seed(seed, zlib.crc32(name.encode()), step))
    return rng.sample(pool, min(k, len(pool)))


class _Admitted:
    """The ZAP callback of a member's ROUTER: a connecting key is admitted while a live member (not this one) holds
    it. Called from pyzmq's authenticator thread: reads the view through its own lock-guarded accessor."""

    def __init__(self, keys: Callable[[], dict[str, str]], own: str):
        self.keys, self.own = keys, own

    def callback(self, domain: str, key: bytes) -> bool:
        key = key.decode("ascii", "replace")
        return key != self.own and key in self.keys()


class PeerLinks:
    """A member's direct links (see the module). view(): the membership's live members, name -> {address, key, ...}
    (SwarmClient.members). listen: the tcp address to bind ("" or None: behind a NAT, dial only)."""

    def __init__(self, name: str, listen: str | None, peers_per_step: int, seed: int, max_body: int,
                 on_parcel: Callable[[str, int, int, bytes, str], None], view: Callable[[], dict[str, dict]]):
        import zmq

        self.name, self.listen, self.k, self.seed = name, listen or "", peers_per_step, seed
        self.max_body, self.on_parcel, self.view = max_body, on_parcel, view
        self.public, self.secret = (part.decode("ascii") for part in zmq.curve_keypair())
        self.address = ""  # where it listens, once bound (advertised in its join)
        self._context = zmq.Context()  # its own: ZAP (the key check) is set up per context
        self._auth = None
        self._outbox: queue.Queue = queue.Queue(maxsize=HWM)
        self._bound = threading.Event()
        self._stop = threading.Event()
        self._worker = Worker(self._run, f"peer-links-{name}", on_error=lambda exc: self._bound.set())
        self.sent = 0  # parcels sent (one per receiver)
        self.received = 0  # peers' parcels taken
        self.refused = 0  # messages refused: not a parcel, a name other than its key's, a size that is not one
        self.parcel_errors = 0  # parcels on_parcel raised on (dropped: one bad message is not fatal)
        self.dropped = 0  # sequences of parcels not sent (a full link, or no connection yet)

    # ------------------------------------------------------------------------------------------- the member's side

    def start(self, timeout: float = 30.0) -> str:
        """Bind (if it listens) and start the I/O thread; returns the address to announce ("" for none)."""
        if self.listen:
            from zmq.auth.thread import ThreadAuthenticator

            self._auth = ThreadAuthenticator(self._context)
            self._auth.start()
            self._auth.configure_curve_callback("*", credentials_provider=_Admitted(self._keys, self.public))
        self._worker.start()
        if not self._bound.wait(timeout):
            raise TimeoutError(f"{self.name}: its peer links did not start within {timeout:g} s")
        import zmq

        if isinstance(self._worker.error, zmq.ZMQError) and not self.address:
            raise ListenError(f"{self.listen!r}: cannot listen there ({self._worker.error})")
        self.check()
        return self.address

    def check(self) -> None:
        self._worker.check(lambda exc: RuntimeError(f"the peer links failed: {exc!r}"))

    def publish(self, step: int, version: int, body: bytes) -> bool:
        """Queue this member's parcel of `step` for its drawn peers and those that drew it; False (its sequences
        counted in dropped) when the queue is full."""
        header = {"name": self.name, "step": step, "version": version, "words": len(body) // 4}
        try:
            self._outbox.put_nowait((step, pack("parcel", header, body)))
            return True
        except queue.Full:
            self.dropped += claimed_sequences(body)
            return False

    def close(self) -> None:
        self._stop.set()
        self._worker.join(5.0)
        if self._auth is not None:
            self._auth.stop()
        if not self._worker.is_alive():  # its sockets are closed: term returns (else it would wait on them)
            self._context.term()

    # ------------------------------------------------------------------------------------------- the I/O thread

    def _keys(self) -> dict[str, str]:
        """key -> name of the live members that announced one (a sampler sends to the coordinator only): who may
        connect (the coordinator admits one live name a key)."""
        return {v["key"]: name for name, v in self.view().items()
                if isinstance(v, dict) and v.get("key") and SAMPLER_MARK not in name}

    def _socket(self, kind: int):
        import zmq

        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, HWM)
        socket.setsockopt(zmq.RCVHWM, HWM)
        socket.setsockopt(zmq.MAXMSGSIZE, self.max_body + MAX_HEADER)  # a larger frame is never read
        socket.curve_secretkey, socket.curve_publickey = self.secret.encode(), self.public.encode()
        return socket

    def _run(self) -> None:
        import zmq

        router, dealers = None, {}  # peer name -> (socket, address, key)
        latest: tuple[int, list[bytes]] | None = None
        sent_step: dict[tuple[str, str], int] = {}  # (peer, its key) -> the newest step of this member's it was
        # sent (a peer back under a new key, a restart, is sent the current one again)
        askers: dict[tuple[str, str], bytes] = {}  # peers that dialled it since its last parcel: -> routing id
        poller = zmq.Poller()
        try:
            if self.listen:
                router = self._socket(zmq.ROUTER)
                router.curve_server = True
                router.setsockopt(zmq.ROUTER_MANDATORY, 1)
                router.bind(self.listen)
                self.address = router.getsockopt_string(zmq.LAST_ENDPOINT)
                poller.register(router, zmq.POLLIN)
            self._bound.set()
            while not self._stop.is_set():
                for socket, _ in poller.poll(20):
                    if socket is router:
                        self._from_dialler(router, askers, latest, sent_step)
                    else:
                        peer = next(n for n, (s, _, _) in dealers.items() if s is socket)
                        self._from_dialled(socket, peer)
                try:
                    latest = self._outbox.get_nowait()
                except queue.Empty:
                    continue
                view = self.view()
                self._forget(dealers, poller, view)
                step, frames = latest
                listening = [n for n, v in view.items() if n != self.name and SAMPLER_MARK not in n
                             and isinstance(v, dict) and v.get("address") and v.get("key")]
                for peer in draw_peers(self.seed, self.name, step, listening, self.k):
                    socket = self._dealer(dealers, poller, peer, view[peer])
                    if socket is not None:
                        self._send(socket, frames, (peer, view[peer]["key"]), step, sent_step)
                for (peer, key), routing in askers.items():  # those that drew it, over their own connections
                    if sent_step.get((peer, key), 0) < step:
                        self._send(router, [routing, *frames], (peer, key), step, sent_step)
                askers.clear()
        finally:
            for socket, _, _ in dealers.values():
                socket.close(0)
            if router is not None:
                router.close(0)

    def _dealer(self, dealers: dict, poller, peer: str, entry: dict):
        """The connection to `peer` at its announced address and key (a new one when either changed); None (counted
        in refused) where libzmq takes neither: what a peer announced never ends this thread."""
        import zmq

        current = dealers.pop(peer, None)
        if current is not None and current[1:] == (entry["address"], entry["key"]):
            dealers[peer] = current
            return current[0]
        if current is not None:
            poller.unregister(current[0])
            current[0].close(0)
        socket = None
        try:
            socket = self._socket(zmq.DEALER)
            socket.setsockopt(zmq.SNDHWM, DIAL_HWM)
            socket.curve_serverkey = entry["key"].encode()
            socket.connect(entry["address"])
        except zmq.ZMQError:
            if socket is not None:
                socket.close(0)
            self.refused += 1
            return None
        poller.register(socket, zmq.POLLIN)
        dealers[peer] = (socket, entry["address"], entry["key"])
        return socket

    def _forget(self, dealers: dict, poller, view: dict) -> None:
        """Close the connections to peers that are no longer live."""
        for peer in [p for p in dealers if p not in view]:
            socket = dealers.pop(peer)[0]
            poller.unregister(socket)
            socket.close(0)

    def _send(self, socket, frames: list[bytes], peer: tuple[str, str], step: int, sent_step: dict) -> None:
        import zmq

        try:
            socket.send_multipart(frames, zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError):  # a full link, or a dialler that is gone
            self.dropped += claimed_sequences(frames[-1])
            return
        self.sent += 1
        sent_step[peer] = step

    def _from_dialler(self, router, askers: dict, latest, sent_step: dict) -> None:
        """A parcel from a peer that dialled this member: taken under the name its key joined with; the peer is
        then sent this member's newest parcel it has not had, and later ones until its next parcel comes."""
        import zmq

        try:
            routing, *frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        key = frames[0].get("User-Id") if frames else ""  # the key the connection authenticated with (ZAP)
        taken = self._take(None, [bytes(f) for f in frames], key)
        if taken is None:
            return
        askers[(taken, key)] = bytes(routing)
        if latest is not None and sent_step.get((taken, key), 0) < latest[0]:
            self._send(router, [bytes(routing), *latest[1]], (taken, key), latest[0], sent_step)

    def _from_dialled(self, socket, peer: str) -> None:
        """A parcel back from a peer this member dialled (CURVE: the connection's server holds the peer's key)."""
        import zmq

        try:
            frames = socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        self._take(peer, frames)

    def _take(self, peer: str | None, frames: list[bytes], key: str = "") -> str | None:
        """Hand a peer's parcel to on_parcel and return its sender; None (counted in refused) for anything else.
        peer: the peer this member dialled (the connection's server key is its); None for a dialler, whose parcel
        must name the live member that announced the key it connected with. What on_parcel raises is that
        message's fault, logged and counted, never the thread's."""
        try:
            kind, header, body = unpack(frames, self.max_body)
        except WireError:
            self.refused += 1
            return None
        name = header.get("name") if kind == "parcel" else None
        entry = self.view().get(name) if isinstance(name, str) else None
        own = name == peer if peer is not None else isinstance(entry, dict) and entry.get("key") == key != ""
        if not own or parcel_problem(header, body) is not None:
            self.refused += 1
            return None
        self.received += 1
        self.parcel_errors = hand_over(self.on_parcel, self.name, header, body, self.parcel_errors)
        return name
