"""The transports in one process: who receives which parcel, when a delayed or lead-bound parcel is due, and the
bounded queues (a mailbox per sender, an outbox per peer, a sampler's weight slot), and a failed collective named a
lost peer. Across processes: test_swarm.py (sync) and test_async_swarm.py (async)."""

from __future__ import annotations

import time

import pytest
import torch

from ftis_engine.config import LatencySettings
from ftis_engine.exchange import Parcel, PeerLost, Silent
from ftis_engine.exchange import WeightSlot
from ftis_engine.exchange.async_ import Latency, Mailbox
from ftis_engine.exchange.local import InProcess
from ftis_engine.exchange.links import DATA, DONE, TAKEN, WEIGHTS, Outbox
from ftis_engine.exchange.sync import Collectives, DistributedSync
from ftis_engine.data.rollouts import Rollout, encode


def _buffer(sequences: int) -> torch.Tensor:
    return encode([Rollout(0, i, torch.tensor([5], dtype=torch.int32), torch.tensor([-1.0]), 0.0, "stop", 0)
                   for i in range(sequences)])


def test_in_process_sync_gives_every_member_every_peers_buffer_of_the_step_and_alone_nothing():
    buffers = {0: torch.zeros(3, dtype=torch.int32), 1: torch.ones(5, dtype=torch.int32)}
    exchange = InProcess([0, 1], capacity=2)
    assert exchange.send(buffers, step=4) == {0: 12, 1: 20}
    got = exchange.receive(0, 4).parcels
    assert [(p.sender, p.step, p.version) for p in got] == [(1, 4, 3)] and torch.equal(got[0].buffer, buffers[1])
    assert [p.sender for p in exchange.receive(1, 4).parcels] == [0]
    exchange.send(buffers, step=5)  # the next step's: this step's alone (the last step's were taken)
    assert [(p.sender, p.step) for p in exchange.receive(0, 5).parcels] == [(1, 5)]
    alone = Silent.alone(InProcess([0, 1], capacity=2))
    assert alone.send(buffers, 4) == {0: 0, 1: 0} and alone.receive(0, 4).parcels == []
    assert InProcess([0], capacity=2).send({0: buffers[0]}, 1) == {0: 0}  # a swarm of one sends nothing


def test_latency_is_fixed_or_drawn_reproducibly_within_its_range():
    assert Latency(LatencySettings.model_validate(3), seed=0).delay(0, 1, 5) == 3.0
    drawn = Latency(LatencySettings(unit="steps", min=1, max=4), seed=7)
    values = [drawn.delay(0, 1, step) for step in range(200)]
    assert set(values) == {1.0, 2.0, 3.0, 4.0}  # whole steps, every one of them
    assert values == [Latency(LatencySettings(unit="steps", min=1, max=4), seed=7).delay(0, 1, s) for s in range(200)]
    seconds = Latency(LatencySettings(unit="seconds", min=0.5, max=1.5), seed=0)
    assert all(0.5 <= seconds.delay(1, 0, s) <= 1.5 for s in range(50))


def test_a_mailbox_releases_a_parcel_at_its_due_step_and_time_and_within_the_lead():
    box = Mailbox(capacity=10)
    now = time.time()
    box.put(Parcel(1, 1, 0, torch.zeros(1), due_step=3))
    box.put(Parcel(1, 2, 1, torch.zeros(1), due_time=now + 60))
    box.put(Parcel(1, 3, 2, torch.zeros(1)))
    box.put(Parcel(1, 6, 5, torch.zeros(1)))  # 4 versions ahead of a receiver at step 2
    assert [p.step for p in box.take_due(2, now, newest_version=2 - 1 + 2)] == [3]
    assert [p.step for p in box.take_due(3, now, newest_version=3 - 1 + 2)] == [1]
    assert [p.step for p in box.take_due(10, now + 59)] == [6]  # no lead bound: any version
    assert len(box) == 1 and [p.step for p in box.take_due(10, now + 60)] == [2]


def test_a_full_mailbox_drops_a_senders_oldest_parcel_and_counts_its_sequences():
    box = Mailbox(capacity=2)
    for step in (1, 2, 3):
        box.put(Parcel(1, step, step - 1, _buffer(4)))
    box.put(Parcel(2, 1, 0, _buffer(3)))  # another sender has its own room
    assert box.take_dropped() == 4 and box.take_dropped() == 0
    assert [(p.sender, p.step) for p in box.take_due(9, time.time())] == [(2, 1), (1, 2), (1, 3)]


