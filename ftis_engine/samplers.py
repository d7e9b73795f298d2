"""Decoupled samplers (members.N.samplers, swarm.mode async): generator-only ranks that add generation throughput
to one member, HeteroRL's samplers.

A sampler rank builds its member's model and generator exactly as the learner does (same init, warm start, or the
resumed checkpoint), then, until its learner finishes, repeats a round: take the newest weights its learner pushed
(every members.N.weight_sync_every learner steps, trainable parameters only: a LoRA member sends its adapter),
generate and score one learner step's worth of prompts (its share of a step: the same number of prompts, whole
groups), and publish them to every learner. Its rollouts carry the member's index and the weight version they
were generated with, so every receiver's importance weights (TIS / F-TIS / GEPO) are computed against the
sampler's own log-probs and its staleness counts from that version.

A sampler draws its prompts from a stream of its own (the training prompts shuffled by the run seed and its rank),
so the receivers can check every parcel against the deal of its round exactly as they check a learner's.
"""

from __future__ import annotations

import time

import torch

from .config import rank_roles
from .metrics import MetricsLogger
from .rollouts import encode


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def flatten_weights(model) -> torch.Tensor:
    """The trainable parameters as one int32 word buffer (float32 bits; bf16 and fp16 widen exactly)."""
    return torch.cat([p.detach().float().flatten().cpu() for p in trainable(model)]).view(torch.int32)


def weights_words(model) -> int:
    return sum(p.numel() for p in trainable(model))


@torch.no_grad()
def load_weights(model, words: torch.Tensor) -> None:
    values = words.view(torch.float32)
    offset = 0
    for p in trainable(model):
        p.copy_(values[offset : offset + p.numel()].view_as(p).to(p.dtype))
        offset += p.numel()


def sampler_ranks(config, member: int) -> list[int]:
    return [rank for rank, (m, k) in enumerate(rank_roles(config)) if m == member and k is not None]


def prompts_per_round(swarm, member: int) -> int:
    """A sampler's round holds as many prompts as its member is dealt in a step (whole groups each)."""
    from .run import deal_step

    return len(deal_step(swarm, 1)[member])


def round_prompts(swarm, rank: int, round_: int) -> dict[int, int]:
    """The deal of a sampler's round: prompts_per_round prompts, whole groups, from the sampler's own shuffle of
    the training prompts."""
    from .run import prompts_for_step

    count = prompts_per_round(swarm, rank_roles(swarm.config)[rank][0])
    seed = (swarm.config.seed * 1_000_003 + 7_919 * (rank + 1)) % (2**63 - 1)
    prompts = prompts_for_step(round_, swarm.train_indices, count, seed, shuffle=True)
    return {p: swarm.config.rollout.group_size for p in prompts}


def run_sampler(swarm, start_version: int) -> None:
    """A sampler rank's life: rounds of generation until its learner has finished, then leave."""
    from .run import generate_rollouts, sampling_seed, start_exchange

    exchange, config = swarm.exchange, swarm.config
    member = swarm.members[0]
    rank = exchange.rank
    learner, index = rank_roles(config)[rank]
    exchange.weights_words = weights_words(member.model)
    exchange.weights_from, exchange.weights_version = learner, start_version
    exchange.last_version = config.train.steps - 1  # a learner pushes no weights after its last step
    exchange.barrier()  # as train() does: the run directory is ready
    start_exchange(swarm)
    logger = MetricsLogger(swarm.run_dir, tensorboard=False, shared=True)
    version, round_ = start_version, start_version  # rounds number on from a resumed step (the log stays ordered)
    try:
        while True:
            exchange.check()  # a learner that died (not one that finished) stops this rank too
            if exchange.peer_done(learner):
                break
            newest = exchange.take_weights()
            if newest is not None and bool(torch.isfinite(newest[1].view(torch.float32)).all()):
                version = newest[0]
                load_weights(member.model, newest[1])
                member.generator.sync(member.model)
            round_ += 1
            started = time.time()
            with member.generator.awake():
                rollouts = generate_rollouts(swarm, member, version + 1, round_prompts(swarm, rank, round_),
                                             seed=sampling_seed(config.seed, round_, rank))
            exchange.publish({rank: encode(rollouts)}, round_)
            logger.log({"step": round_, "member": member.name, "kind": "sample", "sampler": index, "rank": rank,
                        "policy_version": version, "started_at": started, "seconds": time.time() - started,
                        "sequences": len(rollouts), "tokens": sum(r.num_tokens for r in rollouts),
                        "reward_mean": sum(r.reward for r in rollouts) / max(1, len(rollouts))})
        exchange.finish()
    finally:
        logger.close()
        swarm.close()
