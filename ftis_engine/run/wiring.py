"""Wiring: the transport (and, for a member on several ranks, the shard) one process runs with, built in one place
for every way a run starts: every member in this process (`connect_local`), or one rank of a torch.distributed
world under `--nproc` or torchrun, a member of an open swarm's own ranks included (`connect`).

Which transport a rank gets (layout.py says which rank it is):

    one process              local.InProcess (async: deliveries delayed by swarm.latency); OpenExchange for an open
                             swarm's member on one process
    a member's further shard exchange.Silent (its leader exchanges for it), and its fsdp.Shard
    a learner or sampler     DistributedAsync in async mode (its weight broadcast group when it has samplers),
                             else DistributedSync
    an open swarm's member   openswarm.member.OpenExchange (its leader), OpenSampler (its samplers)
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..config import ConfigError, RunConfig
from ..core.env import set_for_process
from ..exchange import Exchange, Silent
from ..exchange.async_ import DistributedAsync, Latency
from ..exchange.links import advertised_host
from ..exchange.local import InProcess
from ..exchange.pacer import queue_capacity
from ..exchange.sync import Collectives, DistributedSync
from ..exchange.weights import WeightBroadcast
from ..model.fsdp import Shard, make_groups, weights_backend
from ..openswarm.member import OpenExchange, OpenSampler
from ..openswarm.schedule import PeerBook, sampler_name
from ..topology.layout import Role, endpoint_ranks, member_ranks, process_roles, weights_group_ranks
from .preflight import member_device


@dataclass
class Connection:
    """What one process exchanges through and where it sits: its transport, its role (layout.Role), its part of a
    member on several ranks (None: the member is whole here), for an open swarm's member the book that numbers its
    peers (openswarm.schedule.PeerBook), and what its transport takes from the opened run (session.open_run calls
    it with the Swarm: an open swarm's member announces its tokenizer and dataset from it)."""

    exchange: Exchange
    role: Role
    shard: Shard = field(default_factory=Shard.whole)  # this rank's part of its member (one rank: whole)
    open_peers: object | None = None
    local_rank: int | None = None  # the device index among this node's ranks (None: one process)
    opened: Callable[[object], None] | None = None


def connect_local(config: RunConfig, evaluating: bool = False, join: str | None = None, listen: str | None = None
                  ) -> Connection:
    """Every member in this process: they step together (async: deliveries delayed by swarm.latency only); or,
    with join (the coordinator's address), this config's one member in an open swarm, on one process (listen: where
    its peers dial it, swarm.peers_per_step)."""

    if join is not None:
        exchange = OpenExchange(join, config, listen=listen)
        role = Role(joined=True, asynchronous=config.swarm.mode == "async")
        return Connection(exchange, role, open_peers=exchange.book, opened=exchange.attach)
    role = Role(evaluating=evaluating, asynchronous=config.swarm.mode == "async")
    latency = Latency(config.swarm.latency, config.seed) if role.asynchronous and not evaluating else None
    return Connection(InProcess(list(range(len(config.members))), queue_capacity(config), latency), role)


def round_store(rank: int, world: int, timeout: datetime.timedelta):
    """The rendezvous store under a prefix unique to this launch and restart round. The elastic agent's store (torchrun
    and --nproc share it with their workers) outlives a restart, and torch's env:// default keys every round alike,
    so a rank could read the address a dead rank published in an earlier round and fail to connect. The round's
    number is agreed over that store (agree_round), not taken from TORCHELASTIC_RESTART_COUNT: each node's agent
    counts its own restarts (one whose workers restarted because another node's failed counts 0), so across nodes the
    counts differ and the ranks met under different prefixes until swarm.timeout_s. A store that rank 0 hosts (a
    world launched by hand, or torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) is new every round."""
    from torch.distributed import PrefixStore, TCPStore

    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # the agent hosts it (torchrun, --nproc)
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                     is_master=rank == 0 and not agent_store, timeout=timeout)
    base = f"ftis/{os.environ.get('TORCHELASTIC_RUN_ID', 'manual')}"
    number = agree_round(store, base, rank, world, timeout) if agent_store else 0
    return PrefixStore(f"{base}/round-{number}", store)


def agree_round(store, base: str, rank: int, world: int, timeout: datetime.timedelta, poll_s: float = 0.02) -> int:
    """A number for this round of the world's ranks, the same on every rank and never one an earlier round used, over
    a store that keeps every earlier round's keys (`base`: this launch's prefix in it). Every rank calls it.

    Rank 0 draws the next number (an atomic counter), publishes it as the current round and waits until every other
    rank has acknowledged it, then says go. Another rank acknowledges each published number newer than any it has
    acknowledged before (remembered in the store, so a rank restarted acknowledges a number once per launch) and
    takes the first whose go it sees. A number left by an earlier round cannot be taken: its go needs this rank's
    acknowledgement, given only now, by the rank 0 that drew it, which is then alive now; and an agent starts a
    round's workers only when every worker of the round before has ended, so that rank 0 is this round's. Raises
    TimeoutError (rank 0: torch's DistStoreError) when the others do not come within `timeout`."""
    def key(*parts) -> str:
        return "/".join([base, *map(str, parts)])

    if rank == 0:
        number = store.add(key("rounds"), 1)
        store.set(key("round"), str(number))
        if world > 1:
            store.wait([key(number, "ack", r) for r in range(1, world)], timeout)
        store.set(key(number, "go"), "1")
        return number
    acknowledged = store.add(key("acknowledged", rank), 0)  # by this rank in earlier rounds: never taken now
    mine = None  # the newest number this call acknowledged
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        if store.check([key("round")]):
            number = int(store.get(key("round")))
            if number > acknowledged:
                store.add(key("acknowledged", rank), number - acknowledged)  # first: never acknowledged twice
                acknowledged = mine = number
                store.set(key(number, "ack", rank), "1")
        if mine is not None and store.check([key(mine, "go")]):
            return mine
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 did not open this restart round within {timeout.total_seconds():.0f} s "
                               "(swarm.timeout_s)")
        time.sleep(poll_s)


