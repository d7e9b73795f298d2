"""Decoupled samplers (samplers.py): which ranks they are, and the weights a learner pushes to them (its trainable
parameters only, bit-exact). Their behaviour in a run: tests/test_async_swarm.py."""

from __future__ import annotations

import torch

from ftis_engine.members import trainable_parameters
from ftis_engine.samplers import flatten_weights, load_weights, sampler_ranks, weights_words

from .helpers import member, short_config


def test_sampler_ranks_follow_the_learners_in_member_order():
    config = short_config("swarm.mode=async", "members.0.samplers=2", "members.1.samplers=1")
    assert sampler_ranks(config, 0) == [2, 3] and sampler_ranks(config, 1) == [4]


def test_a_push_carries_exactly_the_trainable_weights_and_loads_bit_exact():
    for index in (0, 1):  # a full member, and a LoRA member (its adapter only)
        learner, _ = member(index)
        sampler, _ = member(index)
        with torch.no_grad():
            for p in trainable_parameters(learner.model):
                p.add_(torch.randn_like(p))
        words = flatten_weights(learner.model)
        assert words.dtype == torch.int32 and words.numel() == weights_words(learner.model)
        assert words.numel() == sum(p.numel() for p in learner.trainable_parameters())
        load_weights(sampler.model, words)
        for a, b in zip(trainable_parameters(learner.model), trainable_parameters(sampler.model)):
            assert torch.equal(a, b)
    lora, _ = member(1)
    assert weights_words(lora.model) < sum(p.numel() for p in lora.model.parameters()) / 2  # not the base
