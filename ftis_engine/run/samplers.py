"""Decoupled samplers (members.N.samplers, swarm.mode async): generator-only ranks that add generation throughput
to one member, HeteroRL's samplers.

A sampler rank builds its member's model and generator exactly as the learner does (same init, warm start, or the
resumed checkpoint), then, until its learner finishes, repeats a round: wait until its learner has taken its round
r - 1 - K (the lead bound K, exchange/pacer.py: at most K + 1 rounds in flight), take the newest weights its learner
pushed (every members.N.weight_sync_every learner steps, trainable parameters only: a LoRA member sends its adapter),
generate and score one learner step's worth of prompts (its share of a step: the same number of prompts, whole
groups), and publish them to every learner. Its rollouts carry the member's index and the weight version they were
generated with, so every receiver's importance weights (TIS / F-TIS / GEPO) are computed against the sampler's own
log-probs and its staleness counts from that version.

A sampler draws its prompts from a stream of its own (schedule.Schedule.round_deal), so the receivers check every
parcel against the deal of its round exactly as they check a learner's.
"""

from __future__ import annotations

import logging
import time

import torch

from ..model.checkpoint import diverging
from ..exchange import SamplerExchange, WeightSlot
from . import sampling as sample
from ..member.members import trainable_parameters
from ..report.metrics import MetricsLogger, mean_reward
from ..model.fsdp import full
from ..data.rollouts import encode
from ..topology.schedule import learner_version
from .session import Swarm

log = logging.getLogger("ftis_engine")


def flatten_weights(model, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                    keep: bool = True) -> torch.Tensor | None:
    """The trainable parameters as one flat buffer: float32 as int32 words for the links (bf16 and fp16 widen
    exactly), or `dtype` on `device` for a weight broadcast; a sharded model's gathered one parameter at a time
    (every shard calls it). keep=False (a shard that does not push): gathered without keeping, None returned,
    instead of a whole copy of the model made and thrown away at every push. The buffer is filled in place, one
    parameter at a time: no list of copies beside it."""
    params = trainable_parameters(model)
    flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=device) if keep else None
    offset = 0
    for p in params:
        value = full(p.detach())  # every shard takes part in the gather
        if flat is not None:
            flat[offset : offset + value.numel()].copy_(value.flatten())
        offset += value.numel()
    if flat is None:
        return None
    return flat.view(torch.int32) if dtype == torch.float32 else flat


def weight_values(flat: torch.Tensor) -> torch.Tensor:
    """The values of a pushed buffer: int32 words are float32 bits, any other dtype is itself."""
    return flat.view(torch.float32) if flat.dtype == torch.int32 else flat


def weights_words(model) -> int:
    return sum(p.numel() for p in trainable_parameters(model))


@torch.no_grad()
def load_weights(model, words: torch.Tensor) -> None:
    values = weight_values(words)
    offset = 0
    for p in trainable_parameters(model):
        p.copy_(values[offset : offset + p.numel()].view_as(p).to(p.dtype))
        offset += p.numel()


def run_sampler(swarm: Swarm, start_version: int) -> None:
    """A sampler rank's life: rounds of generation until its learner has finished, then leave (trainer.Sampler: its
    generator is the Trainer's to close)."""
    # config and launch allow samplers only in async mode across processes (async_.DistributedAsync) or in an open
    # swarm's member (openswarm.member.OpenSampler)
    exchange: SamplerExchange = swarm.exchange
    config, schedule = swarm.config, swarm.schedule
    member = swarm.members[0]
    rank = exchange.rank  # its endpoint on the links (members' leaders, then samplers): the schedule's numbering
    learner, index = schedule.roles[rank]
    process_rank = torch.distributed.get_rank()  # which process it is (differs once a member has several ranks)
    exchange.collectives.barrier()  # as train() does: the run directory is ready
    # a learner pushes no weights after its last step (version train.steps - 1)
    slot = WeightSlot(learner, weights_words(member.model), start_version, learner_version(config.train.steps))
    exchange.start(schedule.parcel_limit, start_version, weights=slot)
    logger = MetricsLogger(swarm.run_dir, tensorboard=False, shared=True)
    version, round_ = start_version, start_version  # rounds number on from a resumed step (the log stays ordered)
    try:
        while not exchange.peer_done(learner):
            exchange.check()  # a learner that died (not one that finished) stops this rank too
            round_ += 1
            waited = exchange.wait_taken(round_)
            if exchange.peer_done(learner):
                break
            newest = slot.take()
            refused = newest is not None and not bool(torch.isfinite(weight_values(newest[1])).all())
            if refused:  # a learner never pushes such weights (it stops on divergence): say so, keep the last good
                log.warning("%s sampler %d: weights of version %d from its learner hold NaN or inf; not loaded, it "
                            "goes on sampling with version %d", member.name, index, newest[0], version)
            elif newest is not None:
                version = newest[0]
                load_weights(member.model, newest[1])
                member.generator.sync(member.model)
            started = time.time()
            with member.generator.awake(), diverging(swarm.run_dir, member, round_):
                rollouts = sample.generate_rollouts(swarm, member, schedule.round_deal(rank, round_), version,
                                                    schedule.sampling_seed(round_, rank))
            exchange.send_parcel(encode(rollouts), round_, version)
            logger.log({"step": round_, "member": member.name, "kind": "sample", "sampler": index, "rank": process_rank,
                        "endpoint": rank,
                        "policy_version": version, "started_at": started, "seconds": time.time() - started,
                        "waited_seconds": waited, "sequences": len(rollouts),
                        "weights_transport": "links" if exchange.broadcast is None else "broadcast",
                        "weights_refused": int(refused),
                        "tokens": sum(r.num_tokens for r in rollouts),
                        "unscored": sum(r.reward != r.reward for r in rollouts),
                        "reward_mean": mean_reward(rollouts)})
        exchange.check()  # the learner finished (DONE), or its link was lost or failed: say which
        exchange.finish()
    finally:
        logger.close()