def gloo_interface(environ=os.environ) -> str | None:
    """The network interface gloo should listen on, for GLOO_SOCKET_IFNAME when it is unset, or None to leave gloo
    to its default. Gloo listens on the address this host's name resolves to; where that is a loopback address (a
    Debian-style /etc/hosts maps the name to 127.0.1.1; containers that share a name) ranks on other nodes cannot
    reach it, and init_process_group failed after minutes with gloo's 'Connect timeout'. A world on several nodes
    (WORLD_SIZE > LOCAL_WORLD_SIZE) then listens on the interface that holds this host's address on the route
    towards MASTER_ADDR (exchange.links.advertised_host, which FTIS_LINKS_HOST overrides)."""
    import ipaddress
    import socket

    if environ.get("GLOO_SOCKET_IFNAME") or int(environ.get("WORLD_SIZE", "1")) <= int(
            environ.get("LOCAL_WORLD_SIZE", environ.get("WORLD_SIZE", "1"))):
        return None
    try:
        resolved = socket.gethostbyname(socket.gethostname())
        if not ipaddress.ip_address(resolved).is_loopback:
            return None
    except (OSError, ValueError):
        resolved = "nothing"
    address = advertised_host()
    name = interface_of(address)
    if name is None:
        raise ConfigError(f"GLOO_SOCKET_IFNAME: this host's name resolves to {resolved}, where ranks on other nodes "
                          f"cannot reach gloo, and no interface holds {address} (the address towards MASTER_ADDR): "
                          "set GLOO_SOCKET_IFNAME to the interface of the network the nodes share")
    return name


def interface_of(address: str) -> str | None:
    """The name of the network interface whose IPv4 address is `address` (Linux), or None."""
    import fcntl
    import socket
    import struct

    SIOCGIFADDR = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
    return None


def connect(config: RunConfig, rank: int, world: int, local_rank: int, join: str | None = None,
            evaluating: bool = False) -> Connection:
    """One rank of a torch.distributed world (the world's size already checked against the layout): joins the
    process group, creates every group in the order all ranks do, and builds this rank's transport and shard.
    join: the open swarm's coordinator, for a member on its own ranks."""

    seat = process_roles(config)[rank]
    device = member_device(config, seat.member, local_rank)
    shared = any(m.device for m in config.members)  # ranks may share a GPU: NCCL refuses that
    backend = config.swarm.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" and not shared else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=config.swarm.timeout_s)
    interface = gloo_interface()  # every gloo group, the helper groups of an NCCL world included
    if interface is not None:  # for the process: gloo reads it at each group's creation, vLLM's later ones too
        set_for_process(GLOO_SOCKET_IFNAME=interface)
    torch.distributed.init_process_group(backend, store=round_store(rank, world, timeout), rank=rank,
                                         world_size=world, timeout=timeout)
    groups = make_groups(config, "nccl" if device.type == "cuda" else "gloo", timeout, open_member=join is not None)
    collectives = Collectives(rank, world, device, backend)
    endpoints = len(endpoint_ranks(config))
    broadcast = None
    if seat.member in groups.weights and not evaluating:  # a member with samplers: its leader or one of its samplers
        nccl = weights_backend(config, device.type, open_member=join is not None) == "nccl"  # as make_groups chose
        broadcast = WeightBroadcast(groups.weights[seat.member], weights_group_ranks(config, seat.member)[0],
                                    device if nccl else torch.device("cpu"))
    open_peers = opened = None
    if join is not None:  # one member in an open swarm, on its own ranks

        name = config.members[0].name
        if seat.endpoint is None:
            exchange = Silent.shard(collectives, seat.member, endpoints)
            open_peers = PeerBook(name)  # a shard's deal is its own name's; it admits nothing
        elif seat.sampler is not None:  # numbered as its member's endpoints: itself, then its samplers
            exchange = OpenSampler(join, config, collectives, broadcast, seat.endpoint, seat.sampler)
            opened = exchange.attach
            open_peers = PeerBook(name)
            for k in range(config.members[0].samplers):
                open_peers.number(sampler_name(name, k))
        else:
            exchange = OpenExchange(join, config, collectives, broadcast)
            open_peers, opened = exchange.book, exchange.attach
    elif seat.endpoint is None:
        exchange = Silent.shard(collectives, seat.member, endpoints)
    elif config.swarm.mode == "async" and not evaluating:
        exchange = DistributedAsync(collectives, config, Latency(config.swarm.latency, config.seed),
                                    endpoint=seat.endpoint, group=groups.links, broadcast=broadcast)
    else:
        exchange = DistributedSync(collectives, endpoint=seat.endpoint, group=groups.endpoints, endpoints=endpoints)
    shard = Shard.whole()
    if seat.sampler is None and seat.member in groups.members:
        fsdp, objects = groups.members[seat.member]
        shard = Shard(seat.shard, config.members[seat.member].ranks, member_ranks(config, seat.member), fsdp, objects)
    return Connection(exchange, Role(seat, rank, joined=join is not None, evaluating=evaluating,
                                     asynchronous=config.swarm.mode == "async"),
                      shard=shard, open_peers=open_peers, local_rank=local_rank, opened=opened)
