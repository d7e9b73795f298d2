"""swarm.mode async (the HeteroRL setting) in one process: delays, staleness bounds, the intake budget, resume;
several processes over gloo in test_async_swarm.py, the transports alone in test_exchange.py."""

from __future__ import annotations

import shutil

import pytest

from ftis_engine.config import ConfigError, LatencySettings
from ftis_engine.exchange.async_ import Latency
from ftis_engine.run.loop import train
from ftis_engine.run.session import Start, open_run

from .helpers import run_records, short_config


def _run(tmp_path, name: str, *overrides: str, resume: bool = False) -> list[dict]:
    config = short_config("eval.at_start=false", "eval.every=0", *overrides)
    swarm, start = open_run(config, Start(tmp_path / name, resume=resume))
    train(swarm, start)
    return run_records(tmp_path / name)


def _train(records: list[dict], member: str | None = None) -> list[dict]:
    return [r for r in records if r["kind"] == "train" and member in (None, r["member"])]


# ----------------------------------------------------------------------------------------------- config, latency


@pytest.mark.parametrize("override, field", [
    ("swarm.latency=2", "swarm.latency"),  # a delay needs async mode
    ("swarm.latency.max=-1", "swarm.latency.max"),
    ("swarm.latency.unit=steps", None),
])
def test_latency_config_errors_name_the_field(override, field):
    if field is None:
        short_config(override)  # no delay: fine in sync mode
        return
    with pytest.raises(ConfigError, match=f"^{field}"):
        short_config(override)


def test_async_mode_refuses_horizontal_collaboration_and_fractional_step_delays():
    with pytest.raises(ConfigError, match="async needs collaboration vertical"):
        short_config("swarm.mode=async", "collaboration=horizontal")
    with pytest.raises(ConfigError, match="^swarm.latency: .*whole numbers"):
        short_config("swarm.mode=async", "swarm.latency.max=1.5")


def test_async_without_delay_trains_exactly_like_sync(tmp_path):
    sync = _train(_run(tmp_path, "sync", "train.steps=2", "checkpoint.every=0"))
    asyn = _train(_run(tmp_path, "async", "train.steps=2", "checkpoint.every=0", "swarm.mode=async"))
    assert len(sync) == len(asyn) == 4
    for a, b in zip(sync, asyn):
        assert (a["step"], a["member"], a["sequences"], a["rollouts_sha256"]) == (
            b["step"], b["member"], b["sequences"], b["rollouts_sha256"])
        assert a["loss"] == b["loss"] and a["kl_mean"] == b["kl_mean"]
        # every peer parcel was due the step it was made: none left in flight (no wait timed: in process, nothing blocks)
        assert b["staleness_max"] == 0 and b["stale_dropped"] == 0 and b["in_flight"] == 0


def test_a_delay_of_d_steps_trains_on_the_peer_rollouts_made_d_steps_before(tmp_path):
    records = _train(_run(tmp_path, "lat", "train.steps=4", "checkpoint.every=0", "swarm.mode=async",
                          "swarm.latency=2"))
    made = {(r["member"], r["step"]): r["rollouts_sha256"] for r in records}
    for r in records:
        if r["step"] <= 2:  # nothing has arrived yet: own rollouts only
            assert r["peer_sequences"] == 0 and r["sequences"] == r["own_sequences"] and r["staleness_max"] is None
            assert r["in_flight"] == r["step"]
        else:  # the peer's parcel of step - 2, bit-exact, 2 versions old
            assert r["staleness_min"] == r["staleness_max"] == r["staleness_mean"] == 2
            (key, digest), = r["received_sha256"].items()
            peer, step = key.split("@")
            assert int(step) == r["step"] - 2 and digest == made[(peer, int(step))]
            assert r["peer_sequences"] == r["sequences"] - r["own_sequences"] > 0


