"""Packing rollouts into one row and splitting them into micro-batches: the gradient does not depend on the split."""

from __future__ import annotations

import pytest
import torch

from ftis_engine.model.batch import micro_batches, pack, shard_items
from ftis_engine.model.update import accumulate_gradients, batch_loss, packed_hidden

from .helpers import member, random_items


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


REJECT_TOKEN = dict(reject="token", reject_estimator="k3-gen", reject_max=1.0)
REJECT_SEQ = dict(reject="mean", reject_estimator="k1-gen", reject_max=0.5)


@pytest.mark.parametrize("method, normalization, options", [
    ("f-tis", "sequence", {}), ("tis", "token", {}), ("nois", "constant", {}), ("gepo", "sequence", {}),
    ("tis", "token", REJECT_TOKEN), ("f-tis", "sequence", REJECT_SEQ), ("gepo", "sequence", REJECT_SEQ),
], ids=["f-tis", "tis-token", "nois-constant", "gepo", "reject-token", "reject-mean", "gepo-reject-mean"])
def test_micro_batching_does_not_change_the_gradient(method, normalization, options):
    """Rejection included: its normaliser is the count it left, which the trainer corrects after the last
    micro-batch (rejection_scale)."""
    from ftis_kernels import LossConfig

    m, _ = member(0)
    cfg = LossConfig(method=method, normalization=normalization, norm_max_len=8, kl_threshold=3.0, **options)
    items = random_items(len(m.tokenizer), n_groups=3, per_group=4, seed=1)
    grads = []
    for budget in (100_000, 12):
        m.model.zero_grad(set_to_none=True)
        stats = accumulate_gradients(m, items, cfg, budget, backend="torch")
        grads.append([p.grad.clone() for p in m.trainable_parameters()])
        assert stats["micro_batches"] == (1 if budget == 100_000 else stats["micro_batches"])
        if options:  # some of the batch rejected, some kept
            assert 0 < stats["rejected_frac"] < 1
            assert options["reject"] == "token" or 0 < stats["rejected_seq_frac"] < 1
    assert stats["micro_batches"] > 1
    if options:  # the trainer's rescaled gradient is one call's that normalises by what rejection left itself
        m.model.zero_grad(set_to_none=True)
        batch_loss(m, pack(items), cfg, "torch").loss.backward()
        for one_call, split in zip([p.grad for p in m.trainable_parameters()], grads[1]):
            torch.testing.assert_close(split, one_call, rtol=1e-4, atol=1e-6)
    for whole, split in zip(*grads):
        torch.testing.assert_close(split, whole, rtol=1e-4, atol=1e-6)


def test_a_batch_is_split_over_shards_in_whole_groups_every_item_once_and_balanced():
    items = random_items(100, n_groups=7, per_group=3, seed=1)
    parts = [shard_items(items, k, 3) for k in range(3)]
    assert sorted(id(it) for part in parts for it in part) == sorted(id(it) for it in items)
    for part in parts:  # a group never spans two shards
        for other in parts:
            if other is not part:
                assert not {it.group for it in part} & {it.group for it in other}
    loads = [sum(it.num_input_tokens for it in part) for part in parts]
    biggest = max(sum(it.num_input_tokens for it in items if it.group == g) for g in range(7))
    assert max(loads) - min(loads) <= biggest  # greedy: no shard is more than one group ahead
    assert [shard_items(items, k, 3) for k in range(3)] == parts  # every shard computes the same split
