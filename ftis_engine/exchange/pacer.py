"""The lead bound (swarm.max_lead = K), written once for both asynchronous worlds: one world's processes
(async_.DistributedAsync) and the open swarm (openswarm/member.py).

- **A learner** starts training its step t only when every live peer it trains on has published its step t - K or
  later (`hold`), and takes no parcel whose policy version is more than K ahead of its own (`newest_version`: at
  most t - 1 + K); a peer's claim of a published step counts only up to K + 1 past the member's own newest step
  (`credited`: a forged step of 10^9 would otherwise exempt that peer from the bound for good). K = 0 is
  lockstep; K = null: nobody waits.
- **A sampler** generates its round r only when its learner has taken (one world) or reached (open swarm) its round
  r - 1 - K (`hold_sampler`): at most K + 1 of its rounds are in flight.
- **Queues**: a mailbox or an outbox keeps at most max_staleness + K + 2 parcels a peer (`queue_capacity`: more
  could not all be used fresh).

One failure behaviour in both worlds: a wait lasts at most swarm.timeout_s. A peer that made a learner wait that
long is given up on (warned once) and not waited for, at this step or any later one, until it has caught up
(published the step the bound needs) or left: a live peer that never publishes costs one time-out, not one a step,
and cannot stall the others. A sampler whose learner has not come within reach after swarm.timeout_s samples on,
warned. What differs is the verdict on a peer given up on that then publishes nothing for a further timeout_s
(`stalled`): one world, whose membership is fixed, ends the run on it as hung (its process stuck while its links
still answer; a dead one is lost by its links sooner), as a hung peer always ended it there; an open swarm, which
anyone may join, goes on without it. Before 2026-11-28 one world ended the run with a TimeoutError at the first
time-out of either wait (issue 69).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable

from ..config import RunConfig
from ..topology.schedule import learner_version

log = logging.getLogger("ftis_engine.exchange")

# wait(ready, timeout_s, what) -> seconds waited, and whether ready() held: a transport's own way of waiting (Links
# wakes on every message; the open swarm polls its client's view); `what` says what is waited for
Wait = Callable[[Callable[[], bool], float, str], tuple[float, bool]]


def queue_capacity(config: RunConfig) -> int:
    """Parcels a mailbox keeps per sender (and an outbox per peer): a receiver can use a parcel fresh for
    max_staleness + 1 steps, and at most K + 1 more are ahead of it."""
    return config.swarm.max_staleness + (config.swarm.max_lead or 0) + 2


def warn_lead_beyond_staleness(config: RunConfig) -> None:
    """A lead bound wider than max_staleness lets a member get so far ahead that it drops its slowest peer's
    newest rollouts as stale: allowed (a delay study may want it), said once."""
    lead, staleness = config.swarm.max_lead, config.swarm.max_staleness
    if lead is not None and lead > staleness:
        log.warning("swarm.max_lead=%d > swarm.max_staleness=%d: a member that far ahead drops its slowest peer's "
                    "newest rollouts as stale", lead, staleness)


def poll(check: Callable[[], None] | None = None, every_s: float = 0.02) -> Wait:
    """A Wait that re-checks ready() every `every_s` seconds (and runs `check` first each time: a transport's
    failure raises there)."""
    def wait(ready: Callable[[], bool], timeout_s: float, what: str) -> tuple[float, bool]:
        start = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        while True:
            if check is not None:
                check()
            if ready():
                return time.perf_counter() - start, True
            if time.monotonic() >= deadline:
                return time.perf_counter() - start, False
            time.sleep(every_s)

    return wait


class Pacer:
    """One member's (or sampler's) side of the lead bound; `name` says whose in its warnings."""

    def __init__(self, config: RunConfig, name: str):
        self.max_lead = config.swarm.max_lead
        self.timeout_s = config.swarm.timeout_s
        self.name = name
        self.given_up: set[Hashable] = set()  # peers a wait gave up on: not waited for until they catch up
        self._since: dict[Hashable, tuple[float, int]] = {}  # a given-up peer -> (when, its step then)
        self._learner_late: tuple[float, int] | None = None  # a sampler's: (when it sampled on, the round it needed)

    def newest_version(self, step: int) -> int | None:
        """The newest policy version a parcel taken at `step` may carry (None: any)."""
        return None if self.max_lead is None else learner_version(step) + self.max_lead

    def credited(self, step: int, own_step: int) -> int:
        """What a peer's published `step` counts for in the bound: at most K + 1 past this member's newest step
        `own_step`, as far as a peer that waits for this member can be (a forged step of 10^9 would otherwise exempt
        the peer from the bound for good; capped so, a liar gains what an honest peer at the edge has, and only
        while it keeps sending). Capped, not dropped: a peer that gave up on this member (a late peer is given up
        on, below) runs further ahead, honestly, and must not look behind."""
        return step if self.max_lead is None else min(step, own_step + self.max_lead + 1)

    @staticmethod
    def lead(step: int, published: dict) -> int | None:
        """How far this member at `step` is ahead of its slowest live peer (None: no peer to count)."""
        return step - min(published.values()) if published else None

    def hold(self, step: int, published: Callable[[], dict], wait: Wait, peers: str = "peer(s)") -> float:
        """Before the learner's `step`: wait until every live peer in published() (peer -> the newest step it has
        published; those gone or done left out) has published step - K; returns the seconds waited. A peer that
        makes it wait swarm.timeout_s is given up on (warned) until it catches up."""
        if self.max_lead is None:
            return 0.0
        need = step - self.max_lead
        now = published()
        for peer in sorted(self.given_up, key=str):
            if peer not in now or now[peer] >= need:
                self.given_up.discard(peer)
                self._since.pop(peer, None)
                if peer in now:
                    log.info("%s: peer %s has caught up; the lead bound waits for it again", self.name, peer)

        def behind() -> list:
            return sorted((p for p, s in published().items() if s < need and p not in self.given_up), key=str)

        late = behind()
        if not late:
            return 0.0
        waited, ready = wait(lambda: not behind(), self.timeout_s,
                             f"{peers} {', '.join(map(str, late))} to publish step {need} (swarm.max_lead="
                             f"{self.max_lead}, this member's step {step})")
        late = behind() if not ready else []
        if late:  # (it may have published since the wait ended)
            log.warning("%s: live %s %s have not published step %d within swarm.timeout_s=%g s (swarm.max_lead=%d, "
                        "its step %d); going on without waiting for them until they catch up", self.name, peers,
                        ", ".join(map(str, late)), need, self.timeout_s, self.max_lead, step)
            self.given_up.update(late)
            now = published()
            self._since.update({peer: (time.monotonic(), now.get(peer, need)) for peer in late})
        return waited

    def stalled(self, published: dict) -> list:
        """Peers given up on that have published nothing new for a further swarm.timeout_s (2 x timeout_s without
        a step): hung, not slow. One world's membership is fixed, so it ends the run on them (async_); an open
        swarm, which anyone may join, goes on without them."""
        now = time.monotonic()
        return sorted((peer for peer, (since, step) in self._since.items()
                       if peer in self.given_up and published.get(peer, step) <= step
                       and now - since >= self.timeout_s), key=str)

    def hold_sampler(self, round_: int, reached: Callable[[int], bool], wait: Wait, learner: str = "its learner"
                     ) -> float:
        """Before a sampler's `round_`: wait until reached(round_ - 1 - K) (its learner has taken or reached that
        round, or finished); returns the seconds waited. After swarm.timeout_s it samples on, warned."""
        if self.max_lead is None:
            return 0.0
        need = round_ - 1 - self.max_lead
        waited, ready = wait(lambda: reached(need), self.timeout_s,
                             f"{learner} to take round {need} (swarm.max_lead={self.max_lead})")
        if not ready:
            log.warning("%s: its learner has not reached round %d within swarm.timeout_s=%g s (swarm.max_lead=%d); "
                        "sampling on", self.name, need, self.timeout_s, self.max_lead)
            if self._learner_late is None:
                self._learner_late = (time.monotonic(), need)
        else:
            self._learner_late = None
        return waited

    def learner_stalled(self, reached: Callable[[int], bool]) -> bool:
        """A sampler's learner that has not reached the round it sampled on without for a further swarm.timeout_s
        (2 x timeout_s without it): hung (one world ends the run on it, as on a stalled peer)."""
        late = self._learner_late
        return late is not None and not reached(late[1]) and time.monotonic() - late[0] >= self.timeout_s