def test_rollouts_older_than_max_staleness_are_dropped_and_a_second_fresh_one_is_surplus(tmp_path):
    records = _train(_run(tmp_path, "stale", "seed=7", "train.steps=8", "checkpoint.every=0", "swarm.mode=async",
                          "swarm.latency.min=0", "swarm.latency.max=2", "swarm.max_staleness=1",
                          "swarm.max_lead=1"))
    latency = Latency(LatencySettings(unit="steps", min=0, max=2), seed=7)  # the run's draws (run seed 7)
    names = ["tiny-s", "tiny-m-lora"]
    own = {(names.index(r["member"]), r["step"]): r["own_sequences"] for r in records}
    for r in records:
        receiver = names.index(r["member"])
        sender = 1 - receiver
        # the peer's parcels of steps t arriving now (t + delay == step) are delay versions old
        arriving = {t: latency.delay(sender, receiver, t) for t in range(1, r["step"] + 1)
                    if t + latency.delay(sender, receiver, t) == r["step"]}
        fresh = [t for t, d in arriving.items() if d <= 1]
        assert r["stale_dropped"] == sum(own[(sender, t)] for t, d in arriving.items() if d > 1)
        # the budget is one step of the peer: the freshest is taken; the other could not wait (it would be
        # 2 versions old at the next step), so it is surplus
        assert r["peer_sequences"] == (own[(sender, max(fresh))] if fresh else 0)
        assert r["surplus_dropped"] == sum(own[(sender, t)] for t in fresh if t != max(fresh))
        assert r["staleness_max"] is None or r["staleness_max"] == r["step"] - max(fresh)
    assert sum(r["stale_dropped"] for r in records) > 0 and sum(r["surplus_dropped"] for r in records) > 0
    records = _train(_run(tmp_path, "old", "train.steps=1", "checkpoint.every=0", "swarm.mode=async",
                          "swarm.max_delay_s=1e-6"))
    assert all(r["peer_sequences"] == 0 and r["stale_dropped"] == 8 for r in records)


def test_delays_that_would_drop_everything_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"^swarm.latency: every delivery is at least 3 steps late"):
        short_config("swarm.mode=async", "swarm.latency=3", "swarm.max_staleness=2")
    with pytest.raises(ConfigError, match=r"^swarm.latency: every delivery is at least 2 s late"):
        short_config("swarm.mode=async", "swarm.latency.unit=seconds", "swarm.latency.min=2", "swarm.latency.max=3",
                     "swarm.max_delay_s=1")


def test_resume_logs_the_rollouts_lost_after_the_checkpoint_and_continues_with_no_gap(tmp_path):
    first = _run(tmp_path, "run", "train.steps=4", "checkpoint.every=2", "checkpoint.keep_last=3",
                 "swarm.mode=async", "swarm.latency=1")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step-4")  # as if killed between steps 2 and 4
    again = _run(tmp_path, "run", "train.steps=4", "checkpoint.every=2", "checkpoint.keep_last=3",
                 "swarm.mode=async", "swarm.latency=1", resume=True)
    lost = [r for r in again if r["kind"] == "resume"]
    assert {r["member"]: (r["step"], r["lost_steps"]) for r in lost} == {"tiny-s": (2, 2), "tiny-m-lora": (2, 2)}
    generated = {m: sum(r["own_sequences"] for r in _train(first, m) if r["step"] > 2) for m in ("tiny-s", "tiny-m-lora")}
    assert {r["member"]: r["lost_rollouts"] for r in lost} == generated
    for member in ("tiny-s", "tiny-m-lora"):
        assert [r["step"] for r in _train(again, member)] == [1, 2, 3, 4]
    # in-flight rollouts are not restored: after the resume, step 3 has nothing from the peer yet
    assert all(r["peer_sequences"] == 0 for r in _train(again) if r["step"] == 3)


def test_a_member_that_never_saw_a_peer_rollout_is_warned_about(tmp_path, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="ftis_engine"):
        records = _train(_run(tmp_path, "far", "train.steps=2", "checkpoint.every=0", "swarm.mode=async",
                              "swarm.latency.unit=seconds", "swarm.latency.min=1000", "swarm.latency.max=1000"))
    assert all(r["peer_sequences"] == 0 for r in records)
    warned = [m for m in caplog.messages if "trained on no peer rollout" in m]
    assert len(warned) == 2 and "swarm.latency (1000-1000 s) is longer than the run?" in warned[0]


def test_a_forged_step_cannot_exempt_a_peer_from_the_lead_bound():
    """What a learner peer's DATA header claims advances the step it has published (what swarm.max_lead waits on)
    only for a message received whole, of a step inside the run, and counts for at most max_lead + 1 past this
    member's newest step (capped since the lead bound gives up on late peers: a peer that gave up on this member may
    be further ahead, honestly): a forged step of 10^9 (or a refused parcel) no longer exempts that peer from the
    bound for good."""
    import torch

    from ftis_engine.exchange.async_ import DATA, DistributedAsync, Mailbox

    class Immediate:
        def schedule(self, parcel, rank, from_step):
            return parcel

    exchange = object.__new__(DistributedAsync)
    exchange.rank, exchange.steps, exchange.pacer = 0, 100, _pacer(2)
    exchange.mailbox, exchange.latency, exchange._published = Mailbox(4), Immediate(), {1: 0}
    exchange.mailbox.step = 5
    body = torch.zeros(1, dtype=torch.int32)
    for step, refused, published in [(10**9, None, 0), (101, None, 0), (0, None, 0), (7, "too large", 0),
                                     (9, None, 8), (8, None, 8), (6, None, 8)]:  # 9 counts at the edge: 5 + 2 + 1
        exchange.deliver(1, DATA, step, step - 1, body, refused)
        assert exchange._published[1] == published, (step, refused)
    exchange.pacer = _pacer(None)  # no bound to wait on: a claim inside the run still counts (the lead metrics)
    exchange.deliver(1, DATA, 50, 49, body, None)
    assert exchange._published[1] == 50


