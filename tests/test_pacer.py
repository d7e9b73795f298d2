"""The lead bound, written once (exchange/pacer.py): what a learner and a sampler wait for, and the one failure
behaviour of both worlds (a late peer is given up on, warned, until it catches up; a sampler samples on)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from ftis_engine.exchange.pacer import Pacer, poll, queue_capacity


def _pacer(max_lead, timeout_s=5.0) -> Pacer:
    return Pacer(SimpleNamespace(swarm=SimpleNamespace(max_lead=max_lead, timeout_s=timeout_s, max_staleness=3)),
                 "tiny-s")


class Clock:
    """A Wait on a fake clock: each wait advances to the next publication the test scheduled, up to timeout_s."""

    def __init__(self, published: dict, arrivals: dict[float, tuple[str, int]]):
        self.now, self.published, self.arrivals, self.waits = 0.0, published, dict(arrivals), []

    def wait(self, ready, timeout_s, what):
        start, deadline = self.now, self.now + timeout_s
        while not ready():
            due = [t for t in self.arrivals if self.now < t <= deadline]
            if not due:
                self.now = deadline
                self.waits.append(what)
                return self.now - start, False
            self.now = min(due)
            peer, step = self.arrivals.pop(self.now)
            self.published[peer] = step
        self.waits.append(what)
        return self.now - start, True


class TimedOutLinks:
    """Links whose every wait runs out its time-out (on `clock`, when given: a dict whose "now" it advances)."""

    outboxes = {}

    def __init__(self, clock: dict | None = None):
        self.clock = clock

    def peer_done(self, peer):
        return False

    def check(self):
        """Nothing failed."""

    def counts(self):
        return (0, 0)

    def wait(self, ready, timeout_s, what):
        if self.clock is not None:
            self.clock["now"] += timeout_s
        return timeout_s, ready()


def _learner(pacer: Pacer, links):
    """Rank 0's DistributedAsync with one learner peer (rank 1) and stand-in links, no processes."""
    from ftis_engine.exchange.async_ import DistributedAsync, Mailbox

    exchange = object.__new__(DistributedAsync)
    exchange.rank, exchange.lead_peers, exchange.pacer, exchange.timeout_s = 0, [1], pacer, pacer.timeout_s
    exchange.mailbox, exchange._published, exchange._taken, exchange._outbox_dropped = Mailbox(4), {1: 0}, {}, 0
    exchange._link_counts, exchange.links = (0, 0), links
    return exchange


def test_the_bound_in_numbers():
    pacer = _pacer(2)
    assert pacer.newest_version(5) == 4 + 2 and _pacer(None).newest_version(5) is None
    assert (pacer.credited(8, 5), pacer.credited(9, 5), pacer.credited(10**9, 5)) == (8, 8, 8)  # the edge: 5 + 2 + 1
    assert _pacer(None).credited(10**9, 5) == 10**9
    assert Pacer.lead(5, {"a": 2, "b": 4}) == 3 and Pacer.lead(5, {}) is None
    assert queue_capacity(SimpleNamespace(swarm=SimpleNamespace(max_staleness=3, max_lead=2))) == 3 + 2 + 2
    assert queue_capacity(SimpleNamespace(swarm=SimpleNamespace(max_staleness=3, max_lead=None))) == 3 + 0 + 2


def test_a_learner_waits_exactly_until_every_live_peer_is_within_the_bound():
    published = {"a": 2, "b": 3}
    clock = Clock(published, {4.0: ("a", 3)})
    assert _pacer(2).hold(5, lambda: dict(published), clock.wait) == 4.0  # a publishes step 3 at 4 s
    assert clock.waits == ["peer(s) a to publish step 3 (swarm.max_lead=2, this member's step 5)"]
    assert _pacer(2).hold(5, lambda: dict(published), clock.wait) == 0.0 and len(clock.waits) == 1  # no wait
    assert _pacer(None).hold(50, lambda: dict(published), clock.wait) == 0.0  # no bound: nobody waits


