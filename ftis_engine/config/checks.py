"""The rules that tie one config field to another, checked once the whole tree has validated (RunConfig's
model_validator calls check_run). Each raises ValueError naming its field first, so pydantic carries it and
load.format_validation_error makes it the one-line ConfigError. Pure: no device, no files, no network."""

from __future__ import annotations

from typing import Any

from ..core.limits import wire_bytes

# The most a step's rollouts may take (the swarm's, on the wire and in every member's update): past this a run
# would fail late (out of memory after the step-0 eval, a run directory left behind) instead of at once.
MAX_STEP_ROLLOUT_BYTES = 16 * 2**30


def check_run(config: Any) -> None:
    """Every cross-field rule of a run's config (a validated schema.RunConfig; schema calls this, so this module
    names no type of schema's: the two would import each other), in the order they are reported (the first broken
    one raises)."""
    names = [m.name for m in config.members]
    if len(set(names)) != len(names):
        raise ValueError("members: names must be unique")
    if config.collaboration == "horizontal" and config.rollout.group_size < len(config.members):
        raise ValueError("rollout.group_size must be >= the number of members in horizontal mode")
    if config.collaboration != "horizontal" and config.rollout.prompts_per_step < len(config.members):
        raise ValueError("rollout.prompts_per_step must be >= the number of members (each member needs a prompt)")
    config.algorithm.loss_config(config.rollout.temperature)  # with the sampler's temperature
    if config.train.warmup_steps >= config.train.steps and config.train.warmup_steps:
        raise ValueError(f"train.warmup_steps: {config.train.warmup_steps} >= train.steps={config.train.steps}: the "
                         "run would end before its learning rate reached lr")
    sharded = next((i for i, m in enumerate(config.members) if m.ranks > 1), None)
    if sharded is not None and config.algorithm.beta > 0:
        raise ValueError(f"algorithm.beta: a KL penalty to the reference is not supported yet for a member on "
                         f"several ranks (members.{sharded}.ranks={config.members[sharded].ranks})")
    if sharded is not None and config.train.epochs * config.train.mini_batches > 1:
        raise ValueError(f"train.epochs: several optimizer steps per batch (epochs x mini_batches = "
                         f"{config.train.epochs * config.train.mini_batches}) are not supported yet for a member on "
                         f"several ranks (members.{sharded}.ranks={config.members[sharded].ranks})")
    groups = config.rollout.prompts_per_step // (len(config.members) if config.collaboration == "alone" else 1)
    if config.train.mini_batches > groups:  # mini-batches are cut from whole groups: fewer, without a word
        held = (f"collaboration alone gives a member as few as {groups} of rollout.prompts_per_step="
                f"{config.rollout.prompts_per_step} dealt to {len(config.members)} members"
                if config.collaboration == "alone" else f"rollout.prompts_per_step={groups}")
        raise ValueError(f"train.mini_batches: {config.train.mini_batches} optimizer steps a pass are cut from "
                         f"whole groups, and a step's update holds {groups} ({held}); at most {groups}")
    if config.swarm.mode == "sync" and not config.swarm.latency.is_zero:
        raise ValueError("swarm.latency: a delay needs swarm.mode: async (sync members wait for each other)")
    for i, member in enumerate(config.members):
        if member.samplers and config.swarm.mode != "async":
            raise ValueError(f"members.{i}.samplers: sampler ranks need swarm.mode: async (a sync member "
                             "trains on what it generated this step)")
        if member.samplers and config.collaboration == "alone":
            raise ValueError(f"members.{i}.samplers: sampler ranks need collaboration vertical (alone members "
                             "take no rollouts from anyone)")
        if member.samplers and member.weight_sync_every >= config.train.steps:
            raise ValueError(f"members.{i}.weight_sync_every: {member.weight_sync_every} >= train.steps="
                             f"{config.train.steps}: its samplers would never receive weights")
    for i, member in enumerate(config.members):
        if member.adversary is not None and (member.ranks > 1 or member.samplers):
            raise ValueError(f"members.{i}.adversary: an attacker (studies and tests) runs on one rank without "
                             f"samplers (members.{i}.ranks={member.ranks}, samplers={member.samplers})")
    in_context = [f"members.{i}.adversary.kind" for i, m in enumerate(config.members)
                  if m.adversary is not None and m.adversary.kind == "in-context"]
    if "in-context" in (config.eval.payloads or ()):
        in_context.append("eval.payloads")
    for field in in_context:
        if config.data.task != "arith":
            raise ValueError(f"{field}: in-context writes a wrong column sum of the arith task's scratchpad; "
                             f"data.task is {config.data.task!r}")
    latency = config.swarm.latency
    if latency.unit == "steps" and latency.min > config.swarm.max_staleness:
        raise ValueError(f"swarm.latency: every delivery is at least {latency.min:g} steps late, more than "
                         f"swarm.max_staleness={config.swarm.max_staleness}: every peer rollout would be dropped")
    if latency.unit == "seconds" and config.swarm.max_delay_s is not None and latency.min > config.swarm.max_delay_s:
        raise ValueError(f"swarm.latency: every delivery is at least {latency.min:g} s late, more than "
                         f"swarm.max_delay_s={config.swarm.max_delay_s:g}: every peer rollout would be dropped")
    _check_step_size(config)
    budget = config.swarm.max_peer_sequences
    if budget is not None and budget < config.rollout.group_size:
        raise ValueError(f"swarm.max_peer_sequences: {budget} is less than one group (rollout.group_size="
                         f"{config.rollout.group_size}): an update takes whole groups, so it would take none")
    if config.swarm.mode == "async" and config.collaboration == "horizontal":
        raise ValueError("swarm.mode: async needs collaboration vertical or alone (a horizontal group's shares "
                         "would arrive at different steps and never form a whole group)")


def _check_step_size(config: Any) -> None:
    rollout = config.rollout
    sequences = rollout.group_size * rollout.prompts_per_step
    size = wire_bytes(sequences, sequences * rollout.max_new_tokens)
    if size > MAX_STEP_ROLLOUT_BYTES:
        # name the factor furthest beyond what real runs use (group 64, 1024 prompts, 32k tokens)
        field = max((rollout.group_size / 64, "rollout.group_size"), (rollout.prompts_per_step / 1024,
                    "rollout.prompts_per_step"), (rollout.max_new_tokens / 32768, "rollout.max_new_tokens"))[1]
        raise ValueError(f"{field}: {rollout.prompts_per_step} prompts x {rollout.group_size} completions of up to "
                         f"{rollout.max_new_tokens} tokens are {size / 2**30:.3g} GiB of rollouts a step, more "
                         f"than the {MAX_STEP_ROLLOUT_BYTES // 2**30} GiB a step may hold")