class _FakeLinks:
    """Links without processes: peers publish when the test says, and a wait advances a fake clock until ready."""

    def __init__(self, exchange, arrivals: dict[float, tuple[int, int]]):
        self.exchange, self.arrivals, self.clock, self.waits = exchange, dict(arrivals), 0.0, []
        self.outboxes = {}
        self.totals = (0, 0)  # messages refused and reconnections so far, as Links.counts() gives them

    def counts(self):
        return self.totals

    def peer_done(self, peer):
        return False

    def check(self):
        pass

    def post_slot(self, *args):
        pass

    def wait(self, ready, timeout_s, what):
        start = self.clock
        while not ready():
            due = min(t for t in self.arrivals if t > self.clock)  # the next publication on the fake clock
            self.clock = due
            peer, step = self.arrivals.pop(due)
            self.exchange._published[peer] = max(self.exchange._published[peer], step)
        self.waits.append((what, self.clock - start))
        return self.clock - start + 1e-6, True


def _pacer(max_lead):
    """The lead bound of a stand-in config (exchange/pacer.py reads swarm.max_lead and swarm.timeout_s)."""
    from types import SimpleNamespace

    from ftis_engine.exchange.pacer import Pacer

    return Pacer(SimpleNamespace(swarm=SimpleNamespace(max_lead=max_lead, timeout_s=60.0)), "tiny-s")


def _bare_exchange(max_lead, published: dict[int, int], arrivals: dict[float, tuple[int, int]]):
    """Rank 0's DistributedAsync with one learner peer (rank 1) and fake links, no processes: what receive() reads."""
    from ftis_engine.exchange.async_ import DistributedAsync, Mailbox

    exchange = object.__new__(DistributedAsync)
    exchange.rank, exchange.lead_peers, exchange.pacer, exchange.timeout_s = 0, [1], _pacer(max_lead), 60.0
    exchange.mailbox, exchange._published, exchange._taken, exchange._outbox_dropped = Mailbox(4), dict(published), {}, 0
    exchange._link_counts = (0, 0)
    exchange.links = _FakeLinks(exchange, arrivals)
    return exchange


@pytest.mark.parametrize("max_lead, published, waits", [
    (None, {1: 0}, False),  # never waits
    (2, {1: 3}, False),  # step 5 needs the peer at step 3: it is
    (2, {1: 2}, True),  # it is not: wait until it publishes step 3
])
def test_the_lead_bound_waits_exactly_when_the_slowest_live_peer_is_more_than_max_lead_behind(max_lead, published,
                                                                                            waits):
    """The policy of DistributedAsync.receive on a fake clock and fake links: a member at step t waits (and only
    then) while a live peer has published less than t - max_lead; the lead and the wait it reports agree."""
    exchange = _bare_exchange(max_lead, published, {7.5: (1, 3)})  # the peer publishes its step 3 at 7.5 s
    arrivals = exchange.receive(0, 5)
    assert arrivals.lead_steps == 5 - published[1]
    assert (arrivals.lead_wait_seconds > 0) == waits == bool(exchange.links.waits)
    if waits:
        assert exchange.links.waits[0][1] == 7.5 and exchange._published[1] == 3
        assert "publish step 3 (swarm.max_lead=2, this member's step 5)" in exchange.links.waits[0][0]


def test_a_receive_reports_the_messages_refused_and_the_reconnections_since_the_last_one():
    """link_refused and link_reconnects in a train record are the links' totals less those at the last receive."""
    exchange = _bare_exchange(None, {1: 0}, {})
    seen = []
    for totals in [(0, 0), (3, 1), (3, 1), (5, 4)]:
        exchange.links.totals = totals
        arrivals = exchange.receive(0, 1)
        seen.append((arrivals.link_refused, arrivals.link_reconnects))
    assert seen == [(0, 0), (3, 1), (0, 0), (2, 3)]