def test_a_peer_late_by_the_timeout_is_given_up_on_warned_once_until_it_catches_up(caplog):
    """The one failure behaviour of both worlds: no TimeoutError ending the run; a live peer that never publishes
    costs one time-out, not one a step, and is waited for again once it has caught up."""
    published = {"slow": 0, "fast": 9}
    clock = Clock(published, {})
    pacer = _pacer(1, timeout_s=5.0)
    with caplog.at_level(logging.WARNING, logger="ftis_engine.exchange"):
        assert pacer.hold(3, lambda: dict(published), clock.wait) == 5.0
    assert pacer.given_up == {"slow"} and "live peer(s) slow have not published step 2" in caplog.text
    assert pacer.hold(4, lambda: dict(published), clock.wait) == 0.0 and len(clock.waits) == 1  # not again
    published["slow"] = 4  # it caught up with step 5's need (4): waited for again from here on
    assert pacer.hold(5, lambda: dict(published), clock.wait) == 0.0 and pacer.given_up == set()
    clock.arrivals = {clock.now + 2.0: ("slow", 5)}
    assert pacer.hold(6, lambda: dict(published), clock.wait) == 2.0 and pacer.given_up == set()


def test_a_peer_that_left_is_forgotten_by_the_bound():
    published = {"gone": 0}
    pacer = _pacer(0, timeout_s=1.0)
    clock = Clock(published, {})
    pacer.hold(2, lambda: dict(published), clock.wait)
    assert pacer.given_up == {"gone"}
    del published["gone"]  # it left (or its lease ran out): nothing to wait for, nothing kept
    assert pacer.hold(3, lambda: dict(published), clock.wait) == 0.0 and pacer.given_up == set()


def test_a_sampler_waits_for_its_learner_then_samples_on_warned(caplog):
    taken = {"round": 0}
    clock = Clock(taken, {3.0: ("round", 2)})
    pacer = _pacer(1, timeout_s=10.0)
    assert pacer.hold_sampler(4, lambda need: taken["round"] >= need, clock.wait) == 3.0  # needs round 2
    assert clock.waits == ["its learner to take round 2 (swarm.max_lead=1)"]
    with caplog.at_level(logging.WARNING, logger="ftis_engine.exchange"):
        assert pacer.hold_sampler(9, lambda need: taken["round"] >= need, clock.wait) == 10.0
    assert "has not reached round 7 within swarm.timeout_s=10 s (swarm.max_lead=1); sampling on" in caplog.text
    assert _pacer(None).hold_sampler(9, lambda need: False, clock.wait) == 0.0


def test_poll_checks_the_transport_each_turn_and_reports_a_time_out():
    seen = []
    wait = poll(check=lambda: seen.append(1), every_s=0.001)
    waited, held = wait(lambda: len(seen) >= 3, 5.0, "three checks")
    assert held and len(seen) == 3 and waited < 5.0
    assert wait(lambda: False, 0.01, "never")[1] is False

    def failing():
        raise ConnectionError("the coordinator is gone")

    with pytest.raises(ConnectionError):
        poll(check=failing)(lambda: True, 1.0, "anything")


def test_one_worlds_learner_goes_on_past_a_late_peer_where_it_ended_the_run():
    """DistributedAsync.receive on stand-in links whose wait times out: the step goes on (the peer given up on),
    as the open swarm's does; before 2026-11-28 one world raised TimeoutError here and the run ended."""
    exchange = _learner(_pacer(1, timeout_s=7.0), TimedOutLinks())
    arrivals = exchange.receive(0, 5)
    assert arrivals.lead_wait_seconds == 7.0 and arrivals.lead_steps == 5 and exchange.pacer.given_up == {1}
    assert exchange.receive(0, 6).lead_wait_seconds == 0.0  # given up on: not waited for again


