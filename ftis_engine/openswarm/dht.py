"""The open swarm's membership on hivemind's DHT (issue 80): who is live, where each listens and its links' key,
with no coordinator, for a swarm of direct exchange (swarm.peers_per_step). `pip install 'ftis-engine[dht]'`.

    ftis-engine train --config member.yaml --join dht: --listen tcp://HOST:6000              # the first member
    ftis-engine train --config other.yaml --join dht:/ip4/HOST/tcp/PORT/p2p/PEER --listen ...  # any member's address

A member is a subkey of one key, `ftis-swarm/<sha256 of the shared settings, the training set and the lease>`
(members of other settings, or of another swarm.lease_s, are in another swarm: with no coordinator to hold it, the
lease is the swarm's by its key), signed with the member's RSA key (hivemind's RSASignatureValidator: nobody
rewrites another's record); its value {step, tokenizer, source, address, key, stamp} expires a lease after each
renewal (every lease / 4, from its own thread: a DHT call blocks for seconds on a hung peer). A member that leaves
stores a record marked left. The view is read every second from the same thread; each entry is held to the
coordinator's rules for a join (rules.join_problem) and a step no later than the run's last, else left out and
counted (`malformed`). A name that another owner holds at join is refused in one line; two live records under one
name are both left out (no member knows which is the first). Any member's DHT address bootstraps a newcomer: the
DHT has no node whose death ends it.

Clocks: a record's stamp is its writer's clock. A reader leaves out a record stamped more than a quarter lease in
its future or more than a lease in its past (the swarm's lease, one for all its members by its key; an honest
member's stamp is at most a quarter lease old: it renews that often), so that a writer's clock, wrong or lying,
keeps its record live at most a lease and a quarter after its last renewal. A joiner whose clock is more than 3 s
off its bootstrap peer's (hivemind's own check at its first ping) is refused in one line naming the clock.

This class has the SwarmClient's surface that OpenExchange uses (start, check, members, departed, step, dropped,
close), so the member's transport, schedule and receiver are unchanged.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time

from ..core.errors import shown
from ..core.threads import Worker
from .client import JoinRefused
from .rules import join_problem

KEY_PREFIX = "ftis-swarm/"
OWNER = b"[owner:"


def dht_problem(address: str, cfg) -> str | None:
    """Why `--join dht:[MULTIADDR,...]` cannot be (the rest of a sentence after the address), or None."""
    import importlib.util

    if importlib.util.find_spec("hivemind") is None:
        return "needs hivemind for its DHT: pip install 'ftis-engine[dht]'"
    if not cfg.swarm.peers_per_step:
        return ("has no coordinator to relay parcels: a swarm on a DHT exchanges directly (set "
                "swarm.peers_per_step)")
    bad = [part for part in address[len("dht:"):].split(",") if part and not part.startswith(("/ip4/", "/ip6/"))]
    return f"has {bad[0][:60]!r}, which is no multiaddr (/ip4/HOST/tcp/PORT/p2p/PEER)" if bad else None


def swarm_key(shared: dict, dataset: str, lease_s: float) -> str:
    """The DHT key of the swarm of these shared settings, training set and lease."""
    digest = hashlib.sha256(json.dumps([shared, dataset, float(lease_s)], sort_keys=True).encode()).hexdigest()
    return KEY_PREFIX + digest[:32]


class DhtMembership:
    def __init__(self, bootstrap: list[str], host: str, name: str, tokenizer: str, shared: dict, dataset: str,
                 lease_s: float, source: str = "", listen: tuple[str, str] = ("", ""), steps: int | None = None,
                 client_mode: bool = False, clock=time.time):
        """bootstrap: multiaddrs of any live members' DHT peers ([] for the first member); host: the IPv4 address
        this member's DHT listens on (where the others reach it); client_mode: it only dials (behind a NAT: no
        other member can bootstrap through it); clock: what stamps its records and judges others' (the machine's)."""
        self.client_mode = client_mode
        self._clock = clock
        # the longest a DHT call may take (a hung peer blocks one for seconds): past it the call is a TimeoutError,
        # the thread's end, which check() raises in the member's next step
        self._bound = max(10.0, lease_s)
        self.bootstrap, self.host, self.name, self.lease_s, self.steps = bootstrap, host, name, lease_s, steps
        self.key = swarm_key(shared, dataset, lease_s)
        self._record = {"tokenizer": tokenizer, "source": source, "address": listen[0], "key": listen[1]}
        self.step = 0  # the newest step this member has published (its renewals carry it)
        self.dropped = 0  # (the relay's count: nothing is relayed here)
        self.malformed = 0  # records left out: they break a join's rules, or two owners hold one name
        self.dht = None
        self._members: dict[str, dict] = {}
        self._departed: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._viewed = threading.Event()
        self._worker = Worker(self._run, f"dht-{name}", on_error=lambda exc: self._viewed.set())
        self._subkey = b""

    # ------------------------------------------------------------------------------------------- the member's side

    def start(self, timeout: float) -> None:
        """Join the DHT (through `bootstrap`) and take this member's name; raises ConnectionError (no bootstrap
        peer answered, in one line) or JoinRefused (its name is another member's, or its clock is off its bootstrap
        peer's)."""
        import hivemind
        from hivemind.dht.crypto import RSASignatureValidator
        from hivemind.dht.protocol import ValidationError
        from hivemind.p2p import P2PDaemonError

        from hivemind.utils.crypto import RSAPrivateKey
        from hivemind.utils.timed_storage import MAX_DHT_TIME_DISCREPANCY_SECONDS

        validator = RSASignatureValidator(RSAPrivateKey())  # its own key (not the process's: tests hold several)
        self._subkey = self.name.encode() + validator.local_public_key
        try:
            # a member that does not listen (behind a NAT) is a DHT client: it dials, nobody dials it
            self.dht = hivemind.DHT(initial_peers=self.bootstrap or None, start=True,
                                    host_maddrs=[f"/ip4/{self.host}/tcp/0"], record_validators=[validator],
                                    client_mode=self.client_mode, nat_port_map=False, auto_nat=False,
                                    use_relay=False)
        except ValidationError as exc:  # hivemind's first ping: the bootstrap peer's clock against this one's
            # from None: hivemind's words follow in the message; its traceback is the forked DHT's
            raise JoinRefused(f"this machine's clock is more than {MAX_DHT_TIME_DISCREPANCY_SECONDS} s off its "
                              f"bootstrap peer's, past what the DHT admits ({shown(str(exc).strip())}): set it "
                              f"right (NTP) and join again") from None
        # no bootstrap answered (hivemind raises P2PDaemonError from its daemon, RuntimeError from its node's
        # first ping), or an address is none
        except (P2PDaemonError, RuntimeError, OSError, TimeoutError, ValueError) as exc:
            raise ConnectionError(f"cannot join the DHT through {', '.join(self.bootstrap) or 'nothing'} "
                                  f"({shown(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)})") from exc
        held = self._read().get(self.name)
        if held is not None and held.get("owner") != validator.local_public_key:
            raise JoinRefused(f"a live member is already named {self.name!r}; choose another members.0.name")
        self._store(left=False)
        self._worker.start()
        if not self._viewed.wait(timeout):
            raise TimeoutError(f"no view of the swarm within {timeout:g} s")
        self.check()

    def maddrs(self) -> list[str]:
        """Where other members' DHT peers reach this one (any of them bootstraps a newcomer)."""
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def check(self) -> None:
        self._worker.check(lambda exc: RuntimeError(f"the DHT membership failed: {exc!r}"))

    def members(self) -> dict[str, dict]:
        with self._lock:
            return {name: {k: v for k, v in entry.items() if k != "owner"} for name, entry in self._members.items()}

    def departed(self) -> set[str]:
        with self._lock:
            departed, self._departed = self._departed, set()
        return departed

    def close(self, leave: bool = True) -> None:
        self._stop.set()
        self._worker.join(10.0)
        if self.dht is not None:
            if leave:
                try:
                    self._store(left=True)
                except (OSError, EOFError, RuntimeError, TimeoutError):  # its DHT is gone: the lease ends it
                    pass
            self.dht.shutdown()

    # ------------------------------------------------------------------------------------------- its thread

    def _store(self, left: bool) -> None:
        from hivemind.utils.timed_storage import get_dht_time

        value = {**self._record, "step": self.step, "stamp": float(self._clock()), "left": left}
        self.dht.store(self.key, subkey=self._subkey, value=value, expiration_time=get_dht_time() + self.lease_s,
                       return_future=True).result(timeout=self._bound)

    def _read(self) -> dict[str, dict]:
        """The live records of the swarm's key, by name; the malformed and the doubly held left out (counted)."""
        got = self.dht.get(self.key, latest=True, return_future=True).result(timeout=self._bound)
        if got is None or not isinstance(got.value, dict):
            return {}
        by_name: dict[str, list[dict]] = {}
        for subkey, item in got.value.items():
            value = getattr(item, "value", None)
            name, _, owner = subkey.partition(OWNER) if isinstance(subkey, bytes) else (b"", b"", b"")
            try:
                name = name.decode("ascii")
            except UnicodeDecodeError:
                name = ""
            if not self._admitted(name, value):
                self.malformed += 1
                continue
            if value["left"]:
                continue
            by_name.setdefault(name, []).append({"step": value["step"], "tokenizer": value["tokenizer"],
                                                 "source": value["source"], "address": value["address"],
                                                 "key": value["key"], "owner": OWNER + owner})
        doubled = [name for name, entries in by_name.items() if len(entries) > 1]
        self.malformed += len(doubled)
        return {name: entries[0] for name, entries in by_name.items() if name not in doubled}

    def _admitted(self, name: str, value) -> bool:
        """A record the coordinator would have admitted: a join's rules for its fields, a step within the run, a
        stamp no more than a quarter lease ahead of this member's clock and no more than a lease behind it."""
        fields = {"step": int, "tokenizer": str, "source": str, "address": str, "key": str, "stamp": float,
                  "left": bool}
        if not isinstance(value, dict) or set(value) != set(fields) or not all(
                isinstance(value[f], t) and (t is bool or not isinstance(value[f], bool)) for f, t in fields.items()):
            return False
        if value["step"] < 0 or (self.steps is not None and value["step"] > self.steps):
            return False
        if not -self.lease_s / 4 <= self._clock() - value["stamp"] <= self.lease_s:  # its writer's clock is off
            return False
        return join_problem({"name": name, "tokenizer": value["tokenizer"], "source": value["source"],
                             "dataset": "0" * 64, "address": value["address"], "key": value["key"]}) is None

    def _run(self) -> None:
        renew = read = 0.0
        stored = self.step
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= renew or self.step != stored:  # a new step goes out at once: the peers' lead bound reads it
                stored = self.step
                self._store(left=False)
                renew = now + self.lease_s / 4
            if now >= read:
                view = self._read()
                if self.name in view or not view:  # its own record seen (or the read came back empty)
                    with self._lock:
                        self._departed.update(n for n, seen in self._members.items()
                                              if n not in view or view[n]["step"] < seen["step"])
                        self._members = view
                    self._viewed.set()
                read = now + min(1.0, self.lease_s / 4)
            self._stop.wait(0.05)
