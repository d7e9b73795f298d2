"""One update of one member: a diverged loss, gradient or model stops training without taking a step on it; a step
that makes the weights non-finite says so (and checkpoint.py never saves them)."""

from __future__ import annotations

import pytest
import torch

from ftis_engine.model.update import DivergenceError, update_member
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
    from ftis_engine.model.checkpoint import stage_members

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

    from ftis_engine.model.batch import pack
    from ftis_engine.model.update import batch_loss

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


def test_the_second_optimizer_step_on_a_batch_is_trls_clipped_objective_against_the_recorded_old_logprobs():
    """train.epochs / mini_batches: the step's starting policy's log-probs are recorded (the first step's ratio is
    exactly 1), and a later step's loss is TRL's GRPO objective with num_iterations > 1, in float64: per token
    -min(r A, clip(r, 1 - eps, 1 + eps) A), r = exp(logp - old_logp), averaged per sequence, then over sequences."""
    from ftis_kernels import LossConfig

    from ftis_engine.model.batch import pack
    from ftis_engine.model.update import batch_loss, optimizer_step, packed_hidden, with_old_logprobs

    m, cfg = member(0, "members.0.lr=0.05")  # large steps: the second step's ratios leave [0.8, 1.2]
    loss_config = LossConfig(method="nois")
    items = with_old_logprobs(m, random_items(m.vocab_size, seed=4), loss_config, 64, "torch")
    batch = pack(items)
    with torch.no_grad():
        now = batch_loss(m, batch, loss_config, "torch").logprobs  # packed otherwise than the update: rounding only
        assert torch.allclose(now, batch.old_logprobs, atol=1e-5)  # ratio 1
    first = optimizer_step(m, items, loss_config, 64, "torch")
    assert first["clip_frac"] == 0.0
    with torch.no_grad():
        out = batch_loss(m, batch, loss_config, "torch")
        hidden = packed_hidden(m, batch).double()
        weight = m.causal_lm.get_output_embeddings().weight.double()
    logp = torch.log_softmax(hidden @ weight.T, -1).gather(1, batch.targets[:, None]).squeeze(1)
    ratio = torch.exp(logp - batch.old_logprobs.double())
    adv = torch.repeat_interleave(batch.advantages.double(), (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).long())
    per_token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    bounds = batch.cu_seqlens.tolist()
    trl = torch.stack([per_token[a:b].mean() for a, b in zip(bounds, bounds[1:])]).mean()
    assert float(out.stats["clip_frac"]) > 0
    assert float(out.loss) == pytest.approx(float(trl), rel=1e-4, abs=1e-6)


def test_epochs_and_mini_batches_take_that_many_optimizer_steps_and_report_them_together():
    from ftis_engine.model.update import update_member

    m, cfg = member(0, "members.0.lr=0.02")
    loss_config = cfg.algorithm.loss_config(cfg.rollout.temperature)
    taken = []
    step = m.optimizer.step
    m.optimizer.step = lambda *a, **k: taken.append(1) or step(*a, **k)
    stats = update_member(m, random_items(m.vocab_size, n_groups=4, seed=5), loss_config, 64, "torch", epochs=2,
                          parts=2)
    assert len(taken) == 4 and stats["optimizer_steps"] == 4 and stats["clip_frac"] > 0
    one = update_member(m, random_items(m.vocab_size, n_groups=4, seed=5), loss_config, 64, "torch")
    assert "optimizer_steps" not in one and len(taken) == 5


@pytest.mark.parametrize("schedule, expected", [
    ("constant", [0.25, 0.5, 0.75, 1, 1, 1, 1, 1, 1]),
    ("linear", [0.25, 0.5, 0.75, 1, 1, 0.8, 0.6, 0.4, 0.2]),
    ("cosine", [0.25, 0.5, 0.75, 1, 1, 0.904508, 0.654508, 0.345492, 0.095492]),
])
def test_the_learning_rate_warms_up_then_follows_its_schedule(schedule, expected):
    from ftis_engine.topology.schedule import learning_rate

    from .helpers import short_config

    config = short_config("train.steps=9", "train.warmup_steps=4", f"train.lr_schedule={schedule}",
                          "members.0.lr=1.0")
    assert [round(learning_rate(config, 0, s), 6) for s in range(1, 10)] == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("index", [0, 1], ids=["full", "lora"])
