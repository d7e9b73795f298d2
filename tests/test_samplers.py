"""Decoupled samplers (samplers.py): the weights a learner pushes to them (its trainable
parameters only, bit-exact). Their behaviour in a run: tests/test_async_swarm.py."""

from __future__ import annotations

import torch

from ftis_engine.member.members import trainable_parameters
from ftis_engine.run.samplers import flatten_weights, load_weights, weights_words

from .helpers import member, short_config


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


def test_weights_go_by_broadcast_between_distinct_gpus_and_by_the_links_otherwise():
    from ftis_engine.topology.layout import weights_group_ranks
    from ftis_engine.model.fsdp import weights_backend

    samplers = ["swarm.mode=async", "members.0.samplers=2", "members.1.samplers=1"]
    config = short_config(*samplers)
    assert weights_backend(config, "cuda") == "nccl" and weights_backend(config, "cpu") is None
    assert weights_group_ranks(config, 0) == [0, 2, 3] and weights_group_ranks(config, 1) == [1, 4]
    shared = short_config(*samplers, "members.1.device=cuda:0")  # ranks may share a GPU: NCCL refuses that
    assert weights_backend(shared, "cuda") is None
    forced = short_config(*samplers, "swarm.weights_transport=broadcast")
    assert weights_backend(forced, "cpu") == "gloo" and weights_backend(forced, "cuda") == "nccl"
    assert weights_backend(short_config(*samplers, "swarm.weights_transport=links"), "cuda") is None
    assert weights_backend(short_config("swarm.mode=async"), "cuda") is None  # no samplers, no groups
    sharded = short_config(*samplers, "members.0.ranks=2")  # the leader pushes for a sharded member
    assert weights_group_ranks(sharded, 0) == [0, 3, 4]


def test_a_bf16_push_loads_as_the_learners_weights_rounded_to_bf16():
    learner, _ = member(0)
    sampler, _ = member(0)
    flat = flatten_weights(learner.model, torch.bfloat16)
    assert flat.dtype == torch.bfloat16 and flat.numel() == weights_words(learner.model)
    load_weights(sampler.model, flat)
    pairs = list(zip(trainable_parameters(learner.model), trainable_parameters(sampler.model)))
    assert all(torch.equal(a.to(torch.bfloat16).float(), b) for a, b in pairs)
    assert not all(torch.equal(a, b) for a, b in pairs)  # rounded, not copied


def test_a_shard_that_does_not_push_gathers_every_parameter_and_keeps_nothing(monkeypatch):
    """Every shard of a sharded member takes part in each parameter's gather (a collective); only its leader, which
    pushes, keeps the flat buffer: the others made a whole float32 copy of the model at every push and threw it
    away."""
    from ftis_engine.run import samplers

    learner, _ = member(0)
    gathered = []
    monkeypatch.setattr(samplers, "full", lambda tensor: gathered.append(tensor.numel()) or tensor)
    assert samplers.flatten_weights(learner.model, keep=False) is None
    params = [p.numel() for p in trainable_parameters(learner.model)]
    assert gathered == params
    gathered.clear()
    assert samplers.flatten_weights(learner.model).numel() == sum(params) and gathered == params
