"""Where members run: which process rank is which member's shard, and a member spread over several ranks.

Process layout (`members.N.ranks`, `members.N.samplers`), decided here and nowhere else: every member's ranks
side by side in member order (its first rank is its leader), then the sampler ranks. Rank order is node order
under torchrun, so a member's ranks share a node whenever its K fits one. The exchange, the schedule and the
receivers number *endpoints* (config.rank_roles: every member's leader, then the samplers) and see one per
member whatever its ranks; `endpoint_ranks` maps them to process ranks. A run whose members all have one rank is
laid out exactly as before (process rank = endpoint). `--nproc` is the sum of all members' ranks plus their
samplers.

A member on K > 1 ranks (a `Shard`) holds its model sharded with FSDP2 (`fully_shard` per decoder layer and at a
root that runs the body and the fused loss head, so the head's weight is gathered for the loss), generates its
share of the member's prompts on each rank, trains on its share of the member's batch on each rank (the op is
given the member's whole-batch counts, so the K gradients sum to the one-rank gradient), and sends its rollouts
once, from the leader. The leader alone exchanges with the other members and admits their rollouts; it hands
what it admitted to its shards.
"""

from __future__ import annotations

import copy
import datetime
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .config import ConfigError, RunConfig, rank_roles
from .layers import find_decoder_layers

log = logging.getLogger("ftis_engine")


@dataclass(frozen=True)
class Role:
    """What one process does: learner (sampler None) or sampler of a member, which shard of it, and the
    exchange endpoint it is (None: a member's further shard, which its leader exchanges for)."""

    member: int
    sampler: int | None
    shard: int  # 0 for the leader and for samplers
    endpoint: int | None


def process_roles(config: RunConfig) -> list[Role]:
    """Every process rank's role: each member's shards in member order, then the samplers."""
    endpoints = {role: e for e, role in enumerate(rank_roles(config))}
    roles = [Role(i, None, shard, endpoints[(i, None)] if shard == 0 else None)
             for i, member in enumerate(config.members) for shard in range(member.ranks)]
    roles += [Role(i, k, 0, endpoints[(i, k)])
              for i, member in enumerate(config.members) for k in range(member.samplers)]
    return roles


def endpoint_ranks(config: RunConfig) -> list[int]:
    """The process rank of every exchange endpoint (in rank_roles order)."""
    ranks = {role.endpoint: r for r, role in enumerate(process_roles(config)) if role.endpoint is not None}
    return [ranks[e] for e in range(len(ranks))]


def member_ranks(config: RunConfig, member: int) -> list[int]:
    """The process ranks of a member's learner, leader first (shard order)."""
    return [r for r, role in enumerate(process_roles(config)) if role.member == member and role.sampler is None]


def describe_layout(config: RunConfig) -> str:
    """One line per rank: what it runs (printed at start)."""
    lines = []
    for rank, role in enumerate(process_roles(config)):
        member = config.members[role.member]
        if role.sampler is not None:
            what = f"{member.name}: sampler {role.sampler}"
        elif member.ranks > 1:
            what = f"{member.name}: shard {role.shard + 1}/{member.ranks}" + (" (leader)" if role.shard == 0 else "")
        else:
            what = member.name
        lines.append(f"  rank {rank}: {what}")
    return "\n".join(lines)


# what the vLLM engines that share one GPU may take of it together; the rest is the members' training memory
SHARED_ENGINES_LIMIT = 0.9


