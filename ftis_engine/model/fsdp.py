"""A member on several ranks, and the process groups of a multi-process run (torch.distributed, FSDP2).

A member on K > 1 ranks (a `Shard`) holds its model sharded with FSDP2 (`fully_shard` per decoder layer and at a
root that runs the body and the fused loss head, so the head's weight is gathered for the loss), generates its
share of the member's prompts on each rank, trains on its share of the member's batch on each rank (the op is
given the member's whole-batch counts, so the K gradients sum to the one-rank gradient), and sends its rollouts
once, from the leader. The leader alone exchanges with the other members and admits their rollouts; it hands
what it admitted to its shards. Which process is which shard: layout.py.
"""

from __future__ import annotations

import copy
import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..config import ConfigError, RunConfig
from ..core.dist import collective
from .layers import find_decoder_layers
from ..topology.layout import endpoint_ranks, member_ranks, process_roles, weights_group_ranks


# ------------------------------------------------------------------------------------------------- process groups


@dataclass
class Groups:
    """The process groups of a multi-process run beyond the default one, created by every rank in one order."""

    endpoints: object | None  # the exchange's endpoints, group rank = endpoint (None: every rank is one)
    links: object | None  # async: the endpoints' gloo group (group rank = endpoint): gathers the links' addresses
    members: dict[int, tuple[object, object]]  # member with K > 1 ranks -> (FSDP group, gloo group for objects)
    weights: dict[int, object] = field(default_factory=dict)  # member with samplers -> its weight broadcast group


def weights_backend(config: RunConfig, device_type: str, open_member: bool = False) -> str | None:
    """The backend of the members' weight broadcast groups (swarm.weights_transport), or None: the links carry the
    weights. NCCL only between distinct GPUs: ranks that share one (a member's `device`) broadcast over gloo. A
    member of an open swarm (open_member) has no links: its samplers always take its weights by broadcast."""
    transport = config.swarm.weights_transport
    if config.swarm.mode != "async" or not any(m.samplers for m in config.members) or transport == "links":
        return None
    distinct_gpus = device_type == "cuda" and not any(m.device for m in config.members)
    if transport == "auto" and not open_member:
        return "nccl" if distinct_gpus else None
    return "nccl" if distinct_gpus else "gloo"


def make_groups(config: RunConfig, backend: str, timeout: datetime.timedelta, open_member: bool = False) -> Groups:
    """Every rank calls this right after init_process_group: torch.distributed needs each group created by all
    ranks, in the same order."""
    endpoints = endpoint_ranks(config)
    endpoint_group = dist.new_group(endpoints, timeout=timeout) if len(endpoints) < len(process_roles(config)) \
        else None
    links = None
    if config.swarm.mode == "async":
        links = dist.new_group(endpoints, backend="gloo", timeout=timeout)
    members = {}
    # a further shard waits in its member's group while the leader exchanges: up to swarm.timeout_s at the
    # barrier or lead wait, then admission; its group waits longer than any one of those
    patience = 2 * timeout + datetime.timedelta(seconds=60)
    for i, member in enumerate(config.members):
        if member.ranks > 1:
            ranks = member_ranks(config, i)
            fsdp = dist.new_group(ranks, backend=backend, timeout=patience)
            objects = fsdp if backend == "gloo" else dist.new_group(ranks, backend="gloo", timeout=patience)
            members[i] = (fsdp, objects)
    weights = {}
    broadcast = weights_backend(config, "cuda" if backend == "nccl" else "cpu", open_member)
    if broadcast is not None:
        for i, member in enumerate(config.members):
            if member.samplers:
                weights[i] = dist.new_group(weights_group_ranks(config, i), backend=broadcast, timeout=patience)
    return Groups(endpoint_group, links, members, weights)


# ------------------------------------------------------------------------------------------------- a sharded member


