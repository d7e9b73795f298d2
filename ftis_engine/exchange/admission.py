"""The one receiver, in both modes: what a member makes of its peers' parcels (peers' rollouts are untrusted input),
and what an update takes of them (the intake). The checks that need no state (steps 8-10: values, claims, re-score,
foreign adoption) are exchange/verify.py's; this module applies them in order, with those that need the
receiver's state (sizes, steps, versions, time, staleness, replays).

A parcel is admitted whole or not at all. In this order, the first failure drops it with one warning naming the
peer (counted in rejected_batches), except staleness, which is no fault (counted in stale_dropped):

    1. size      the transport refused it unread: more words than an honest parcel of its step can hold
                 (schedule.Schedule.parcel_limit), or a size announced as empty
    2. step      a learner's within 1..train.steps; a sampler's round >= 1
    3. decode    a well-formed buffer (rollouts.decode)
    4. versions  every rollout carries the parcel's policy version; a learner's is its step - 1; a sampler's is
                 its start or a multiple of weight_sync_every, no newer than its learner can have pushed
    5. time      made at most FUTURE_TOLERANCE_S in the future (a clock that far off would defeat max_delay_s)
    6. staleness version more than swarm.max_staleness steps behind the receiver's (or made longer than
                 swarm.max_delay_s ago): dropped, counted in stale_dropped
    7. replay    a second parcel of the same sender and step: dropped, counted in duplicate_dropped, no fault (a
                 member that resumed from its checkpoint redoes and resends the steps after it; a liar gains nothing
                 from a copy that is never trained on)
    8. values    the deal of the sender's step or round (prompts, counts), the sender's member, token ids in
                 the vocabulary, lengths, finite non-positive log-probs, finite rewards (validate)
    8b. claims   generation log-probs no generator can have made (implausible_claims; defense.check_claims):
                 a claimed surprisal beyond what any distribution over the vocabulary gives its samples, or
                 completions of one prompt that branch where the claimed probabilities of the branches sum
                 above 1
    9. re-score  every reward re-computed from the text here equals the sender's claim; a re-score that times
                 out (math-verify) is no verdict: that prompt's group is left out (rescore_timeouts), the rest kept;
                 a reward the sender marked unscored (NaN: its own scoring timed out) leaves its group out too
                 (peer_unscored_dropped), as the sender leaves it out of its own update
   10. foreign   a peer whose tokenizer differs: its text is re-encoded with the receiver's tokenizer and trained
                 on at sequence level (RolloutChecker.adopt; a group whose text does not survive the round trip is
                 left out, foreign_dropped). A receiver with members.N.accept_foreign false refuses the parcels of
                 such a peer once they are decoded (step 3), before any other check (foreign_refused: no fault)

Defenses beyond the checks (defense.*; docs/adversaries.md): a peer group much longer than the receiver's own
completions is left out (max_length_ratio, length_dropped); no peer supplies more than a share of an update
(max_peer_share, share_capped). Those that read the receiver's own model (likelihood_floor, claims_monitor) run
on each step's newly admitted groups before the intake is taken (exchange/screen.py; Admission.screen_rollouts,
with the log-prob function the receiver is built with), so a group they leave out frees its place in the budget for another; a peer newly quarantined loses
its groups still waiting too.

Intake: admitted rollouts wait as whole groups (one prompt's completions from one sender). Sync mode trains on
all of them at once. Async, an update takes at most its budget (swarm.max_peer_sequences; default what a sync step
gives): each sender first, round-robin, up to its share of a step (a fast peer cannot crowd out a slow one), then
the freshest policy versions of the rest. What is left waits for the next step while it will still be within
max_staleness (at most max_staleness + 1 budgets wait), else it is dropped and counted in surplus_dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import statistics
import time
import typing
from collections import defaultdict
from dataclasses import dataclass, field

from ..config import RunConfig
from ..data.rollouts import Rollout, RolloutError, buffer_digest, decode
from ..model.fsdp import Shard
from ..topology.schedule import Schedule, learner_version, staleness
from . import Parcel, Peers
from .capability import CapabilityTracker
from .screen import LogProbs, Screen, Screened
from .verify import RolloutChecker

log = logging.getLogger("ftis_engine.exchange")

FUTURE_TOLERANCE_S = 600.0  # clocks of different nodes may differ by this much
OWN_LENGTHS = 256  # the receiver's own recent completion lengths its length guard measures against


class KeptState(typing.NamedTuple):
    """A receiver's state kept across steps: what holds it, what it is, what a resume without its file does."""

    target: typing.Any
    what: str
    afresh: str


