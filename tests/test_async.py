"""swarm.mode async (the HeteroRL setting): delays, staleness bounds, the receiver's checks, resume; one process
here, several processes over gloo in test_async_swarm.py."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch

from ftis_engine.async_exchange import Latency, LocalAsyncExchange, Mailbox, Parcel
from ftis_engine.config import ConfigError, LatencySettings
from ftis_engine.rollouts import Rollout, encode
from ftis_engine.run import receive_parcels, train
from ftis_engine.session import open_run

from .helpers import short_config


def _run(tmp_path, name: str, *overrides: str, resume: bool = False) -> list[dict]:
    config = short_config("eval.at_start=false", "eval.every=0", *overrides)
    swarm, start = open_run(config, tmp_path / name, resume=resume)
    train(swarm, start)
    return [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def _train(records: list[dict], member: str | None = None) -> list[dict]:
    return [r for r in records if r["kind"] == "train" and member in (None, r["member"])]


# ----------------------------------------------------------------------------------------------- config, latency


def test_latency_is_fixed_or_drawn_reproducibly_within_its_range():
    assert Latency(LatencySettings.model_validate(3), seed=0).delay(0, 1, 5) == 3.0
    drawn = Latency(LatencySettings(unit="steps", min=1, max=4), seed=7)
    values = [drawn.delay(0, 1, step) for step in range(200)]
    assert set(values) == {1.0, 2.0, 3.0, 4.0}  # whole steps, every one of them
    assert values == [Latency(LatencySettings(unit="steps", min=1, max=4), seed=7).delay(0, 1, s) for s in range(200)]
    seconds = Latency(LatencySettings(unit="seconds", min=0.5, max=1.5), seed=0)
    assert all(0.5 <= seconds.delay(1, 0, s) <= 1.5 for s in range(50))


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


def test_a_mailbox_releases_a_parcel_at_its_due_step_and_time():
    box = Mailbox()
    now = time.time()
    box.put(Parcel(1, 1, torch.zeros(1), due_step=3))
    box.put(Parcel(1, 2, torch.zeros(1), due_time=now + 60))
    box.put(Parcel(1, 3, torch.zeros(1)))
    assert [p.step for p in box.take_due(2, now)] == [3]
    assert [p.step for p in box.take_due(3, now)] == [1]
    assert box.take_due(10, now + 59) == [] and len(box) == 1
    assert [p.step for p in box.take_due(10, now + 60)] == [2]


def test_the_local_exchange_delivers_to_every_peer_after_the_delay():
    exchange = LocalAsyncExchange([0, 1, 2], Latency(LatencySettings.model_validate(2), seed=0))
    sent = exchange.publish({0: torch.ones(5, dtype=torch.int32)}, step=1)
    assert sent == {0: 20}
    assert exchange.collect(1, 2) == [] and exchange.in_flight(1) == 1 and exchange.in_flight(0) == 0
    assert [(p.sender, p.step) for p in exchange.collect(1, 3)] == [(0, 1)]
    assert [(p.sender, p.step) for p in exchange.collect(2, 9)] == [(0, 1)]


# ----------------------------------------------------------------------------------------------- training


def test_async_without_delay_trains_exactly_like_sync(tmp_path):
    sync = _train(_run(tmp_path, "sync", "train.steps=2", "checkpoint.every=0"))
    asyn = _train(_run(tmp_path, "async", "train.steps=2", "checkpoint.every=0", "swarm.mode=async"))
    assert len(sync) == len(asyn) == 4
    for a, b in zip(sync, asyn):
        assert (a["step"], a["member"], a["sequences"], a["rollouts_sha256"]) == (
            b["step"], b["member"], b["sequences"], b["rollouts_sha256"])
        assert a["loss"] == b["loss"] and a["kl_mean"] == b["kl_mean"]
        assert b["staleness_max"] == 0 and b["stale_dropped"] == 0 and b["exchange_wait_seconds"] < 0.05


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


def test_rollouts_older_than_max_staleness_or_max_delay_are_dropped_and_counted(tmp_path):
    records = _train(_run(tmp_path, "stale", "train.steps=5", "checkpoint.every=0", "swarm.mode=async",
                          "swarm.latency.min=0", "swarm.latency.max=2", "swarm.max_staleness=1"))
    latency = Latency(LatencySettings(unit="steps", min=0, max=2), seed=0)  # the run's draws (run seed 0)
    names = ["tiny-s", "tiny-m-lora"]
    own = {(names.index(r["member"]), r["step"]): r["own_sequences"] for r in records}
    for r in records:
        receiver = names.index(r["member"])
        sender = 1 - receiver
        arriving = [(t, latency.delay(sender, receiver, t)) for t in range(1, r["step"] + 1)
                    if t + latency.delay(sender, receiver, t) == r["step"]]
        assert r["stale_dropped"] == sum(own[(sender, t)] for t, d in arriving if d > 1)
        assert r["peer_sequences"] == sum(own[(sender, t)] for t, d in arriving if d <= 1)
    assert sum(r["stale_dropped"] for r in records) > 0 and sum(r["peer_sequences"] for r in records) > 0
    records = _train(_run(tmp_path, "old", "train.steps=1", "checkpoint.every=0", "swarm.mode=async",
                          "swarm.max_delay_s=1e-6"))
    assert all(r["peer_sequences"] == 0 and r["stale_dropped"] == 8 for r in records)


def test_delays_that_would_drop_everything_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"^swarm.latency: every delivery is at least 3 steps late"):
        short_config("swarm.mode=async", "swarm.latency=3", "swarm.max_staleness=2")
    with pytest.raises(ConfigError, match=r"^swarm.latency: every delivery is at least 2 s late"):
        short_config("swarm.mode=async", "swarm.latency.unit=seconds", "swarm.latency.min=2", "swarm.latency.max=3",
                     "swarm.max_delay_s=1")


def test_every_parcel_is_checked_against_the_deal_of_the_step_it_claims(tmp_path):
    swarm, _ = open_run(short_config("swarm.mode=async"), tmp_path / "run")
    from ftis_engine.run import deal_step, generate_rollouts

    peer = swarm.members[1]
    honest = generate_rollouts(swarm, peer, 3, deal_step(swarm, 3)[1])
    now = time.time()
    ok = receive_parcels(swarm, 0, 4, [Parcel(1, 3, encode(honest))])
    assert len(ok.rollouts) == len(honest) and ok.rejected == [] and ok.staleness == [1] * len(honest)
    bad = receive_parcels(swarm, 0, 4, [
        Parcel(1, 2, encode(honest)),  # claims another step: its versions disagree
        Parcel(1, 99, encode(honest)),  # a step the run never has
        Parcel(1, 3, encode(honest)),  # step 3 again: a replay
        Parcel(1, 4, torch.zeros(0, dtype=torch.int32)),  # refused by the transport (oversized)
    ])
    assert bad.rollouts == [] and [s for s, _ in bad.rejected] == [1, 1, 1, 1]
    reasons = [reason for _, reason in bad.rejected]
    assert "differs from its parcel's step" in reasons[0] and "outside 1..train.steps" in reasons[1]
    assert "a replay" in reasons[2] and "empty buffer" in reasons[3]
    swarm.checkers[0].seen.clear()
    missing = receive_parcels(swarm, 0, 4, [Parcel(1, 3, encode(honest[1:]))])  # a dealt completion is missing
    assert missing.rollouts == [] and "completions of prompt" in missing.rejected[0][1]
    future = [Rollout(**{**vars(r), "made_at": now + 3600}) for r in honest]
    swarm.checkers[0].seen.clear()
    ahead = receive_parcels(swarm, 0, 4, [Parcel(1, 3, encode(future))])
    assert ahead.rollouts == [] and "in the future" in ahead.rejected[0][1]
    swarm.close()


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
