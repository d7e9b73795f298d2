"""The process layout: which process rank is which member's shard or sampler (pure arithmetic on the config).

Decided here and nowhere else (`members.N.ranks`, `members.N.samplers`): every member's ranks side by side in
member order (its first rank is its leader), then the sampler ranks, in member order. Rank order is node order
under torchrun, so a member's ranks share a node whenever its K fits one.

Two numberings: *process ranks* (every process, `process_roles`) and *endpoints* (`endpoint_roles`: every
member's leader, then the samplers), which is how the exchange, the schedule and the receivers number senders:
one endpoint per member whatever its ranks. `endpoint_ranks` maps endpoints to process ranks. A run whose members
all have one rank has process rank = endpoint. The world size (`--nproc`) is the sum of every member's ranks and
samplers.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError, RunConfig


@dataclass(frozen=True)
class Seat:
    """Where one process sits in the layout: learner (sampler None) or sampler of a member, which shard of it, and
    the exchange endpoint it is (None: a member's further shard, which its leader exchanges for)."""

    member: int
    sampler: int | None
    shard: int  # 0 for the leader and for samplers
    endpoint: int | None


def endpoint_roles(config: RunConfig) -> list[tuple[int, int | None]]:
    """(member, sampler index) of every exchange endpoint: endpoints 0..M-1 are the members' learners (sampler
    index None), then each member's members.N.samplers samplers, in member order."""
    roles: list[tuple[int, int | None]] = [(i, None) for i in range(len(config.members))]
    for i, member in enumerate(config.members):
        roles += [(i, k) for k in range(member.samplers)]
    return roles


def process_roles(config: RunConfig) -> list[Seat]:
    """Every process rank's seat: each member's shards in member order, then the samplers."""
    endpoints = {role: e for e, role in enumerate(endpoint_roles(config))}
    roles = [Seat(i, None, shard, endpoints[(i, None)] if shard == 0 else None)
             for i, member in enumerate(config.members) for shard in range(member.ranks)]
    roles += [Seat(i, k, 0, endpoints[(i, k)])
              for i, member in enumerate(config.members) for k in range(member.samplers)]
    return roles


def world_size(config: RunConfig) -> int:
    """How many processes the config needs: one per member rank and per sampler."""
    return sum(m.ranks + m.samplers for m in config.members)


def needed_processes(config: RunConfig) -> str:
    """What a config's process count is made of, for a message: "3 processes: tiny-s on 2 ranks, ..."."""
    parts = [f"{m.name} on {m.ranks} rank(s)" if m.ranks > 1 else m.name for m in config.members]
    samplers = sum(m.samplers for m in config.members)
    if samplers:
        parts.append(f"{samplers} sampler rank(s)")
    return (f"the config needs {world_size(config)} processes (one per member rank and sampler: "
            f"{', '.join(parts)})")


def check_processes(config: RunConfig, processes: int | None, *, evaluating: bool = False, given: str = "") -> None:
    """The one check of the processes a run starts in against its layout (ConfigError naming the field or flag).
    processes: how many (None: one process holding every member); given: how that count was given, for the
    message (--nproc N, WORLD_SIZE=N). An eval runs the members' ranks only (samplers do not change the model)."""
    samplers = next((i for i, m in enumerate(config.members) if m.samplers), None)
    if processes is None:
        if evaluating:  # every member evaluates in this process, whatever its ranks and samplers
            return
        if samplers is not None:
            raise ConfigError(f"members.{samplers}.samplers: sampler ranks run in processes of their own: --nproc "
                              f"{world_size(config)} (one per member rank and sampler) or torchrun")
        ranked = next((i for i, m in enumerate(config.members) if m.ranks > 1), None)
        if ranked is not None:
            raise ConfigError(f"members.{ranked}.ranks: a member on {config.members[ranked].ranks} ranks runs in "
                              f"processes of its own: --nproc {world_size(config)} (or torchrun)")
        return
    if evaluating and samplers is not None:
        raise ConfigError(f"members.{samplers}.samplers: eval runs the members' ranks only; add --set "
                          f"members.{samplers}.samplers=0 (samplers do not change the model)")
    if processes != world_size(config):
        raise ConfigError(f"{given}: {needed_processes(config)}")


def endpoint_ranks(config: RunConfig) -> list[int]:
    """The process rank of every exchange endpoint (in endpoint_roles order)."""
    ranks = {role.endpoint: r for r, role in enumerate(process_roles(config)) if role.endpoint is not None}
    return [ranks[e] for e in range(len(ranks))]


def member_ranks(config: RunConfig, member: int) -> list[int]:
    """The process ranks of a member's learner, leader first (shard order)."""
    return [r for r, role in enumerate(process_roles(config)) if role.member == member and role.sampler is None]


def learner_endpoints(config: RunConfig) -> list[int]:
    """The endpoints of the members' learners (0..M-1)."""
    return [e for e, (_, sampler) in enumerate(endpoint_roles(config)) if sampler is None]


def sampler_endpoints(config: RunConfig, member: int) -> list[int]:
    """The endpoints of a member's samplers, in sampler order."""
    return [e for e, (m, k) in enumerate(endpoint_roles(config)) if m == member and k is not None]


def weights_group_ranks(config: RunConfig, member: int) -> list[int]:
    """A member's weight broadcast group (process ranks): its leader's rank, then its samplers' ranks."""
    samplers = [r for r, role in enumerate(process_roles(config)) if role.member == member and role.sampler is not None]
    return [member_ranks(config, member)[0], *samplers]


def describe_role(config: RunConfig, role: Seat) -> str:
    """A process as people name it: the member, a sampler of it, or a shard of a member on several ranks."""
    member = config.members[role.member]
    if role.sampler is not None:
        return f"{member.name}: sampler {role.sampler}"
    if member.ranks > 1:
        return f"{member.name}: shard {role.shard + 1}/{member.ranks}" + (" (leader)" if role.shard == 0 else "")
    return member.name


def describe_layout(config: RunConfig) -> str:
    """One line per rank: what it runs (printed at start)."""
    return "\n".join(f"  rank {rank}: {describe_role(config, role)}" for rank, role in enumerate(process_roles(config)))


@dataclass(frozen=True)
class Role:
    """What this process is in its run, decided once as it connects (wiring.py) and carried in its Swarm: every
    layer reads it here, where each used to ask the transport, its members or its shard.

    seat: its place in the layout (a learner's shard, a sampler), or None: every member of the config in this one
    process (an open swarm's member on one process among them)."""

    seat: Seat | None = None
    rank: int = 0  # the process rank in its world (an open swarm's member on several ranks: in its own)
    joined: bool = False  # a member of an open swarm (train --join)
    evaluating: bool = False  # eval --checkpoint: generates, never trains or exchanges
    asynchronous: bool = False  # swarm.mode async

    @property
    def writes_run(self) -> bool:
        """Rank 0 writes the run's shared files: config.yaml, the shared metrics log, plots, final_eval.json, and
        completes a synchronous run's checkpoints."""
        return self.rank == 0

    @property
    def reports(self) -> bool:
        """Logs and evaluates the members it holds: every process but a member's further shard (its leader does)."""
        return self.seat is None or self.seat.shard == 0

    @property
    def independent(self) -> bool:
        """Never synchronises with another process after the start (each logs its own records and completes its own
        checkpoints): an open swarm's member, or a rank of an async run across processes."""
        return self.joined or (self.seat is not None and self.asynchronous and not self.evaluating)

    @property
    def writes_records(self) -> bool:
        """Writes records to the run directory: rank 0 (every rank's, in a synchronous world), and every process
        that never synchronises and reports (its own)."""
        return self.writes_run or (self.independent and self.reports)

    @property
    def sampler(self) -> int | None:
        """A sampler rank: its index among its member's samplers; None: a learner."""
        return None if self.seat is None else self.seat.sampler
