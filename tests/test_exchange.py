"""The exchange: what each member receives, and the receiver's checks of a peer's batch (untrusted input)."""

from __future__ import annotations

import logging

import pytest
import torch

from ftis_engine.exchange import Alone, LocalExchange, RolloutChecker, receive
from ftis_engine.rollouts import Rollout, RolloutError, encode
from ftis_engine.tasks import Example, Task



class DigitTokenizer:
    """Token id i decodes to the digit i % 10."""

    def batch_decode(self, sequences, skip_special_tokens=True):
        return ["".join(str(i % 10) for i in ids) for ids in sequences]


def _task() -> Task:
    examples = [Example(question=f"q{i}", answer="7") for i in range(100)]
    return Task(name="digits", train=examples, evals={}, reward=lambda text, gold: float(text.endswith(gold)))


def _rollouts(sender: int, prompts: list[int], task: Task) -> list[Rollout]:
    g = torch.Generator().manual_seed(sender)
    out = []
    for p in prompts:
        ids = torch.randint(0, 50, (3,), generator=g, dtype=torch.int32)
        reward = task.score(DigitTokenizer(), [ids], [task.train[p]])[0]
        out.append(Rollout(sender, p, ids, -torch.rand(3, generator=g), reward, "stop", 0))
    return out


def test_local_delivery_gives_every_member_every_buffer_and_alone_only_its_own():
    buffers = {0: torch.zeros(3, dtype=torch.int32), 1: torch.ones(5, dtype=torch.int32)}
    delivery = LocalExchange().share(buffers, limits={0: 10, 1: 10})
    assert {r: sorted(box) for r, box in delivery.inbox.items()} == {0: [0, 1], 1: [0, 1]}
    assert delivery.sent_bytes == {0: 12, 1: 20}
    alone = Alone(LocalExchange()).share(buffers, limits={0: 10, 1: 10})
    assert {r: sorted(box) for r, box in alone.inbox.items()} == {0: [0], 1: [1]} and alone.sent_bytes == {0: 0, 1: 0}
    assert LocalExchange().share({0: buffers[0]}, {0: 10}).sent_bytes == {0: 0}  # a swarm of one sends nothing


def test_a_peer_cannot_inflate_a_group_with_extra_or_missing_completions():
    task = _task()
    rollouts = _rollouts(1, [10, 11, 12], task)
    checker = RolloutChecker(task, DigitTokenizer(), vocab_size=100, max_new_tokens=8)
    dealt = {10: 1, 11: 1, 12: 1}
    assert len(checker.accept(encode(rollouts), sender=1, dealt=dealt)) == 3
    with pytest.raises(RolloutError, match="completions of prompt 10"):
        checker.accept(encode(rollouts + [rollouts[0]] * 40), sender=1, dealt=dealt)
    with pytest.raises(RolloutError, match="no completions of dealt prompt 12"):
        checker.accept(encode(rollouts[:2]), sender=1, dealt=dealt)


def test_a_claimed_reward_that_the_receiver_does_not_reproduce_is_rejected():
    task = _task()
    rollouts = _rollouts(1, [10, 11], task)
    rollouts[1].reward = 1.0 - rollouts[1].reward
    checker = RolloutChecker(task, DigitTokenizer(), vocab_size=100, max_new_tokens=8)
    with pytest.raises(RolloutError, match="sequence 1: claims reward"):
        checker.accept(encode(rollouts), sender=1, dealt=None)


def test_receive_keeps_its_own_and_the_good_peers_and_drops_a_bad_batch_whole(caplog):
    task = _task()
    checker = RolloutChecker(task, DigitTokenizer(), vocab_size=100, max_new_tokens=8)
    own = _rollouts(0, [1, 2], task)
    good = _rollouts(1, [3, 4], task)
    bad = _rollouts(2, [5, 6], task)
    bad[0].completion_ids = torch.tensor([999, 1, 2], dtype=torch.int32)  # outside the vocabulary
    inbox = {0: encode(own), 1: encode(good), 2: encode(bad)}
    dealt = {0: {1: 1, 2: 1}, 1: {3: 1, 4: 1}, 2: {5: 1, 6: 1}}
    with caplog.at_level(logging.WARNING, logger="ftis_engine.exchange"):
        got = receive(inbox, 0, own, checker, dealt, ["a", "b", "c"])
    assert [(r.member, r.prompt_index) for r in got.rollouts] == [(0, 1), (0, 2), (1, 3), (1, 4)]
    assert len(got.rejected) == 1 and got.rejected[0][0] == 2 and "vocabulary" in got.rejected[0][1]
    assert "a: dropped the rollouts of peer c (member 2)" in caplog.text
