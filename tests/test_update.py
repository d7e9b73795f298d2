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
