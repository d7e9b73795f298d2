"""What a member brings to join an open swarm (openswarm/member.py): a config that can join (check_joinable), its
training set's hash (dataset_hash; the coordinator computes the swarm's from its own config: training_set_hash), a
tokenizer source its peers can load (shareable) and, with samplers, the key its samplers sign their parcels with
(share_key)."""

from __future__ import annotations

import hashlib

import torch

from ..config import DataSettings, RunConfig
from ..data.tasks import load_task
from ..exchange import collective
from ..topology.layout import world_size

KEY_BYTES = 32  # the key a learner shares with its samplers: 256 bits, as strong as HMAC-SHA256 gets


class JoinError(ValueError):
    """A config that cannot join an open swarm (the message names the field)."""


def check_joinable(config: RunConfig, nproc: int) -> None:
    if len(config.members) != 1:
        raise JoinError(f"members: a member joining an open swarm has exactly one member in its config, not "
                        f"{len(config.members)}")
    member = config.members[0]
    processes = world_size(config)
    if nproc > 1 and nproc != processes:
        raise JoinError(f"--nproc {nproc}: this member runs on {processes} process(es) (members.0.ranks="
                        f"{member.ranks} + members.0.samplers={member.samplers})")
    if member.samplers and config.swarm.weights_transport == "links":
        raise JoinError("swarm.weights_transport: a member of an open swarm gives its samplers its weights by "
                        "broadcast in its own process group (it has no links); set auto or broadcast")
    if config.swarm.mode != "async":
        raise JoinError("swarm.mode: an open swarm is asynchronous; set swarm.mode=async")
    if config.swarm.max_restarts:
        raise JoinError("swarm.max_restarts: a member of an open swarm comes back with --resume --join, not by an "
                        "elastic restart (its name is held until its lease runs out); set it to 0")
    if config.collaboration != "vertical":
        raise JoinError(f"collaboration: an open swarm is vertical, not {config.collaboration!r}")
    if config.swarm.peers_per_step and member.samplers:
        raise JoinError("members.0.samplers: a member's samplers send their rounds through the coordinator, which "
                        "relays nothing under swarm.peers_per_step (not yet supported together); set 0")
    if config.swarm.peers_per_step and member.ranks > 1:
        raise JoinError("members.0.ranks: a member on several ranks exchanges through the coordinator's relay only "
                        "(swarm.peers_per_step is not yet supported with it); set 1")


def shareable(spec: str) -> bool:
    """Whether a model or tokenizer spec loads on another machine: builtin:, packaged: or a hub id (not a path)."""
    import pathlib
    import re

    if spec.startswith(("builtin:", "packaged:")):
        return True
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", spec)) and not pathlib.Path(spec).exists()


def dataset_hash(task) -> str:
    """sha256 of the training examples (question and gold answer of each, in order): members of one swarm train on
    the same set."""
    digest = hashlib.sha256()
    for example in task.train:
        digest.update(example.question.encode())
        digest.update(b"\x00")
        digest.update(example.answer.encode())
        digest.update(b"\x01")
    return digest.hexdigest()


def training_set_hash(data, seed: int) -> str:
    """The training set's sha256 (dataset_hash) that a member of these shared settings joins with, computed from
    them: `data` (a DataSettings, or its JSON as shared_settings gives it) and the run's `seed`. The coordinator's
    own, from its config: the swarm's (never what a member says it is). Only the training set is read: the
    rewards are not loaded (they change no example), and the eval sets are those data.eval_paths names (the task's
    default ones without it), as a member's training set does not depend on which it evaluates. Raises TaskError
    (naming the data field) when the set cannot be read here."""

    data = data if isinstance(data, DataSettings) else DataSettings.model_validate(data)
    data = data.model_copy(update={"reward": None, "rewards": []})
    return dataset_hash(load_task(data, seed, list(data.eval_paths) or None))


def share_key(broadcast, key: bytes | None = None) -> bytes:
    """The key of a member's samplers' parcels (wire.parcel_mac), from its learner (key: the learner's, a fresh
    random one) to its samplers (key None: received) by one broadcast in their weight group
    (exchange.weights.WeightBroadcast): it never leaves the member's processes, so neither a peer nor the
    coordinator can sign as one of its samplers. Called by the learner and each sampler at their start, before
    any weights: the group's first collective on every side."""
    import torch.distributed as dist

    words = torch.empty(KEY_BYTES, dtype=torch.uint8) if key is None else torch.tensor(list(key), dtype=torch.uint8)
    words = words.to(broadcast.device)
    with collective("the samplers' key broadcast"):
        dist.broadcast(words, src=broadcast.source, group=broadcast.group)
    return words.cpu().numpy().tobytes()