@dataclass
class Shard:
    """This rank's part of a member: of a member on several ranks, or the whole of a one-rank member (Shard.whole():
    one part, no group, every collective its own value back), so every caller runs the same code for both."""

    index: int  # 0: the leader
    size: int
    ranks: list[int]  # the member's process ranks, leader first
    group: object  # FSDP's group (NCCL between GPUs, gloo on CPU); None: whole
    objects: object  # gloo group of the same ranks, for Python objects; None: whole

    @classmethod
    def whole(cls) -> Shard:
        """A one-rank member's: itself the leader of one part."""
        return cls(0, 1, [], None, None)

    @property
    def sharded(self) -> bool:
        """Spread over several ranks by FSDP2 (its weights and optimizer state are parts)."""
        return self.size > 1

    @property
    def leader(self) -> bool:
        return self.index == 0

    def all_gather(self, value) -> list:
        if not self.sharded:
            return [value]
        gathered: list = [None] * self.size
        with collective("the shards' all_gather_object"):
            dist.all_gather_object(gathered, value, group=self.objects)
        return gathered

    def from_leader(self, value):
        """The leader's value on every shard."""
        if not self.sharded:
            return value
        box = [value]
        with collective("the shards' broadcast from their leader"):
            dist.broadcast_object_list(box, src=self.ranks[0], group=self.objects)
        return box[0]

    def max(self, value: int) -> int:
        if not self.sharded:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        with collective("the shards' all_reduce"):
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.objects)
        return int(tensor.item())

    def all_true(self, value: bool) -> bool:
        if not self.sharded:
            return bool(value)
        tensor = torch.tensor([int(value)], dtype=torch.int64)
        with collective("the shards' all_reduce"):
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.objects)
        return bool(tensor.item())

    def barrier(self) -> None:
        if not self.sharded:
            return
        with collective("the shards' barrier"):
            dist.barrier(group=self.objects)

    def share(self, count: int) -> range:
        """Which of `count` ordered things (prompts) this shard takes: every size-th from its index."""
        return range(self.index, count, self.size)


class ShardedPolicy(torch.nn.Module):
    """The FSDP2 root of a sharded member: its forward runs the decoder body and hands the hidden states and the
    (gathered) lm_head to `loss`, so the head's weight exists in full for the fused loss and its gradient is
    reduce-scattered like every other."""

    def __init__(self, model: torch.nn.Module, causal_lm: torch.nn.Module):
        super().__init__()
        self.model = model  # registered: the root owns the embeddings, final norm and head (and their adapters)
        self._causal_lm = [causal_lm]  # not a submodule twice

    def forward(self, input_ids, position_ids, rows, loss, attention_mask=None):
        lm = self._causal_lm[0]
        extra = {} if attention_mask is None else {"attention_mask": attention_mask}  # a shared-prompt row's
        hidden = lm.get_decoder()(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                  **extra).last_hidden_state[0, rows]
        head = lm.get_output_embeddings()
        out = loss(hidden, head.weight, head.bias)
        return out.loss, out


def shard_model(index: int, model: torch.nn.Module, causal_lm: torch.nn.Module, shard: Shard,
                device: torch.device, dtype: torch.dtype) -> ShardedPolicy:
    """fully_shard every decoder layer, then the root. The shards hold the float32 master weights; with a bf16
    compute dtype each layer is gathered in bf16 (param_dtype) and gradients are reduced in float32."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    layers = find_decoder_layers(causal_lm)
    if not layers:
        raise ConfigError(f"members.{index}.ranks: the model has no decoder `layers` list to shard; use ranks: 1")
    mesh = DeviceMesh.from_group(shard.group, device.type)
    policy = MixedPrecisionPolicy(param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    root = ShardedPolicy(model, causal_lm)
    fully_shard(root, mesh=mesh, mp_policy=policy)
    return root


@torch.no_grad()
def broadcast_weights(model: torch.nn.Module, shard: Shard) -> None:
    """The leader's weights (and buffers) on every shard, before sharding."""
    with collective("the leader's weights to its shards"):
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=shard.ranks[0], group=shard.group)


def replica(model: torch.nn.Module) -> torch.nn.Module:
    """A plain copy a sharded member's HF generator samples from (synced from the shards after every update)."""
    return copy.deepcopy(model)


def is_sharded(tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded parameter's whole value (a collective over its member's ranks), or the tensor itself."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor, or the tensor itself."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def full_state_dict(model: torch.nn.Module, keep: bool = True, dtype: torch.dtype | None = None
                    ) -> dict[str, torch.Tensor]:
    """The model's state dict with every sharded entry gathered, one tensor at a time, onto the CPU (every shard
    must call it; keep=False gathers without keeping, for the shards that do not write); dtype: floating entries
    are kept in it (cast on the device, before the copy)."""
    out = {}
    for name, tensor in model.state_dict().items():
        value = full(tensor).detach()
        if keep:
            if dtype is not None and value.is_floating_point():
                value = value.to(dtype)
            out[name] = value.cpu()
    return out
