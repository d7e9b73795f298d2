"""Hosts in network namespaces for the open swarm's tests and benchmark: each host is a namespace with one veth link
to a router namespace, with real link delay and packet loss.

    with NetLab({"coord": Link(), "a": Link(), "b": Link(delay_ms=200, loss=0.05)}) as lab:
        proc = lab.popen("coord", [sys.executable, "-m", "ftis_engine", "swarm", "serve", ...])
        lab.address("coord")  # 10.213.1.2

A link's delay and loss apply to every packet crossing it, in both directions (a host with 200 ms has 200 ms one
way to anyone, 400 ms round trip). The test process itself reaches every host over an unshaped link of its own
(10.213.254.2), so a test can run a client in-process and read the hosts' files (namespaces share the file system).

Shaping: `tc qdisc ... netem` on both ends of each link where the kernel has netem; where it does not (this
project's development and CI machines run a kernel built without sch_netem: `tc` answers "Specified qdisc kind
is unknown"), a shaper process in the router namespace takes every forwarded packet off a TUN device (policy
routing), drops it with the links' loss and writes it back after the links' delay: real packets on real TCP
connections (retransmissions, congestion control and all), the delay and loss applied in user space instead of in
the kernel's qdisc. `NetLab.shaping` says which one ran; the shaper's record of the delay it gave each packet is
`NetLab.shaped()`. A host behind a NAT (`Link(dial_out_only=True)`) takes the TUN shaper, which drops every
connection dialled to it (a TCP SYN without ACK): what it dials works both ways.

Needs root (CAP_NET_ADMIN) and `ip`; `NetLab.unavailable()` gives the reason when not, for a test's skip.
"""

from __future__ import annotations

import fcntl
import heapq
import os
import random
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

SUBNET = "10.213"
HERE = 254  # the test process's own link
# one lab at a time on a machine (they share the subnet): a lab waits for the one another process holds (two test
# sessions on one machine), up to LOCK_WAIT_S; the OS lets go of a killed process's lock
LOCK = os.path.join(tempfile.gettempdir(), "ftis-netlab.lock")
LOCK_WAIT_S = 900.0


