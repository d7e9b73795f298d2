"""Wiring: the transport (and, for a member on several ranks, the shard) one process runs with, built in one place
for every way a run starts: every member in this process (`connect_local`), or one rank of a torch.distributed
world under `--nproc` or torchrun, a member of an open swarm's own ranks included (`connect`).

Which transport a rank gets (layout.py says which rank it is):

    one process              LocalSync, or LocalAsync in async mode (eval: LocalSync); OpenExchange for an open
                             swarm's member on one process
    a member's further shard exchange.Shard (its leader exchanges for it), and its fsdp.Shard
    a learner or sampler     DistributedAsync in async mode (its weight broadcast group when it has samplers),
                             else DistributedSync
    an open swarm's member   openswarm.member.OpenExchange (its leader), OpenSampler (its samplers)
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

from .config import RunConfig
from .exchange import Exchange
from .layout import Role, endpoint_ranks, member_ranks, process_roles, weights_group_ranks


@dataclass
class Connection:
    """What one process exchanges through: its transport, its part of a member on several ranks (None: the member
    is whole here), and for an open swarm's member the book that numbers its peers (openswarm.schedule.PeerBook)."""

    exchange: Exchange
    shard: object | None = None  # fsdp.Shard
    open_peers: object | None = None
    role: Role | None = None  # None: every member in this process


def connect_local(config: RunConfig, evaluating: bool = False, join: str | None = None) -> Connection:
    """Every member in this process: they step together (async: deliveries delayed by swarm.latency only); or,
    with join (the coordinator's address), this config's one member in an open swarm, on one process."""
    from .exchange.async_ import Latency, LocalAsync, queue_capacity
    from .exchange.sync import LocalSync

    if join is not None:
        from .openswarm.member import OpenExchange

        exchange = OpenExchange(join, config)
        return Connection(exchange, open_peers=exchange.book)
    if config.swarm.mode == "async" and not evaluating:
        return Connection(LocalAsync(list(range(len(config.members))), Latency(config.swarm.latency, config.seed),
                                     queue_capacity(config)))
    return Connection(LocalSync())


def round_store(rank: int, world: int, timeout: datetime.timedelta):
    """The rendezvous store under a prefix unique to this launch and restart round. torch's env:// default keys
    every round alike, and the agent's store outlives a restart, so after an elastic restart a rank could read the
    address a dead rank published in the previous round and fail to connect (tests/test_placement's kill -9 runs
    do, without the count). Known limit: each node's agent counts its own restarts (a node restarted because
    another node's worker failed still counts 0), so under torchrun across nodes a restart meets under different
    prefixes and times out; restart every node's job instead (docs/distributed.md)."""
    from torch.distributed import PrefixStore, TCPStore

    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # the agent hosts it (torchrun, --nproc)
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                     is_master=rank == 0 and not agent_store, timeout=timeout)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "manual")
    return PrefixStore(f"ftis/{run_id}/round-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def connect(config: RunConfig, rank: int, world: int, local_rank: int, join: str | None = None,
            evaluating: bool = False) -> Connection:
    """One rank of a torch.distributed world (the world's size already checked against the layout): joins the
    process group, creates every group in the order all ranks do, and builds this rank's transport and shard.
    join: the open swarm's coordinator, for a member on its own ranks."""
    from .exchange import Shard as ShardExchange
    from .exchange.async_ import DistributedAsync, Latency
    from .exchange.sync import Collectives, DistributedSync
    from .exchange.weights import WeightBroadcast
    from .fsdp import Shard, make_groups, weights_backend
    from .preflight import member_device

    role = process_roles(config)[rank]
    device = member_device(config, role.member, local_rank)
    shared = any(m.device for m in config.members)  # ranks may share a GPU: NCCL refuses that
    backend = config.swarm.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" and not shared else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=config.swarm.timeout_s)
    torch.distributed.init_process_group(backend, store=round_store(rank, world, timeout), rank=rank,
                                         world_size=world, timeout=timeout)
    groups = make_groups(config, "nccl" if device.type == "cuda" else "gloo", timeout, open_member=join is not None)
    collectives = Collectives(rank, world, device, backend)
    endpoints = len(endpoint_ranks(config))
    broadcast = None
    if role.member in groups.weights and not evaluating:  # a member with samplers: its leader or one of its samplers
        nccl = weights_backend(config, device.type, open_member=join is not None) == "nccl"  # as make_groups chose
        broadcast = WeightBroadcast(groups.weights[role.member], weights_group_ranks(config, role.member)[0],
                                    device if nccl else torch.device("cpu"))
    open_peers = None
    if join is not None:  # one member in an open swarm, on its own ranks
        from .openswarm.member import OpenExchange, OpenSampler
        from .openswarm.schedule import PeerBook, sampler_name

        name = config.members[0].name
        if role.endpoint is None:
            exchange = ShardExchange(collectives, role.member, endpoints, True)
            open_peers = PeerBook(name)  # a shard's deal is its own name's; it admits nothing
        elif role.sampler is not None:  # numbered as its member's endpoints: itself, then its samplers
            exchange = OpenSampler(join, config, collectives, broadcast, role.endpoint, role.sampler)
            open_peers = PeerBook(name)
            for k in range(config.members[0].samplers):
                open_peers.number(sampler_name(name, k))
        else:
            exchange = OpenExchange(join, config, collectives, broadcast)
            open_peers = exchange.book
    elif role.endpoint is None:
        exchange = ShardExchange(collectives, role.member, endpoints, config.swarm.mode == "async")
    elif config.swarm.mode == "async" and not evaluating:
        exchange = DistributedAsync(collectives, config, Latency(config.swarm.latency, config.seed),
                                    endpoint=role.endpoint, group=groups.links, broadcast=broadcast)
    else:
        exchange = DistributedSync(collectives, endpoint=role.endpoint, group=groups.endpoints, endpoints=endpoints)
    shard = None
    if role.sampler is None and role.member in groups.members:
        fsdp, objects = groups.members[role.member]
        shard = Shard(role.shard, config.members[role.member].ranks, member_ranks(config, role.member), fsdp, objects)
    return Connection(exchange, shard, open_peers, role)
