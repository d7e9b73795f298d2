"""An open swarm's schedule, by name (openswarm/member.py's members and samplers use it): peers are numbered locally
in order of first sight (PeerBook), and member N's step t draws its own prompts from a shuffle seeded by (seed, N)
(OpenSchedule), so that a receiver recomputes any peer's deal from its name and step with membership changing.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..core.limits import max_buffer_words
from ..topology.schedule import Schedule, learner_version, mix_seed, prompts_for_step
from .wire import SAMPLER_INDEX, SAMPLER_MARK


def sampler_name(member: str, index: int) -> str:
    """The name a member's sampler joins under (no member name holds a /)."""
    return f"{member}{SAMPLER_MARK}{index}"


def split_sampler(name: str) -> tuple[str, int] | None:
    """(member name, sampler index) of a sampler's name; None for a member's. The index as sampler_name writes it
    (ASCII digits, no leading zero): "a/sampler-01" is no alias of "a/sampler-1"."""
    owner, mark, index = name.rpartition(SAMPLER_MARK)
    if not mark or not owner or not SAMPLER_INDEX.fullmatch(index):
        return None
    return owner, int(index)


class PeerBook:
    """What a member knows of its peers: their local numbers (0 is itself, then 1, 2, ... in order of first
    sight), names and newest published steps, kept by its transport (openswarm/member.py). Who is live reaches
    the schedule as an event (exchange.Peers, OpenSchedule.observe), not through the book."""

    def __init__(self, own_name: str):
        self.names = [own_name]
        self._numbers = {own_name: 0}
        self.published: dict[str, int] = {}
        self._lock = threading.Lock()

    def number(self, name: str) -> int:
        with self._lock:
            if name not in self._numbers:
                self._numbers[name] = len(self.names)
                self.names.append(name)
            return self._numbers[name]

    def name(self, number: int) -> str:
        return self.names[number]

    def publish(self, name: str, step: int) -> None:
        with self._lock:
            self.published[name] = max(self.published.get(name, 0), step)

    def forget(self, name: str) -> None:
        """A peer that is no longer live: its newest published step goes (its number stays)."""
        with self._lock:
            self.published.pop(name, None)


class _Deals(Mapping):
    """One step's deals, by local member number, computed when asked."""

    def __init__(self, schedule: OpenSchedule, step: int):
        self.schedule, self.step = schedule, step

    def __getitem__(self, member: int) -> dict[int, int]:
        return self.schedule.name_deal(self.schedule.peers.name(member), self.step)

    def __iter__(self):
        return iter(range(len(self.schedule.peers.names)))

    def __len__(self) -> int:
        return len(self.schedule.peers.names)


@dataclass(frozen=True)
class OpenSchedule(Schedule):
    """The schedule of a member in an open swarm: every member's prompts from its own stream (see the module)."""

    peers: PeerBook = None  # type: ignore[assignment]
    # the newest exchange.Peers.live, in one cell (the schedule is frozen; observe() replaces what it holds)
    live: list[tuple[int, ...]] = field(default_factory=lambda: [(0,)], compare=False)

    @property
    def roles(self) -> list[tuple[int, int | None]]:
        """(member, sampler index or None) by local number: a sampler of this member's is member 0 (its rollouts
        are this member's own: not screened, not share-capped), another member's sampler is a member of its own
        number. Only an index below members.0.samplers is one of its own (whose parcels the exchange took only
        signed with its samplers' key: member.OpenExchange); any other name is a peer's."""
        out: list[tuple[int, int | None]] = []
        own, samplers = self.peers.names[0], self.config.members[0].samplers
        for k, name in enumerate(list(self.peers.names)):
            parsed = split_sampler(name)
            mine = parsed is not None and parsed[0] == own and parsed[1] < samplers
            out.append((k, None) if parsed is None else (0 if mine else k, parsed[1]))
        return out

    def member_name(self, member: int) -> str:
        return self.peers.name(member)

    @property
    def has_peers(self) -> bool:
        """An open swarm's member collaborates with whoever is live in the swarm (its config has itself alone)."""
        return True

    def sender_label(self, rank: int) -> str:
        return self.peers.name(rank)

    def sampler_versions(self, member: int, receiver: int, step: int) -> tuple[int | None, int]:
        if member == receiver:
            return self.config.members[0].weight_sync_every, learner_version(step)
        return None, learner_version(self.config.train.steps)

    def round_deal(self, rank: int, round_: int) -> dict[int, int]:
        return self.name_deal(self.peers.name(rank), round_)

    def wire_member(self, member: int) -> int:
        return 0  # every member is member 0 of its own config

    @property
    def num_members(self) -> int:
        return 1

    def name_deal(self, name: str, step: int) -> dict[int, int]:
        config = self.config
        prompts = prompts_for_step(step, list(self.train_indices), config.rollout.prompts_per_step,
                                   f"{config.seed}-open-{name}", True)
        return {p: config.rollout.group_size for p in prompts}

    def deal(self, step: int) -> Mapping[int, dict[int, int]]:
        return _Deals(self, step)

    def dealt_sizes(self, member: int) -> tuple[int, int]:
        rollout = self.config.rollout
        return rollout.prompts_per_step, rollout.prompts_per_step * rollout.group_size

    def step_sequences(self, rank: int) -> int:
        return self.dealt_sizes(rank)[1]

    def sampling_seed(self, step: int, who: int, shard: int = 0) -> int:
        return mix_seed(self.config.seed, step, zlib.crc32(self.peers.name(who).encode()) % 1_000_003, shard)

    def parcel_limit(self, sender: int, step: int) -> int:
        if not 0 < sender < len(self.peers.names) or step < 1:
            return 0
        if split_sampler(self.peers.name(sender)) is None and step > self.config.train.steps:
            return 0
        return max_buffer_words(self.step_sequences(sender), self.config.rollout.max_new_tokens)

    def observe(self, live: tuple[int, ...]) -> None:
        """Who is live as of the member's newest receive (exchange.Peers.live, its transport's view of the
        coordinator's word): its senders and budget until the next."""
        self.live[0] = tuple(live)

    def senders(self, receiver: int) -> list[int]:
        return [k for k in self.live[0] if k != receiver]

    def peer_budget(self, receiver: int) -> int:
        configured = self.config.swarm.max_peer_sequences
        if configured is not None:
            return configured
        return sum(self.step_sequences(k) for k in self.senders(receiver))
