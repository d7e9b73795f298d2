"""Ports for servers a test or a benchmark starts later, kept apart from every other socket on the machine (the
standard library only: benchmarks import it too)."""

from __future__ import annotations

import itertools
import os
import pathlib
import random
import socket


def _port_block() -> range:
    """This test process's own ports: below the kernel's ephemeral range, which sockets bound to port 0 and
    outgoing connections draw from, and a block per pytest-xdist worker (gw0, gw1, ...)."""
    try:
        low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    size = 1000
    start = 20000 + index * size
    return range(start, start + size) if start + size <= low else range(0)


_PORTS = _port_block()
_next_port = itertools.count(random.randrange(len(_PORTS)) if _PORTS else 0)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a server a test starts later (a hand-launched world's TCPStore, a
    coordinator started again on its address). A port bound to 0 and released could be taken in the seconds before
    the server binds it by any socket another process opens (under pytest-xdist, a test running beside this one);
    one from this process's own block outside the ephemeral range cannot, and the block is cycled so that a port
    comes back only after the other thousand. Without such a block (an ephemeral range starting low), port 0's."""
    for _ in range(len(_PORTS)):
        port = _PORTS[next(_next_port) % len(_PORTS)]
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