def test_the_in_process_async_exchange_delivers_to_every_peer_after_the_delay():
    exchange = InProcess([0, 1, 2], capacity=8, latency=Latency(LatencySettings.model_validate(2), seed=0))
    assert exchange.send({0: torch.ones(5, dtype=torch.int32)}, step=1) == {0: 20}
    first = exchange.receive(1, 2)
    assert first.parcels == [] and first.waiting == 1 and exchange.receive(0, 2).waiting == 0
    assert [(p.sender, p.step, p.version) for p in exchange.receive(1, 3).parcels] == [(0, 1, 0)]
    assert [(p.sender, p.step) for p in exchange.receive(2, 9).parcels] == [(0, 1)]


def test_an_outbox_keeps_the_newest_parcels_and_sends_slots_first_and_done_last():
    box = Outbox(capacity=2)
    for step in (1, 2, 3):
        box.put_parcel(step, step - 1, _buffer(5))
    box.put_slot(WEIGHTS, 0, 7, torch.zeros(3, dtype=torch.int32))
    box.put_slot(WEIGHTS, 0, 8, torch.zeros(3, dtype=torch.int32))  # replaces the unsent copy
    box.put_slot(TAKEN, 4, 0, None)
    box.put_done()
    taken = [box.take()[:3] for _ in range(6)]
    assert box.dropped_sequences == 5  # step 1 made room for step 3
    # the round taken first (it never waits behind a weights transfer), then the weights, the parcels, DONE
    assert taken == [(TAKEN, 4, 0), (WEIGHTS, 0, 8), (DATA, 2, 1), (DATA, 3, 2), (DONE, 0, 0), (DONE, 0, 0)]
    assert Outbox(1).take() is None  # nothing to send
    left = Outbox(capacity=4)
    left.put_parcel(1, 0, _buffer(3))
    left.put_done()
    left.clear_parcels()  # the peer said DONE: nothing more is used there, the answer goes at once
    assert left.take()[0] == DONE and left.dropped_sequences == 3


def test_a_weight_slot_takes_only_its_learners_newer_weights_of_the_right_size():
    slot = WeightSlot(source=0, words=3, version=2, last_version=9)
    assert slot.limit(0, 4) == 3
    assert slot.limit(1, 4) == 0  # not its learner
    assert slot.limit(0, 2) == 0 and slot.limit(0, 10) == 0  # not newer / beyond the last push
    slot.put(4, torch.ones(3, dtype=torch.int32))
    slot.put(6, torch.full((3,), 6, dtype=torch.int32))
    slot.put(5, torch.ones(3, dtype=torch.int32))  # older than what arrived: ignored
    version, words = slot.take()
    assert version == 6 and words.tolist() == [6, 6, 6] and slot.take() is None and slot.limit(0, 6) == 0


def _failing(error: BaseException):
    def collective(*args, **kwargs):
        raise error

    return collective


def test_a_collective_that_fails_raises_peer_lost_naming_it_with_the_backends_error_as_its_cause(monkeypatch):
    """gloo raises a peer's closed connection (and a hung one's time-out) as a plain RuntimeError: at the
    collective it is PeerLost, what a rank tells as a lost peer."""
    import torch.distributed as dist

    closed = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer\nmore")
    monkeypatch.setattr(dist, "monitored_barrier", _failing(closed))
    collectives = Collectives(0, 2, torch.device("cpu"), "gloo")
    with pytest.raises(PeerLost, match=r"^barrier: \[.*pair.cc:553\] Connection closed by peer$") as lost:
        collectives.barrier()
    assert lost.value.__cause__ is closed
    with pytest.raises(PeerLost, match=r"^barrier: ") as lost:  # named once: the sync transport's own barrier
        DistributedSync(collectives).send({0: torch.zeros(1, dtype=torch.int32)}, step=3)
    assert lost.value.__cause__ is closed
    monkeypatch.setattr(dist, "monitored_barrier", lambda **kwargs: None)
    monkeypatch.setattr(dist, "all_gather", _failing(RuntimeError("Timed out waiting 5000ms for recv operation")))
    with pytest.raises(PeerLost, match=r"^step 3: all_gather of the parcels' sizes: Timed out waiting"):
        DistributedSync(collectives).send({0: torch.zeros(1, dtype=torch.int32)}, step=3)


def test_this_ranks_out_of_memory_or_a_non_runtime_error_at_a_collective_is_raised_as_itself(monkeypatch):
    import torch.distributed as dist

    collectives = Collectives(0, 2, torch.device("cpu"), "gloo")
    monkeypatch.setattr(dist, "all_gather_object", _failing(torch.OutOfMemoryError("CUDA out of memory.")))
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        collectives.gather_records([])
    monkeypatch.setattr(dist, "all_reduce", _failing(ValueError("Default process group has not been initialized")))
    with pytest.raises(ValueError, match="not been initialized"):
        collectives.all_agree(1)