@dataclass(frozen=True)
class Link:
    delay_ms: float = 0.0
    loss: float = 0.0  # the fraction of packets dropped, each direction
    # behind a NAT: a connection it dials works both ways, one dialled to it never opens (the shaper drops every TCP
    # SYN without ACK addressed to it: the TUN shaper only, which the lab then uses)
    dial_out_only: bool = False


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _sysctl(namespace: str, key: str, value: str) -> None:
    subprocess.run(["ip", "netns", "exec", namespace, "sysctl", "-q", "-w", f"{key}={value}"], check=True,
                   capture_output=True)


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (a throwaway namespace with a veth pair tries it)."""
    name = f"fsprobe{os.getpid()}"
    if _ip("netns", "add", name, check=False).returncode != 0:
        return False
    try:
        _ip("-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        return subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "p0", "root", "netem",
                               "delay", "1ms"], capture_output=True).returncode == 0
    finally:
        _ip("netns", "del", name, check=False)


class NetLab:
    def __init__(self, hosts: dict[str, Link], shaping: str = "auto"):
        assert 0 < len(hosts) < HERE
        self.hosts = dict(hosts)
        tag = f"fs{os.getpid()}"  # "fs<pid>l" stays within an interface name's 15 characters
        self.router = f"{tag}-router"
        self.namespaces = {name: f"{tag}-{name}" for name in hosts}
        self.index = {name: i + 1 for i, name in enumerate(hosts)}
        self.here_link = f"{tag}l"
        self.shaping = shaping
        self.shaper: subprocess.Popen | None = None
        self.procs: list[subprocess.Popen] = []
        self._lock: int | None = None

    @staticmethod
    def unavailable() -> str | None:
        """Why network namespaces cannot be made here, or None."""
        if shutil.which("ip") is None:
            return "no `ip` command (iproute2)"
        if os.geteuid() != 0:
            return "network namespaces need root (CAP_NET_ADMIN)"
        probe = f"fsprobe{os.getpid()}"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"`ip netns add` is not allowed here: {made.stderr.strip()}"
        _ip("netns", "del", probe, check=False)
        if not os.path.exists("/dev/net/tun") and not netem_available():
            return "neither netem nor /dev/net/tun: no way to shape a link"
        return None

    def address(self, host: str) -> str:
        return f"{SUBNET}.{self.index[host]}.2"

    # ------------------------------------------------------------------------------------------- set up, tear down

    def __enter__(self) -> NetLab:
        self._lock = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self._lock)
                    self._lock = None
                    raise RuntimeError(f"another network lab held {LOCK} for {LOCK_WAIT_S:.0f} s") from None
                time.sleep(0.2)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def clear_stale() -> list[str]:
        """Delete the namespaces and links that labs of processes no longer alive left behind (a killed test run
        cannot close its lab, and its route to the hosts' subnet would make every later lab fail); returns what it
        deleted. A live lab of another process is left alone."""
        def dead(pid: int) -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                return False
            return False

        gone = []
        for line in _ip("netns", "list", check=False).stdout.splitlines():
            name = line.split()[0] if line.split() else ""
            m = re.fullmatch(r"fs(\d+)-.+", name)
            if m and dead(int(m.group(1))):
                for pid in _ip("netns", "pids", name, check=False).stdout.split():
                    try:
                        os.kill(int(pid), 9)
                    except (ProcessLookupError, ValueError):
                        pass
                _ip("netns", "del", name, check=False)
                gone.append(name)
        for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
            m = re.match(r"\d+: (fs(\d+)l)[@:]", line)
            if m and dead(int(m.group(2))):
                _ip("link", "del", m.group(1), check=False)
                gone.append(m.group(1))
        return gone

    def _build(self) -> None:
        self.clear_stale()
        taken = [line for line in _ip("route", "show", f"{SUBNET}.0.0/16", check=False).stdout.splitlines() if line]
        if taken:
            raise RuntimeError(f"another network lab (a live process) holds {SUBNET}.0.0/16: {taken[0]}; "
                               "one lab at a time on a machine")
        if self.shaping == "auto":
            nat = any(link.dial_out_only for link in self.hosts.values())
            self.shaping = "netem" if netem_available() and not nat else "tun"
        r = self.router
        _ip("netns", "add", r)
        _ip("-n", r, "link", "set", "lo", "up")
        _sysctl(r, "net.ipv4.ip_forward", "1")
        for key in ("all", "default"):
            _sysctl(r, f"net.ipv4.conf.{key}.rp_filter", "0")
            _sysctl(r, f"net.ipv4.conf.{key}.send_redirects", "0")
        for name, namespace in self.namespaces.items():
            i = self.index[name]
            _ip("netns", "add", namespace)
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("-n", r, "link", "add", f"r{i}", "type", "veth", "peer", "name", "v0", "netns", namespace)
            _ip("-n", r, "addr", "add", f"{SUBNET}.{i}.1/24", "dev", f"r{i}")
            _ip("-n", r, "link", "set", f"r{i}", "up")
            _ip("-n", namespace, "addr", "add", f"{SUBNET}.{i}.2/24", "dev", "v0")
            _ip("-n", namespace, "link", "set", "v0", "up")
            _ip("-n", namespace, "route", "add", "default", "via", f"{SUBNET}.{i}.1")
            link = self.hosts[name]
            if self.shaping == "netem" and (link.delay_ms or link.loss):
                for ns, dev in ((namespace, "v0"), (r, f"r{i}")):
                    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "netem",
                                    "delay", f"{link.delay_ms}ms", "loss", f"{100 * link.loss}%", "limit", "100000"],
                                   check=True, capture_output=True)
        # the test process's own link (unshaped): this namespace reaches every host through the router
        _ip("link", "add", self.here_link, "type", "veth", "peer", "name", f"r{HERE}", "netns", r)
        _ip("-n", r, "addr", "add", f"{SUBNET}.{HERE}.1/24", "dev", f"r{HERE}")
        _ip("-n", r, "link", "set", f"r{HERE}", "up")
        _ip("addr", "add", f"{SUBNET}.{HERE}.2/24", "dev", self.here_link)
        _ip("link", "set", self.here_link, "up")
        _ip("route", "add", f"{SUBNET}.0.0/16", "via", f"{SUBNET}.{HERE}.1")
        if self.shaping == "tun":
            self._start_shaper()

    def _start_shaper(self) -> None:
        r = self.router
        links = {str(i): [self.hosts[name].delay_ms, self.hosts[name].loss, self.hosts[name].dial_out_only]
                 for name, i in self.index.items()}
        import json

        self.shaper = subprocess.Popen(["ip", "netns", "exec", r, sys.executable, __file__, "shape", "fstun",
                                        json.dumps(links)], stdout=subprocess.PIPE, text=True)
        if self.shaper.stdout.readline().strip() != "ready":
            raise RuntimeError("the link shaper did not start")
        _ip("-n", r, "link", "set", "fstun", "up")
        for key in ("fstun",):
            _sysctl(r, f"net.ipv4.conf.{key}.rp_filter", "0")
        # what comes back from the shaper is delivered by the main table; every other forwarded packet goes to it
        _ip("-n", r, "rule", "add", "iif", "fstun", "lookup", "main", "pref", "100")
        _ip("-n", r, "route", "add", f"{SUBNET}.0.0/16", "dev", "fstun", "table", "200")
        _ip("-n", r, "rule", "add", "lookup", "200", "pref", "200")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for namespace in [*self.namespaces.values(), self.router]:
            pids = _ip("netns", "pids", namespace, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
        if self.shaper is not None:
            self.shaper.kill()
            self.shaper.wait(10)
        _ip("link", "del", self.here_link, check=False)
        for namespace in [*self.namespaces.values(), self.router]:
            _ip("netns", "del", namespace, check=False)
        if self._lock is not None:
            os.close(self._lock)  # the next lab may build
            self._lock = None

    # ------------------------------------------------------------------------------------------- processes

    def shaped(self) -> dict[tuple[str, str], dict[int | str, int]]:
        """The TUN shaper's record so far: for each (source, destination) host ("here": the test process), the packets
        it forwarded, by the delay it held them for in ms (the two links' delays together), and under "syn-dropped"
        the connections dialled to a host behind a NAT (Link.dial_out_only) that it dropped."""
        assert self.shaper is not None, "no shaper: this lab shapes with netem"
        self.shaper.send_signal(signal.SIGUSR1)
        import json

        names = {str(i): name for name, i in self.index.items()} | {str(HERE): "here"}
        record: dict[tuple[str, str], dict[int, int]] = {}
        for key, packets in json.loads(self.shaper.stdout.readline()).items():
            source, destination, delay_ms = key.split()
            held = int(delay_ms) if delay_ms.isdigit() else delay_ms
            record.setdefault((names[source], names[destination]), {})[held] = packets
        return record

    def popen(self, host: str, argv: list[str], **kw) -> subprocess.Popen:
        """Run argv on a host (in its namespace); killed at close."""
        p = subprocess.Popen(["ip", "netns", "exec", self.namespaces[host], *argv], **kw)
        self.procs.append(p)
        return p


# ------------------------------------------------------------------------------------------------- the shaper


def shape(device: str, links: dict[str, list[float]]) -> None:
    """Forward every packet read from the TUN `device` back into it after the delay of the links it crosses
    (source's and destination's, by the third octet of the address), or drop it with their loss. SIGUSR1 prints
    what it forwarded so far, on one line of JSON: "<source> <destination> <delay in ms>" -> packets."""
    import fcntl
    import json

    TUNSETIFF, IFF_TUN, IFF_NO_PI = 0x400454CA, 0x0001, 0x1000
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", device.encode(), IFF_TUN | IFF_NO_PI))
    held: dict[str, int] = {}
    signal.signal(signal.SIGUSR1, lambda signum, frame: print(json.dumps(held), flush=True))
    print("ready", flush=True)
    delay = {int(k): v[0] / 1000 for k, v in links.items()}
    loss = {int(k): v[1] for k, v in links.items()}
    natted = {int(k) for k, v in links.items() if len(v) > 2 and v[2]}
    rng = random.Random(0)
    due: list[tuple[float, int, bytes]] = []
    sequence = 0
    while True:
        timeout = max(0.0, due[0][0] - time.monotonic()) if due else None
        readable, _, _ = select.select([fd], [], [], timeout)
        if readable:
            packet = os.read(fd, 65536)
            if len(packet) >= 20 and packet[0] >> 4 == 4:
                src, dst = packet[14], packet[18]  # 10.213.<host>.x
                tcp = 4 * (packet[0] & 0x0F)  # the TCP header's offset (the IP header's length)
                if dst in natted and packet[9] == 6 and len(packet) > tcp + 13 and packet[tcp + 13] & 0x12 == 0x02:
                    key = f"{src} {dst} syn-dropped"  # a connection dialled to a host behind a NAT: never opens
                    held[key] = held.get(key, 0) + 1
                    continue
                kept = (1 - loss.get(src, 0.0)) * (1 - loss.get(dst, 0.0))
                if rng.random() < kept:
                    sequence += 1
                    hold = delay.get(src, 0.0) + delay.get(dst, 0.0)
                    heapq.heappush(due, (time.monotonic() + hold, sequence, packet))
                    key = f"{src} {dst} {round(1000 * hold)}"  # recorded as given (NetLab.shaped)
                    held[key] = held.get(key, 0) + 1
        now = time.monotonic()
        while due and due[0][0] <= now:
            os.write(fd, heapq.heappop(due)[2])


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "shape":
    import json

    shape(sys.argv[2], json.loads(sys.argv[3]))