def test_a_peer_far_ahead_counts_at_the_edge_of_the_bound_and_is_never_waited_for():
    """A fast member that gave up on a slow one runs more than K + 1 steps ahead of it, honestly: its published steps
    count at the edge of the bound (capped, as a forger's are), so the slow member never waits for a peer that is
    ahead of it (dropping such claims left the peer's step where it was, and the slow member waited swarm.timeout_s
    for it, then gave up on it for good)."""
    from ftis_engine.exchange.async_ import DATA, DistributedAsync, Mailbox

    class Immediate:
        def schedule(self, parcel, rank, from_step):
            return parcel

    class Links:
        def peer_done(self, peer):
            return False

        def wait(self, ready, timeout_s, what):
            raise AssertionError(f"waited for {what}")

    exchange = object.__new__(DistributedAsync)
    exchange.rank, exchange.steps, exchange.pacer, exchange.lead_peers = 0, 100, _pacer(2), [1]
    exchange.mailbox, exchange.latency, exchange._published, exchange.links = Mailbox(64), Immediate(), {1: 0}, Links()
    exchange.mailbox.step = 5
    import torch

    for step in range(1, 30):  # the fast peer is at step 29; this member at 5
        exchange.deliver(1, DATA, step, step - 1, torch.zeros(1, dtype=torch.int32), None)
    assert exchange._published[1] == 5 + 2 + 1
    for step in range(6, 12):  # this member goes on: the peer, ahead, counts as at its edge, never behind
        exchange.mailbox.step = step - 1
        exchange.deliver(1, DATA, 29, 28, torch.zeros(1, dtype=torch.int32), None)  # it keeps sending
        assert exchange.pacer.hold(step, lambda: dict(exchange._published), exchange.links.wait) == 0.0


def test_a_peer_given_up_on_that_then_publishes_nothing_for_another_timeout_is_stalled(monkeypatch):
    """Slow is not hung: a peer given up on that publishes a step afterwards is not stalled; one that publishes
    nothing for a further swarm.timeout_s is (one world ends the run on it; an open swarm goes on without it)."""
    from ftis_engine.exchange import pacer as pacer_module

    clock = {"now": 100.0}
    monkeypatch.setattr(pacer_module.time, "monotonic", lambda: clock["now"])
    published = {"slow": 0, "hung": 0}
    pacer = _pacer(0, timeout_s=5.0)
    pacer.hold(2, lambda: dict(published), lambda ready, timeout_s, what: (timeout_s, False))
    assert pacer.given_up == {"slow", "hung"} and pacer.stalled(published) == []  # not yet a further timeout_s
    clock["now"] += 4.9
    published["slow"] = 1  # a step since: slow, not hung
    assert pacer.stalled(published) == []
    clock["now"] += 0.2
    assert pacer.stalled(published) == ["hung"]


def test_one_world_ends_the_run_on_a_hung_peer_and_a_sampler_on_a_hung_learner(monkeypatch):
    """DistributedAsync: a peer given up on a time-out ago with no step since is a TimeoutError (the exit table's
    lost peer), as a hung peer always ended one world; its sampler likewise on a learner that takes no round."""
    from ftis_engine.exchange import pacer as pacer_module
    from ftis_engine.exchange.async_ import DistributedAsync

    clock = {"now": 0.0}
    monkeypatch.setattr(pacer_module.time, "monotonic", lambda: clock["now"])
    exchange = _learner(_pacer(0, timeout_s=5.0), TimedOutLinks(clock))
    exchange.receive(0, 2)  # waits 5 s, gives the peer up
    exchange.receive(0, 3)  # not waited for: no time passes
    clock["now"] += 5.0
    with pytest.raises(TimeoutError, match=r"^swarm.timeout_s: peer rank\(s\) 1 published no step for 10 s"):
        exchange.receive(0, 4)
    sampler = object.__new__(DistributedAsync)
    sampler.pacer, sampler.taken, sampler.learner, sampler.links = _pacer(0, timeout_s=5.0), 0, 0, TimedOutLinks(clock)
    sampler.wait_taken(3)  # needs round 2: samples on after 5 s
    with pytest.raises(TimeoutError, match=r"its learner \(rank 0\) took no round for 10 s"):
        sampler.wait_taken(4)