# every kept state's file in a member's checkpoint; a new one is added here, or kept_states() raises KeyError
KEPT_STATES = {"screen.json": ("claims-monitor state", "every peer's test starts afresh"),
               "admission.json": ("length-guard state", "its own lengths start afresh"),
               "capability.json": ("hacpo capability history", "every sender's capability starts at 1")}


@dataclass
class Group:
    """Admitted rollouts that train together: one prompt's completions from one sender's parcel."""

    sender: int
    version: int
    rollouts: list[Rollout]
    order: int  # admission order: ties in freshness go to the earlier
    parcel: str  # the parcel it came in: "sender@step"
    digest: str  # that parcel's buffer digest (rollouts.buffer_digest)

    @property
    def size(self) -> int:
        return len(self.rollouts)

    @property
    def made_at(self) -> float:
        return min(r.made_at for r in self.rollouts)


@dataclass
class Received:
    """What a receiver made of one step's arrivals: the peer rollouts it trains on now, and what it did not."""

    rollouts: list[Rollout] = field(default_factory=list)
    rejected: list[tuple[int, str]] = field(default_factory=list)  # (sender rank, reason): failed a check
    stale_dropped: int = 0  # sequences that arrived older than max_staleness steps or max_delay_s seconds
    duplicate_dropped: int = 0  # sequences of a second parcel of one sender's step (a resumed member redoes steps)
    surplus_dropped: int = 0  # admitted (or queued) sequences that never fitted an update's budget
    rescore_timeouts: int = 0  # sequences left out (whole groups) because their re-score timed out
    unscored_dropped: int = 0  # sequences left out (whole groups) that their sender could not score (NaN reward)
    foreign_refused: int = 0  # sequences of peers with another tokenizer, refused (members.N.accept_foreign false)
    foreign_dropped: int = 0  # sequences of such peers left out (whole groups): their text did not round-trip here
    staleness: list[int] = field(default_factory=list)  # per peer rollout trained on, in the receiver's steps
    age_seconds: list[float] = field(default_factory=list)  # per peer rollout trained on, made -> taken
    digests: dict[str, str] = field(default_factory=dict)  # "sender@step" -> buffer digest, per parcel trained on
    waiting: int = 0  # admitted sequences left for a later step
    share_capped: dict[str, int] = field(default_factory=dict)  # sender -> sequences over defense.max_peer_share
    length_dropped: dict[str, int] = field(default_factory=dict)  # sender -> sequences over defense.max_length_ratio
    screened: Screened = field(default_factory=Screened)  # what the model-reading defenses left out
    screen_seconds: float = 0.0  # their forward and verdicts

    def metrics(self) -> dict:
        def spread(name: str, values: list) -> dict:
            if not values:
                return {f"{name}_min": None, f"{name}_mean": None, f"{name}_max": None}
            return {f"{name}_min": min(values), f"{name}_mean": sum(values) / len(values), f"{name}_max": max(values)}

        return {**spread("staleness", self.staleness), **spread("staleness_seconds", self.age_seconds),
                "stale_dropped": self.stale_dropped, "surplus_dropped": self.surplus_dropped,
                "duplicate_dropped": self.duplicate_dropped,
                "rescore_timeouts": self.rescore_timeouts, "peer_unscored_dropped": self.unscored_dropped,
                "foreign_sequences": sum(r.seq_logprob is not None for r in self.rollouts),
                "foreign_refused": self.foreign_refused, "foreign_dropped": self.foreign_dropped,
                "peer_sequences": len(self.rollouts), "intake_waiting": self.waiting,
                "rejected_batches": len(self.rejected), "received_sha256": self.digests,
                "share_capped": sum(self.share_capped.values()), "share_capped_by": self.share_capped,
                "length_dropped": sum(self.length_dropped.values()), "length_dropped_by": self.length_dropped}


