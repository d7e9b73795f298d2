"""Rollouts: the wire format, packing, and micro-batch invariance of the gradient."""

from __future__ import annotations

import pytest
import torch

from ftis_engine.rollouts import Rollout, RolloutError, decode, encode, micro_batches, pack, validate, wire_bytes
from ftis_engine.run import deal
from ftis_engine.update import accumulate_gradients, packed_hidden

from .helpers import member, random_items


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
    assert buffer.numel() * 4 == wire_bytes(3, tokens) == 4 + 24 * 3 + 8 * tokens
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


@pytest.mark.parametrize("mutate, reason", [
    (lambda r: setattr(r, "completion_ids", torch.tensor([999], dtype=torch.int32)), "vocabulary"),
    (lambda r: setattr(r, "completion_ids", torch.tensor([1, 2], dtype=torch.int32)), "log-probs for"),
    (lambda r: (setattr(r, "completion_ids", torch.ones(9, dtype=torch.int32)),
                setattr(r, "gen_logprobs", -torch.ones(9))), "max_new_tokens"),
    (lambda r: setattr(r, "gen_logprobs", torch.tensor([float("nan")])), "NaN"),
    (lambda r: setattr(r, "gen_logprobs", torch.tensor([0.5])), "positive"),
    (lambda r: setattr(r, "prompt_index", 10_000), "outside the dataset"),
    (lambda r: setattr(r, "member", 0), "claims member"),
])
def test_validation_names_the_problem(mutate, reason):
    rollouts = _rollouts(1)
    mutate(rollouts[0])
    with pytest.raises(RolloutError, match=reason):
        validate(rollouts, sender=1, vocab_size=100, max_new_tokens=8, expected=None, num_prompts=100)


def test_vertical_deals_whole_groups_round_robin_and_horizontal_splits_each_group():
    prompts = [11, 12, 13, 14, 15]
    vertical = [deal(prompts, m, 2, "vertical", 12) for m in range(2)]
    assert vertical[0] == [(11, 12), (13, 12), (15, 12)] and vertical[1] == [(12, 12), (14, 12)]
    horizontal = [deal(prompts, m, 3, "horizontal", 8) for m in range(3)]
    assert [h[0][1] for h in horizontal] == [3, 3, 2]  # 8 completions of each prompt split 3 + 3 + 2
    assert all([p for p, _ in h] == prompts for h in horizontal)
    assert deal(prompts, 0, 2, "alone", 12) == vertical[0]  # alone: what vertical deals, never shared


def test_packed_forward_gives_each_sequence_its_own_hidden_states():
    m, _ = member(1)
    items = random_items(len(m.tokenizer), n_groups=2, per_group=2)
    together = packed_hidden(m, pack(items))
    alone = torch.cat([packed_hidden(m, pack([it])) for it in items])
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-5)


def test_micro_batches_respect_the_budget_and_keep_groups_whole():
    items = random_items(100, n_groups=4, per_group=3)
    for budget in (1, 10, 25, 10_000):
        batches = micro_batches(items, budget)
        assert [it for b in batches for it in b] == items
        for b in batches:
            assert len(b) == 1 or sum(it.num_input_tokens for it in b) <= budget
        for b in micro_batches(items, budget, keep_groups=True):
            groups = {it.group for it in b}
            assert all(sum(1 for it in items if it.group == g) == sum(1 for it in b if it.group == g) for g in groups)


@pytest.mark.parametrize("method, normalization", [("f-tis", "sequence"), ("tis", "token"), ("nois", "constant"),
                                                   ("gepo", "sequence")])
def test_micro_batching_does_not_change_the_gradient(method, normalization):
    from ftis_kernels import LossConfig

    m, _ = member(0)
    cfg = LossConfig(method=method, normalization=normalization, norm_max_len=8, kl_threshold=3.0)
    items = random_items(len(m.tokenizer), n_groups=3, per_group=4, seed=1)
    grads = []
    for budget in (100_000, 12):
        m.model.zero_grad(set_to_none=True)
        stats = accumulate_gradients(m, items, cfg, budget, backend="torch")
        grads.append([p.grad.clone() for p in m.trainable_parameters()])
        assert stats["micro_batches"] == (1 if budget == 100_000 else stats["micro_batches"])
    assert stats["micro_batches"] > 1
    for whole, split in zip(*grads):
        torch.testing.assert_close(split, whole, rtol=1e-4, atol=1e-6)


def test_a_peer_cannot_inflate_a_group_with_extra_or_missing_completions():
    from ftis_engine.exchange import RolloutChecker
    from ftis_engine.rewards import tiny_answer_reward

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(str(i % 10) for i in ids)

    rollouts = _rollouts(3)
    for r in rollouts:
        r.reward = tiny_answer_reward(Tok().decode(r.completion_ids.tolist()), "7")
    checker = RolloutChecker(Tok(), tiny_answer_reward, ["7"] * 100, vocab_size=100, max_new_tokens=8,
                             dealt={1: {10: 1, 11: 1, 12: 1}})
    assert len(checker.accept(encode(rollouts), sender=1)) == 3
    with pytest.raises(RolloutError, match="completions of prompt 10"):
        checker.accept(encode(rollouts + [rollouts[0]] * 40), sender=1)
    with pytest.raises(RolloutError, match="no completions of dealt prompt 12"):
        checker.accept(encode(rollouts[:2]), sender=1)
    with pytest.raises(RolloutError, match="not dealt"):
        validate(rollouts, sender=1, vocab_size=100, max_new_tokens=8, expected={10: 1, 11: 1}, num_prompts=100)


def test_prompts_never_repeat_within_a_step_and_an_epoch_covers_distinct_prompts():
    from ftis_engine.run import prompts_for_step

    indices = list(range(100, 150))  # 50 usable prompts, 24 a step: 2 steps an epoch
    seen_in_epoch = set()
    for step in range(1, 41):
        prompts = prompts_for_step(step, indices, 24, seed=0, shuffle=True)
        assert len(prompts) == 24 and len(set(prompts)) == 24 and set(prompts) <= set(indices)
        if step % 2 == 1:
            seen_in_epoch = set()
        assert not seen_in_epoch & set(prompts)
        seen_in_epoch |= set(prompts)
    assert prompts_for_step(3, indices, 24, 0, True) == prompts_for_step(3, indices, 24, 0, True)
    with pytest.raises(ValueError, match="prompts_per_step"):
        prompts_for_step(1, indices[:10], 24, 0, True)
