"""exchange/weights.py's receiving side, its collectives stood in for: what a learner pushes lands in the slot, the
learner's END ends the thread, and a broadcast that fails surfaces in the sampler's loop as a TransportError."""

from __future__ import annotations

import pytest
import torch

from ftis_engine.exchange import WeightSlot
from ftis_engine.exchange import weights as weights_module
from ftis_engine.exchange.links import TransportError
from ftis_engine.exchange.weights import END, WeightBroadcast


def _learner(monkeypatch, sent: list):
    """dist.broadcast as a sampler sees it: each call fills its tensor with what the learner sent next; an exception
    in `sent` is what the collective raises there."""
    sent = iter(sent)

    def broadcast(tensor, src, group):
        value = next(sent)
        if isinstance(value, BaseException):
            raise value
        tensor.copy_(torch.as_tensor(value, dtype=tensor.dtype).expand_as(tensor))

    monkeypatch.setattr(weights_module.dist, "broadcast", broadcast)


def test_pushes_land_in_the_slot_and_the_learners_end_ends_the_thread(monkeypatch):
    _learner(monkeypatch, [1, 0.5, 2, 0.25, END])
    slot = WeightSlot(source=0, words=4, version=0, last_version=10)
    channel = WeightBroadcast(None, 0, torch.device("cpu"), torch.float32)
    channel.start(slot)
    channel.join(10)
    assert channel.done
    version, words = slot.take()
    assert version == 2 and torch.equal(words, torch.full((4,), 0.25))


def test_a_broadcast_that_fails_is_a_transport_error_in_the_samplers_loop_with_its_cause(monkeypatch):
    failure = RuntimeError("Connection closed by peer [127.0.0.1]:29500")
    _learner(monkeypatch, [1, 0.5, failure])
    slot = WeightSlot(source=0, words=4, version=0, last_version=10)
    channel = WeightBroadcast(None, 3, torch.device("cpu"), torch.float32)
    channel.start(slot)
    with pytest.raises(TransportError, match=r"^the weights broadcast from rank 3 failed: RuntimeError: Connection "
                                             r"closed by peer") as caught:
        channel.join(10)
    assert caught.value.__cause__ is failure and not channel.done
    assert slot.take()[0] == 1  # what came before the failure stays