def test_the_kl_penalty_reference_is_the_initial_policy_and_moves_away_from_it_as_the_member_trains(index):
    """algorithm.beta > 0: a full member keeps a frozen copy of its initial weights, a LoRA member uses its base
    with the adapter disabled. Before any step the policy is its reference (ref_kl_mean 0); after steps it is not,
    and the loss carries the beta term."""
    from ftis_engine.model.batch import pack
    from ftis_engine.model.update import batch_loss, reference_logprobs, update_member

    m, cfg = member(index, "algorithm.beta=0.5", f"members.{index}.lr=0.02")
    assert (m.reference is not None) == (index == 0)
    loss_config = cfg.algorithm.loss_config(cfg.rollout.temperature)
    items = random_items(m.vocab_size, seed=6)
    first = update_member(m, items, loss_config, 64, "torch")
    assert first["ref_kl_mean"] == pytest.approx(0.0, abs=1e-6)
    for seed in (7, 8):
        update_member(m, random_items(m.vocab_size, seed=seed), loss_config, 64, "torch")
    with torch.no_grad():
        batch = pack(items)
        out = batch_loss(m, batch, loss_config, "torch")
        reference = reference_logprobs(m, batch, loss_config)
    assert float(out.stats["ref_kl_mean"]) > 1e-4
    assert not torch.allclose(out.logprobs, reference)
    with torch.no_grad():
        without = batch_loss(m, batch, loss_config.replace(beta=0.0), "torch")
    assert float(out.loss) > float(without.loss)  # the penalty adds beta * KL >= 0


def test_a_full_members_reference_in_bf16_compute_starts_where_the_policy_is():
    """members.N.dtype=bfloat16 (the GPU's precision, autocast over float32 masters): before any step the frozen
    reference gives the policy's very log-probs, so the KL to it starts at exactly 0 (a copy cast whole to bf16 ran
    its residual stream in bf16: 1e-4 of KL and 0.05 of log-prob away), and its linear layers are held in bf16."""
    from ftis_engine.model.batch import pack
    from ftis_engine.model.update import batch_loss, reference_logprobs

    m, cfg = member(0, "algorithm.beta=0.5", "members.0.dtype=bfloat16")
    assert m.dtype == torch.bfloat16 and m.reference is not None
    loss_config = cfg.algorithm.loss_config(cfg.rollout.temperature)
    batch = pack(random_items(m.vocab_size, seed=6))
    with torch.no_grad():
        out = batch_loss(m, batch, loss_config, "torch")
        reference = reference_logprobs(m, batch, loss_config)
    assert torch.equal(out.logprobs, reference)
    assert float(out.stats["ref_kl_mean"]) == 0.0
    linear = [mod for mod in m.reference.modules() if isinstance(mod, torch.nn.Linear)
              and mod is not m.reference.get_output_embeddings()]
    assert linear and all(mod.weight.dtype == torch.bfloat16 for mod in linear)
    assert m.reference.get_input_embeddings().weight.dtype == torch.float32
    # the memory plan counts the reference as it is built
    from ftis_engine.run.preflight import model_shape, training_bytes

    held = sum(p.numel() * p.element_size() for p in m.reference.parameters())
    without = cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"beta": 0.0})})
    shape = model_shape(cfg.members[0].model)
    assert training_bytes(cfg, 0, shape) - training_bytes(without, 0, shape) == pytest.approx(held, rel=0.02)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_an_entropy_bonus_raises_the_entropy_an_update_leaves_and_a_penalty_lowers_it(backend):
    """algorithm.entropy_coef through the engine's update (the fused op, both backends): from the same member and
    batch, a step with a bonus leaves a higher mean entropy on that batch than one with a penalty."""
    import copy

    from ftis_engine.model.batch import pack
    from ftis_engine.model.update import batch_loss, update_member

    base, cfg = member(0, "members.0.lr=0.05")
    items = random_items(base.vocab_size, seed=9)
    after = {}
    for coef in (2.0, -2.0):
        m = copy.deepcopy(base)
        loss_config = cfg.algorithm.loss_config(cfg.rollout.temperature).replace(entropy_coef=coef)
        update_member(m, items, loss_config, 64, backend)
        with torch.no_grad():
            after[coef] = float(batch_loss(m, pack(items), loss_config, backend).stats["entropy_mean"])
    assert after[2.0] > after[-2.0] + 1e-3, after