def check_placement(config: RunConfig) -> None:
    """members.N.ranks and members.N.device, before any process starts: a device must exist, and the vLLM engines
    of members placed on one GPU must leave room for training (each takes its gpu_memory_utilization share of
    the whole GPU while awake; asleep, during the updates, almost nothing)."""
    engines: dict[str, list[int]] = {}
    for i, member in enumerate(config.members):
        if member.device is not None and member.generator == "vllm":
            key = member.device if ":" in member.device or member.device != "cuda" else "cuda:0"
            engines.setdefault(key, []).append(i)
    for device, placed in engines.items():
        total = sum(config.members[i].vllm.gpu_memory_utilization for i in placed)
        if len(placed) > 1 and total > SHARED_ENGINES_LIMIT:
            names = ", ".join(f"members.{i}" for i in placed)
            raise ConfigError(f"members.{placed[-1]}.vllm.gpu_memory_utilization: the vLLM engines of {names} on "
                              f"{device} would take {total:.2f} of it together (at most {SHARED_ENGINES_LIMIT}, the "
                              "rest is for training); lower it")
    placed_on: dict[torch.device, list[int]] = {}
    for i, member in enumerate(config.members):
        if member.ranks > 1 and member.device is not None:
            raise ConfigError(f"members.{i}.device: a member on {member.ranks} ranks takes one device per rank (by "
                              "rank); drop device or set ranks: 1")
        if member.device is not None:
            placed_on.setdefault(check_device(f"members.{i}.device", member.device), []).append(i)
    for device, placed in placed_on.items():
        if device.type == "cuda":
            check_memory_plan(config, placed, device, torch.cuda.get_device_properties(device).total_memory)


# what a process's CUDA context, the allocator's slack and the fused head's chunks take beyond the estimate below
PROCESS_OVERHEAD_BYTES = 1 << 30


def model_shape(spec: str) -> dict | None:
    """hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size, vocab_size and
    tie_word_embeddings of a built-in or a local/cached HF model (its config only, no weights); None when unknown."""
    from .models import BPE_VOCAB_SIZE, TINY_MODELS, builtin_name, is_builtin

    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")
    if is_builtin(spec):
        name = builtin_name(spec)
        shape = {k: TINY_MODELS[name][k] for k in keys}
        return {**shape, "vocab_size": BPE_VOCAB_SIZE if name.endswith("-bpe") else 101,
                "tie_word_embeddings": TINY_MODELS[name]["tie_word_embeddings"], "attention_bias": True}
    try:
        from transformers import AutoConfig

        from .hub import hub_reachable
        from .models import _from_hub, source

        where = source(spec)
        try:  # the cache or a local folder first; a hub model's config (a few kB) from the hub when it answers
            hf = AutoConfig.from_pretrained(where, local_files_only=True)
        except Exception:
            if not (_from_hub(where) and hub_reachable()):
                raise
            hf = AutoConfig.from_pretrained(where)
        shape = {k: int(getattr(hf, k)) for k in (*keys, "vocab_size")}
    except Exception:  # an unknown architecture or no config: nothing to estimate with
        return None
    shape["num_key_value_heads"] = shape["num_key_value_heads"] or shape["num_attention_heads"]
    # Qwen2 configs name no attention_bias (their q, k, v always have one); Llama's say
    return {**shape, "tie_word_embeddings": bool(getattr(hf, "tie_word_embeddings", False)),
            "attention_bias": bool(getattr(hf, "attention_bias", True))}


