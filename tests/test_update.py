"""One update of one member: a diverged loss, gradient or model stops training without taking a step on it; a step
that makes the weights non-finite says so (and checkpoint.py never saves them)."""

from __future__ import annotations

import pytest
import torch

from ftis_engine.update import DivergenceError, update_member
from ftis_kernels import LossConfig

from .helpers import member, random_items


def _weights(m):
    return [p.detach().clone() for p in m.trainable_parameters()]


def test_nan_in_the_model_is_a_divergence_and_no_step_is_taken():
    m, _ = member(0)
    items = random_items(len(m.tokenizer), n_groups=2, per_group=2)
    with torch.no_grad():
        m.model.get_input_embeddings().weight[items[0].prompt_ids[0]] = float("nan")
    before = _weights(m)
    with pytest.raises(DivergenceError, match="hidden states became NaN or inf"):
        update_member(m, items, LossConfig(), 100_000, backend="torch")
    after = _weights(m)
    assert all(torch.equal(a, b) or (a.isnan() == b.isnan()).all() for a, b in zip(before, after))
    assert all(p.grad is None for p in m.trainable_parameters())


def test_a_non_finite_gradient_is_a_divergence_and_no_step_is_taken(monkeypatch):
    m, _ = member(0)
    items = random_items(len(m.tokenizer), n_groups=2, per_group=2)
    real = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, clip: real(params, clip) * float("inf"))
    before = _weights(m)
    with pytest.raises(DivergenceError, match="the gradient norm is inf"):
        update_member(m, items, LossConfig(), 100_000, backend="torch")
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(m)))


def test_a_step_that_makes_the_weights_non_finite_says_so_and_they_are_never_saved(tmp_path):
    from ftis_engine.checkpoint import stage_members

    m, _ = member(0)
    items = random_items(len(m.tokenizer), n_groups=2, per_group=2)
    honest_step = m.optimizer.step

    def overflowing_step(*args, **kwargs):  # an update beyond float32's range (lr 1e30 with Adam does this)
        honest_step(*args, **kwargs)
        with torch.no_grad():
            m.trainable_parameters()[0].view(-1)[0] = float("inf")

    m.optimizer.step = overflowing_step
    with pytest.raises(DivergenceError, match=r"the optimizer step made the weights NaN or inf .* they are not saved"):
        update_member(m, items, LossConfig(), 100_000, backend="torch")
    with pytest.raises(DivergenceError, match="not saved"):
        stage_members(tmp_path, 1, [m], save_optimizer=True)
    assert not list(tmp_path.rglob("rng.pt"))


def test_own_ratio_mean_is_the_trainers_probability_over_the_generators_on_own_tokens_only():
    """Own rollouts whose generation log-probs sit `shift` below the trainer's (per token) give own_ratio_mean =
    mean(exp(shift)) over their tokens, across micro-batches; a peer's tokens, and own ones of an older policy
    version (a decoupled sampler's), however far off, are left out."""
    import dataclasses

    from ftis_engine.batch import pack
    from ftis_engine.update import batch_loss

    m, _ = member(0)
    cfg = LossConfig()
    items = random_items(len(m.tokenizer), n_groups=3, per_group=4)
    with torch.no_grad():
        trainer = batch_loss(m, pack(items), cfg, "torch").logprobs
    bounds = pack(items).cu_seqlens.tolist()
    g = torch.Generator().manual_seed(1)
    shifted, expected = [], []
    for i, item in enumerate(items):
        mine, stale = i % 3 != 0, i % 5 == 1  # own (current or older version) or a peer's
        l = trainer[bounds[i]:bounds[i + 1]]
        shift = torch.rand(l.shape, generator=g) * 0.5 if mine and not stale else torch.full(l.shape, 5.0)
        gen = (l - shift).clamp(max=0.0) if mine and not stale else (l - shift)
        if mine and not stale:
            expected.append((l - gen).exp())
        rollout = dataclasses.replace(item.rollout, member=0 if mine else 1, gen_logprobs=gen,
                                      policy_version=3 if mine and stale else 4)
        shifted.append(dataclasses.replace(item, rollout=rollout))
    assert any(s.rollout.member == 0 and s.rollout.policy_version == 3 for s in shifted)
    stats = update_member(m, shifted, cfg, 12, backend="torch")  # a few tokens a micro-batch: several of them
    assert stats["micro_batches"] > 2
    assert stats["own_ratio_mean"] == pytest.approx(float(torch.cat(expected).mean()), rel=1e-5)
    alone = update_member(m, [s for s in shifted if s.rollout.member == 1], cfg, 12, backend="torch")
    assert alone["own_ratio_mean"] != alone["own_ratio_mean"]  # no own tokens: NaN, not 0 or 1
