"""Rollouts: the wire format (the values a receiver accepts: test_admission.py)."""

from __future__ import annotations

import pytest
import torch

from ftis_engine.data.rollouts import Rollout, RolloutError, claimed_sequences, decode, encode, wire_bytes


def _rollouts(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = i + 1
        out.append(Rollout(member=1, prompt_index=10 + i, completion_ids=torch.randint(0, 50, (length,), generator=g,
                                                                                       dtype=torch.int32),
                           gen_logprobs=-torch.rand(length, generator=g), reward=float(i % 2), finish_reason="stop",
                           policy_version=7))
    return out


def test_wire_round_trip_is_bit_exact_and_costs_8_bytes_a_token_plus_header():
    rollouts = _rollouts()
    buffer = encode(rollouts)
    tokens = sum(r.num_tokens for r in rollouts)
    assert buffer.dtype == torch.int32
    assert buffer.numel() * 4 == wire_bytes(3, tokens) == 4 + 32 * 3 + 8 * tokens
    back = decode(buffer)
    for a, b in zip(rollouts, back):
        assert torch.equal(a.completion_ids, b.completion_ids)
        assert torch.equal(a.gen_logprobs.view(torch.int32), b.gen_logprobs.view(torch.int32))
        assert (a.prompt_index, a.reward, a.member, a.policy_version, a.finish_reason) == (
            b.prompt_index, b.reward, b.member, b.policy_version, b.finish_reason)


def test_truncated_or_inflated_buffers_are_rejected():
    buffer = encode(_rollouts())
    for bad in (buffer[:-1], torch.cat([buffer, buffer[:1]]), buffer[:3], torch.tensor([], dtype=torch.int32)):
        with pytest.raises(RolloutError):
            decode(bad)
    negative = buffer.clone()
    negative[1 + 1] = -5  # first sequence's length
    with pytest.raises(RolloutError):
        decode(negative)


def test_claimed_sequences_is_the_header_count_bounded_by_the_size():
    buffer = encode(_rollouts())
    assert claimed_sequences(buffer) == 3
    assert claimed_sequences(torch.tensor([1_000_000, 0, 0], dtype=torch.int32)) == 0  # no room for one header
    assert claimed_sequences(torch.tensor([-4], dtype=torch.int32)) == 0
    assert claimed_sequences(torch.zeros(0, dtype=torch.int32)) == 0


def test_claimed_sequences_counts_a_bodys_raw_bytes_as_its_words():
    body = encode(_rollouts()).to(torch.int32).numpy().tobytes()
    assert claimed_sequences(body) == claimed_sequences(bytearray(body)) == 3
    assert claimed_sequences(torch.tensor([1_000_000, 0, 0], dtype=torch.int32).numpy().tobytes()) == 0
    assert claimed_sequences(torch.tensor([-4], dtype=torch.int32).numpy().tobytes()) == 0
    assert claimed_sequences(body[:-1]) == claimed_sequences(b"") == claimed_sequences(body[:3]) == 0  # not words