def _projections(shape: dict) -> dict[str, tuple[int, int]]:
    d, i = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * (d // shape["num_attention_heads"])
    return {"q_proj": (d, d), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (d, d), "gate_proj": (d, i),
            "up_proj": (d, i), "down_proj": (i, d)}


def parameter_counts(shape: dict, lora) -> tuple[int, int]:
    """(all parameters, trainable ones) of a Qwen2- or Llama-shaped decoder: the projections (q, k, v with biases
    when attention_bias), two norms a layer, the embedding (and an untied head); trainable: all, or a LoRA adapter's r x (in + out) per target."""
    projections = _projections(shape)
    d, layers = shape["hidden_size"], shape["num_hidden_layers"]
    biases = d + 2 * projections["k_proj"][1] if shape.get("attention_bias", True) else 0
    per_layer = sum(a * b for a, b in projections.values()) + biases + 2 * d
    total = layers * per_layer + d + shape["vocab_size"] * d * (1 if shape["tie_word_embeddings"] else 2)
    if lora is None:
        return total, total
    adapter = sum(lora.r * (a + b) for name, (a, b) in projections.items() if name in lora.target_modules)
    return total, layers * adapter


def _widths(member) -> tuple[int, int]:
    """Bytes per element of a member's compute dtype (auto: bf16, the plan is for a GPU) and master dtype."""
    return 4 if member.dtype == "float32" else 2, 4 if member.master_dtype == "float32" else 2


def state_bytes(config: RunConfig, index: int, shape: dict) -> int:
    """What member `index` holds whatever it computes, over all its ranks: each trainable parameter with its gradient
    and two Adam states in the master dtype (float32: 16 bytes; bfloat16, the memory-saving mode: 8), and a LoRA
    member's frozen base in the compute dtype."""
    compute, master = _widths(config.members[index])
    base, trainable = parameter_counts(shape, config.members[index].lora)
    frozen = base if config.members[index].lora is not None else 0  # a LoRA adapter comes on top of its base
    return 4 * master * trainable + compute * frozen


def training_bytes(config: RunConfig, index: int, shape: dict) -> int:
    """An estimate of one rank's training memory for member `index` on a GPU, split over its ranks where FSDP2
    splits it: the trainable parameters with their gradients and two Adam states in the master dtype (16 bytes a
    parameter as float32, 8 in members.N.master_dtype=bfloat16), a LoRA member's frozen base in the compute dtype
    (auto: bf16 on a GPU); the bf16 copies autocast makes of float32 masters for a pass (one rank; on several, FSDP2
    gathers the root and two layers at a time in bf16); and the activations of one micro-batch
    (train.micro_batch_tokens): every layer's input kept for recompute plus one layer's working set, or every
    layer's working set without recompute. The fused head never holds the logits."""
    member = config.members[index]
    compute, master = _widths(member)
    total, trainable = parameter_counts(shape, member.lora)
    states = state_bytes(config, index, shape) // member.ranks
    d, inner, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    copies = 0
    if compute < 4:
        heads = shape["vocab_size"] * d * (1 if shape["tie_word_embeddings"] else 2)
        per_layer = (total - heads - d) // layers
        if member.ranks > 1:
            copies = compute * (heads + d + 2 * per_layer)
        elif master > compute and member.lora is None:  # the body's weights autocast caches, the head's cast
            copies = compute * (total - heads - d + shape["vocab_size"] * d)
        elif master > compute:
            copies = compute * trainable
    if config.algorithm.beta > 0 and member.lora is None:  # the KL penalty's frozen reference copy
        copies += compute * total
    tokens = config.train.micro_batch_tokens
    working = tokens * (8 * d + 3 * inner) * compute
    saved = tokens * d * compute * layers + working if config.train.gradient_checkpointing else working * layers
    return states + copies + saved


def check_memory_plan(config: RunConfig, placed: list[int], device: torch.device, capacity: int) -> None:
    """The members placed on one GPU must fit it: each vLLM engine takes its gpu_memory_utilization share of the
    whole GPU (awake during generation, asleep in the update but not freed at level 1), each member's training
    takes `training_bytes` plus a process's overhead. A plan that does not fit stops, naming the field to lower."""
    gib = 1 << 30
    engines = sum(config.members[i].vllm.gpu_memory_utilization * capacity for i in placed
                  if config.members[i].generator == "vllm")
    needs, least = {}, 0  # least: what the engines need at the very least (bf16 weights and 1 GiB of KV cache)
    for i in placed:
        shape = model_shape(config.members[i].model)
        if shape is None:
            log.warning("members.%d.model: no config found to plan its memory with (not in the cache and the hub "
                        "does not answer, or not a decoder the plan knows); the memory plan on %s leaves it out", i,
                        device)
        if shape is not None:
            needs[i] = training_bytes(config, i, shape) + PROCESS_OVERHEAD_BYTES
            if config.members[i].generator == "vllm":
                least += 2 * parameter_counts(shape, None)[0] + gib
    if engines + sum(needs.values()) <= capacity:
        return
    largest = max(needs, key=needs.get)
    parts = ", ".join(f"members.{i} {needs[i] / gib:.1f}" for i in needs)
    where = f"{device} ({capacity / gib:.1f} GiB)"
    vllm = [i for i in placed if config.members[i].generator == "vllm"]
    if vllm and sum(needs.values()) + least <= capacity:
        raise ConfigError(f"members.{vllm[-1]}.vllm.gpu_memory_utilization: the vLLM engines on {where} take "
                          f"{engines / gib:.1f} GiB and training needs about {sum(needs.values()) / gib:.1f} GiB "
                          f"({parts}); lower it")
    saving = (f", or set members.{largest}.master_dtype=bfloat16 (torchao's AdamW with bf16 stochastic rounding: "
              "8 bytes a trainable parameter instead of 16)" if config.members[largest].master_dtype == "float32"
              else "")
    raise ConfigError(f"members.{largest}.device: training the members on {where} needs about "
                      f"{sum(needs.values()) / gib:.1f} GiB ({parts}) besides {engines / gib:.1f} GiB of vLLM "
                      "engines; move a member to another device, or lower train.micro_batch_tokens, or give the "
                      f"largest a LoRA adapter or more ranks{saving}")


def check_device(field: str, spec: str) -> torch.device:
    """A device string that exists on this machine (cpu, cuda, cuda:N; "cuda" is cuda:0): the one parser of a
    configured device (train.device through members.resolve_device, members.N.device); errors name `field`."""
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ConfigError(f"{field}: unknown device {spec!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"{field}: {spec!r} is not a device to train on (cpu, cuda or cuda:N)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{field}: {spec!r} requested but CUDA is not available")
        device = torch.device("cuda", device.index or 0)
        if device.index >= torch.cuda.device_count():
            raise ConfigError(f"{field}: {spec!r} does not exist (this machine has {torch.cuda.device_count()} "
                              "GPU(s))")
    return device


# ------------------------------------------------------------------------------------------------- process groups


@dataclass
class Groups:
    """The process groups of a multi-process run beyond the default one, created by every rank in one order."""

    endpoints: object | None  # the exchange's endpoints, group rank = endpoint (None: every rank is one)
    links: object | None  # async: the point-to-point links' gloo group over the endpoints (group rank = endpoint)
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


def weights_group_ranks(config: RunConfig, member: int) -> list[int]:
    """A member's weight broadcast group: its leader's rank, then its samplers' ranks."""
    samplers = [r for r, role in enumerate(process_roles(config)) if role.member == member and role.sampler is not None]
    return [member_ranks(config, member)[0], *samplers]


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
    """This rank's part of a member on several ranks."""

    index: int  # 0: the leader
    size: int
    ranks: list[int]  # the member's process ranks, leader first
    group: object  # FSDP's group (NCCL between GPUs, gloo on CPU)
    objects: object  # gloo group of the same ranks, for Python objects

    @property
    def leader(self) -> bool:
        return self.index == 0

    def all_gather(self, value) -> list:
        gathered: list = [None] * self.size
        dist.all_gather_object(gathered, value, group=self.objects)
        return gathered

    def from_leader(self, value):
        """The leader's value on every shard."""
        box = [value]
        dist.broadcast_object_list(box, src=self.ranks[0], group=self.objects)
        return box[0]

    def max(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.objects)
        return int(tensor.item())

    def all_true(self, value: bool) -> bool:
        tensor = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.objects)
        return bool(tensor.item())

    def barrier(self) -> None:
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

    def forward(self, input_ids, position_ids, rows, loss):
        lm = self._causal_lm[0]
        hidden = lm.get_decoder()(input_ids=input_ids, position_ids=position_ids,
                                  use_cache=False).last_hidden_state[0, rows]
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