class Admission:
    """One local member's receiver: admits parcels (the checks above) and takes each step's intake."""

    def __init__(self, config: RunConfig, schedule: Schedule, checker: RolloutChecker, receiver: int,
                 start_step: int = 0, logprobs: LogProbs | None = None, shard: Shard | None = None):
        """logprobs: the receiver's own per-token log-probs of peer rollouts' completions (one no-grad forward of
        its model: session builds it), which the model-reading defenses read; None where no model is at hand (a
        receiver built for a test), refused while such a defense is on (it would screen nothing, silently). shard: a
        sharded member's (fsdp.Shard): its leader's admitted rollouts are screened on every shard (each runs the
        forward) and its verdicts hold."""
        self.config = config
        self.schedule = schedule
        self.checker = checker
        self.receiver = receiver
        self.start_step = start_step  # the step a resumed run restarted after (a sampler may hold its version)
        self.asynchronous = config.swarm.mode == "async"
        self.pool: list[Group] = []
        self._seen: dict[tuple[int, int], int] = {}  # (sender rank, step) -> version, within the staleness window
        self._order = 0
        self._screened_up_to = 0  # groups of order below it have been screened
        self._own_lengths: collections.deque[int] = collections.deque(maxlen=OWN_LENGTHS)
        self.screen = Screen(config.defense, config.members[receiver].name)  # the checks that read its model
        if logprobs is None and self.screen.active:
            raise ValueError("Admission: defense.likelihood_floor and defense.claims_monitor read the receiver's "
                             "model: build it with its log-prob function (logprobs=...)")
        self.logprobs = logprobs
        self.shard = shard if shard is not None else Shard.whole()  # a one-rank member's: the whole of it
        self.capability = CapabilityTracker(receiver)  # hacpo: its senders' capabilities (the update reads them)

    @property
    def budget(self) -> int | None:
        """Async: the most peer sequences an update takes (None: sync, all of them). Asked of the schedule at each
        use: an open swarm's peers come and go."""
        return self.schedule.peer_budget(self.receiver) if self.asynchronous else None

    @property
    def shares(self) -> dict[int, int]:
        """Each sender's share of a step (the round-robin's first pass)."""
        return {rank: self.schedule.step_sequences(rank) for rank in self.schedule.senders(self.receiver)}

    def kept_states(self) -> dict[str, KeptState]:
        """The receiver's defenses that keep state across steps, by their file in the member's checkpoint (each
        target has state() and load_state(state, where)): the claims monitor's tests; the length guard's own
        lengths; hacpo's capability history. What each is, and what a resume without its file does, come from one
        table (KEPT_STATES)."""
        defense, targets = self.config.defense, {}
        if defense.claims_monitor:
            targets["screen.json"] = self.screen
        if defense.max_length_ratio is not None:
            targets["admission.json"] = self
        if self.config.algorithm.method == "hacpo":
            targets["capability.json"] = self.capability
        return {file: KeptState(target, *KEPT_STATES[file]) for file, target in targets.items()}

    def state(self) -> dict:
        """The length guard's recent own lengths (defense.max_length_ratio), for the member's checkpoint (JSON): a
        resumed receiver measures its peers against the median an uninterrupted run would (bit-exact resumes)."""
        return {"own_lengths": list(self._own_lengths)}

    def load_state(self, state: object, where: str) -> None:
        """Go on with a checkpoint's state(); a malformed one raises ValueError naming `where`."""
        lengths = state.get("own_lengths") if isinstance(state, dict) else None
        if not (isinstance(lengths, list) and len(lengths) <= OWN_LENGTHS
                and all(type(n) is int and n >= 0 for n in lengths)):
            raise ValueError(f"{where}: not an admission state (own_lengths: a list of at most {OWN_LENGTHS} "
                             "completion lengths)")
        self._own_lengths.clear()
        self._own_lengths.extend(lengths)

    def sender_name(self, rank: int) -> str:
        return self.schedule.sender_label(rank) if 0 <= rank < len(self.schedule.roles) else f"rank {rank}"

    def receive(self, parcels: list[Parcel], step: int, dropped_unread: int = 0, own_sequences: int | None = None,
                own_lengths: list[int] | None = None, peers: Peers | None = None) -> Received:
        """Admit the step's parcels, screen what was admitted, then take the intake. dropped_unread: sequences the
        transport dropped from a full queue (counted as surplus); own_sequences: the receiver's own in this update
        (default: its dealt share), for defense.max_peer_share; own_lengths: its own completions' lengths, for
        defense.max_length_ratio. The model-reading defenses (screen_rollouts) run once a step where they are on,
        on this step's newly admitted peer rollouts (a sharded member's further shards admit none: they screen
        the leader's); their seconds are Received.screen_seconds. The share cap (defense.max_peer_share) then
        counts the update as it will be trained on: with a peer screened out, the others' shares grow and may be
        capped. peers: an open swarm's membership as of this receive (exchange.Peers): who is live (the schedule's
        senders and budget) and which peers' tokenizers are loaded here (this receiver's checker re-encodes their
        text); None: the config's, fixed."""
        if peers is not None:
            self.checker.foreign = dict(peers.foreign)
            self.schedule.observe(peers.live)
        out = Received(surplus_dropped=dropped_unread)
        self._own_lengths.extend(own_lengths or ())
        now = time.time()
        for parcel in parcels:
            try:
                self._admit(parcel, step, now, out)
            except RolloutError as exc:
                out.rejected.append((parcel.sender, str(exc)))
                log.warning("%s: dropped the rollouts of peer %s of its step %d: %s",
                            self.config.members[self.receiver].name, self.sender_name(parcel.sender), parcel.step, exc)
        if self.logprobs is not None and self.screen.active:
            started = time.perf_counter()
            self._screen(out)
            out.screen_seconds = time.perf_counter() - started
        own = own_sequences if own_sequences is not None else self.schedule.step_sequences(self.receiver)
        self._take(step, now, out, own)
        out.rollouts = self.shard.from_leader(out.rollouts)  # the leader admits and takes: every shard trains on it
        return out

    def screen_rollouts(self, rollouts: list[Rollout]) -> tuple[list[Rollout], Screened]:
        """The newly admitted peer rollouts the model-reading defenses keep (defense.likelihood_floor,
        defense.claims_monitor; exchange/screen.py), in their order, and what was left out: one no-grad forward of
        the receiver's model over its peers' completions (its own samplers' are its own, never screened). A
        sharded member's shards all run the forward on the leader's rollouts; the leader's verdicts hold."""
        rollouts = self.shard.from_leader(rollouts)
        others = [r for r in rollouts if r.member != self.receiver]
        if not others:
            return rollouts, Screened()
        logprobs = self.logprobs(others)
        names = [self.schedule.member_name(r.member) for r in others]  # an open swarm's peers are numbered locally
        drop, screened = self.screen.verdicts(others, logprobs, names) if self.shard.leader else (None, None)
        drop, screened = self.shard.from_leader((drop, screened))
        left = {id(others[k]) for k in drop}
        return [r for r in rollouts if id(r) not in left], screened

    def _screen(self, out: Received) -> None:
        """Leave out of the pool the new groups the screen drops, and every waiting group of a peer it
        quarantines (counted there too)."""
        new = [g for g in self.pool if g.order >= self._screened_up_to]
        self._screened_up_to = self._order
        kept, out.screened = self.screen_rollouts([r for g in new for r in g.rollouts])
        kept_ids, new_ids = {id(r) for r in kept}, {id(g) for g in new}
        quarantined = self.screen.quarantined_names()
        pool = []
        for g in self.pool:
            member = self.schedule.roles[g.sender][0]
            name = self.schedule.member_name(member)  # as the screen names a peer: its samplers' groups are its own
            if id(g) in new_ids and any(id(r) not in kept_ids for r in g.rollouts):
                continue  # left out by the screen (and counted there)
            if name in quarantined and member != self.receiver:
                out.screened.quarantined[name] = out.screened.quarantined.get(name, 0) + g.size
                continue
            pool.append(g)
        self.pool = pool

    def _admit(self, parcel: Parcel, step: int, now: float, out: Received) -> None:
        cfg = self.config
        roles = self.schedule.roles
        if parcel.refused is not None:
            raise RolloutError(f"refused unread: {parcel.refused}")
        if not 0 <= parcel.sender < len(roles):
            raise RolloutError(f"from rank {parcel.sender}, which is not a rank of this run")
        member, sampler = roles[parcel.sender]
        if parcel.step < 1 or (sampler is None and parcel.step > cfg.train.steps):
            raise RolloutError(f"parcel of step {parcel.step}, outside 1..train.steps={cfg.train.steps}")
        rollouts = decode(parcel.buffer)
        claimed = self.schedule.wire_member(member)  # the member index the sender's rollouts carry
        if claimed != member:  # an open swarm's peer numbers itself 0 in its own config: renumbered as this one does
            if any(r.member != claimed for r in rollouts):
                raise RolloutError(f"a sequence claims member {next(r.member for r in rollouts if r.member != claimed)}"
                                   f", a peer's rollouts carry {claimed}")
            rollouts = [dataclasses.replace(r, member=member) for r in rollouts]
        if self.checker.is_foreign(member) and not cfg.members[self.receiver].accept_foreign:
            out.foreign_refused += len(rollouts)  # no fault: this member trains on its own tokenizer's text only
            return
        version = parcel.version
        if sampler is None and version != learner_version(parcel.step):
            raise RolloutError(f"policy version {version} declared for step {parcel.step} (a learner's rollouts of "
                               f"step t are version t - 1)")
        if any(r.policy_version != version for r in rollouts):
            raise RolloutError(f"a policy version differs from its parcel's ({version})")
        if sampler is not None:  # the versions an honest sampler can hold: its start, then its learner's pushes
            every, newest = self.schedule.sampler_versions(member, self.receiver, step)
            if version > newest or (every is not None and version % every and version != self.start_step):
                raise RolloutError(f"policy version {version}: a sampler holds the resumed step ({self.start_step}) "
                                   f"or a multiple of weight_sync_every={every} up to {newest}" if every is not None
                                   else f"policy version {version}: after the run's last step ({newest})")
        if any(r.made_at > now + FUTURE_TOLERANCE_S for r in rollouts):
            raise RolloutError(f"made more than {FUTURE_TOLERANCE_S:g} s in the future (a clock that far off would "
                               "defeat max_delay_s)")
        behind = staleness(step, version)
        age = max(0.0, now - min((r.made_at for r in rollouts), default=now))
        if behind > cfg.swarm.max_staleness or (cfg.swarm.max_delay_s is not None and age > cfg.swarm.max_delay_s):
            out.stale_dropped += len(rollouts)
            return
        self._seen = {key: v for key, v in self._seen.items() if staleness(step, v) <= cfg.swarm.max_staleness}
        if (parcel.sender, parcel.step) in self._seen:
            out.duplicate_dropped += len(rollouts)
            log.info("%s: dropped a second parcel of peer %s of its step %d (resumed from a checkpoint?)",
                     self.config.members[self.receiver].name, self.sender_name(parcel.sender), parcel.step)
            return
        self._seen[(parcel.sender, parcel.step)] = version
        dealt = (self.schedule.deal(parcel.step)[member] if sampler is None
                 else self.schedule.round_deal(parcel.sender, parcel.step))
        rollouts, unverified, unscored = self.checker.check(rollouts, member, dealt)
        out.rescore_timeouts += unverified
        out.unscored_dropped += unscored
        rollouts, lost = self.checker.adopt(rollouts, member)
        out.foreign_dropped += lost
        name, digest = f"{self.sender_name(parcel.sender)}@{parcel.step}", buffer_digest(parcel.buffer)
        by_prompt: dict[int, list[Rollout]] = {}
        for r in rollouts:
            by_prompt.setdefault(r.prompt_index, []).append(r)
        ratio = cfg.defense.max_length_ratio
        typical = statistics.median(self._own_lengths) if ratio is not None and self._own_lengths else None
        for group in by_prompt.values():
            if typical is not None and statistics.fmean(r.num_tokens for r in group) > ratio * typical:
                sender = self.sender_name(parcel.sender)
                out.length_dropped[sender] = out.length_dropped.get(sender, 0) + len(group)
                continue
            self.pool.append(Group(parcel.sender, version, group, self._order, name, digest))
            self._order += 1

    def _take(self, step: int, now: float, out: Received, own: int) -> None:
        cfg = self.config.swarm
        fresh = [g for g in self.pool if staleness(step, g.version) <= cfg.max_staleness
                 and (cfg.max_delay_s is None or now - g.made_at <= cfg.max_delay_s)]
        out.surplus_dropped += sum(g.size for g in self.pool) - sum(g.size for g in fresh)  # aged while waiting
        budget = self.budget
        chosen = fresh if budget is None else self._choose(fresh, budget)
        capped = self._cap_shares(chosen, own, out)
        fresh = [g for g in fresh if id(g) not in capped]  # left out for good, not waiting
        chosen = [g for g in chosen if id(g) not in capped]
        taken = {id(g) for g in chosen}
        # what is left waits only if it can still be used fresh at the next step, and at most max_staleness + 1
        # budgets of it (the freshest)
        rest = sorted((g for g in fresh if id(g) not in taken and staleness(step + 1, g.version) <= cfg.max_staleness),
                      key=lambda g: (-g.version, g.order))
        room, self.pool = (budget or 0) * (cfg.max_staleness + 1), []
        for g in rest:
            if g.size <= room:
                self.pool.append(g)
                room -= g.size
        out.surplus_dropped += sum(g.size for g in fresh) - sum(g.size for g in chosen) - sum(g.size for g in self.pool)
        out.waiting = sum(g.size for g in self.pool)
        for g in sorted(chosen, key=lambda g: (g.version, g.sender, g.order)):
            out.digests[g.parcel] = g.digest
            out.rollouts += g.rollouts
            out.staleness += [staleness(step, g.version)] * g.size
            out.age_seconds += [max(0.0, now - r.made_at) for r in g.rollouts]

    def _cap_shares(self, chosen: list[Group], own: int, out: Received) -> set[int]:
        """defense.max_peer_share: the ids of the groups left out so that no peer supplies more than that share
        of the update (own sequences, its own samplers' and the peers' chosen together). The sender furthest over its cap loses its
        stalest group (the last admitted of equals) first, until every sender is within it."""
        share = self.config.defense.max_peer_share
        capped: set[int] = set()
        if share is None:
            return capped
        roles = self.schedule.roles
        mine = {id(g) for g in chosen if roles[g.sender][0] == self.receiver}  # its own samplers' are its own
        while True:
            kept = [g for g in chosen if id(g) not in capped]
            total = own + sum(g.size for g in kept)
            by_sender: dict[int, list[Group]] = defaultdict(list)
            for g in kept:
                if id(g) not in mine:
                    by_sender[g.sender].append(g)
            over = {sender: sum(g.size for g in groups) - share * total for sender, groups in by_sender.items()}
            sender, excess = max(over.items(), key=lambda item: (item[1], -item[0]), default=(None, 0.0))
            if sender is None or excess <= 1e-9:
                return capped
            victim = min(by_sender[sender], key=lambda g: (g.version, -g.order))
            capped.add(id(victim))
            name = self.sender_name(sender)
            out.share_capped[name] = out.share_capped.get(name, 0) + victim.size

    def _choose(self, fresh: list[Group], budget: int) -> list[Group]:
        """At most `budget` sequences of whole groups: round-robin over the senders, each up to its share of a
        step, freshest first (each pass visits the senders by the freshness of their next group, so a budget that
        runs out mid-pass goes to the freshest, not to the lowest endpoint number); then the freshest of the
        rest."""
        shares = self.shares
        queues: dict[int, list[Group]] = defaultdict(list)
        for g in sorted(fresh, key=lambda g: (-g.version, g.order)):
            queues[g.sender].append(g)
        chosen: list[Group] = []
        total, per_sender = 0, defaultdict(int)
        added = True
        while added:
            added = False
            for sender in sorted((s for s in queues if queues[s]), key=lambda s: (-queues[s][0].version,
                                                                                   queues[s][0].order)):
                queue = queues[sender]
                if queue and per_sender[sender] + queue[0].size <= shares.get(sender, 0) \
                        and total + queue[0].size <= budget:
                    g = queue.pop(0)
                    chosen.append(g)
                    total += g.size
                    per_sender[sender] += g.size
                    added = True
        for g in sorted((g for q in queues.values() for g in q), key=lambda g: (-g.version, g.order)):
            if total + g.size <= budget:
                chosen.append(g)
                total += g.size
        return chosen
