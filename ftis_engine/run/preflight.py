"""Every check before a run starts, so that a bad config stops with one line naming its field before anything is
built, written or launched: the devices (the one parser of a configured device), the placement of members and
their vLLM engines on GPUs and the memory plan, the op's backend, the members' models, tokenizers and generators,
and, once a member is built, whether the fused path computes what its model computes (`check_model`).

Which process rank is which member's shard or sampler: layout.py; a member on several ranks: fsdp.py.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from ftis_kernels import resolve_backend

from ..config import ConfigError, RunConfig
from ..core.errors import first_line
from ..core.hub import hub_reachable
from ..data.context import check_context
from ..data.rollouts import Rollout
from ..generation.vllm import check_available
from ..member.members import load_member_tokenizer
from ..model import layers, precision
from ..model.batch import TrainItem, pack
from ..model.models import (
    BPE_VOCAB_SIZE,
    LOAD_ERRORS,
    QWEN_VOCAB_SIZE,
    TINY_MODELS,
    ModelSpecError,
    _from_hub,
    builtin_name,
    builtin_tokenizer,
    check_model_spec,
    is_builtin,
    source,
)
from ..model.update import packed_hidden
from ..report.trackers import check_available as missing_tracker

log = logging.getLogger("ftis_engine")


# what the vLLM engines that share one GPU may take of it together; the rest is the members' training memory
SHARED_ENGINES_LIMIT = 0.9


def check_placement(config: RunConfig) -> None:
    """members.N.ranks and members.N.device, before any process starts: a device must exist, and the vLLM engines
    of members placed on one GPU must leave room for training (each takes its gpu_memory_utilization share of
    the whole GPU while awake; asleep, during the updates, almost nothing). Engines on the CPU take kv_cache_gib of
    the host's memory, not a share of a device."""
    engines: dict[str, list[int]] = {}
    for i, member in enumerate(config.members):
        if member.device is not None and member.device.startswith("cuda") and member.generator == "vllm":
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


@dataclass(frozen=True)
class Unplanned:
    """A model whose memory cannot be planned: why (its config could not be read, or it is no decoder the plan
    knows)."""

    reason: str


def model_shape(spec: str) -> dict | None:
    """hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size, vocab_size and
    tie_word_embeddings of a built-in or a local/cached HF model (its config only, no weights); None when unknown
    (plan_shape says why)."""
    shape = plan_shape(spec)
    return None if isinstance(shape, Unplanned) else shape


def plan_shape(spec: str) -> dict | Unplanned:
    """model_shape's dict, or Unplanned saying why there is none: what reading the config raised (models.LOAD_ERRORS:
    not in the cache and the hub does not answer, an architecture transformers does not know), or a config without
    one of the sizes. Any other error is this code's own and propagates as itself."""
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")
    if is_builtin(spec):
        name = builtin_name(spec)
        shape = {k: TINY_MODELS[name][k] for k in keys}
        vocab = {"qwen": QWEN_VOCAB_SIZE}.get(builtin_tokenizer(spec), BPE_VOCAB_SIZE if name.endswith("-bpe") else 101)
        return {**shape, "vocab_size": vocab,
                "tie_word_embeddings": TINY_MODELS[name]["tie_word_embeddings"], "attention_bias": True}
    from transformers import AutoConfig


    try:
        where = source(spec)
        try:  # the cache or a local folder first; a hub model's config (a few kB) from the hub when it answers
            hf = AutoConfig.from_pretrained(where, local_files_only=True)
        except LOAD_ERRORS:
            if not (_from_hub(where) and hub_reachable()):
                raise
            hf = AutoConfig.from_pretrained(where)
    except LOAD_ERRORS as exc:
        return Unplanned(f"{type(exc).__name__}: {first_line(exc, 160)}")
    shape = {k: getattr(hf, k, None) for k in (*keys, "vocab_size")}
    unknown = [k for k, v in shape.items() if not isinstance(v, int) or isinstance(v, bool)]
    if unknown:
        return Unplanned(f"its config gives no {unknown[0]}: not a decoder the plan knows")
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
    if config.algorithm.beta > 0 and member.lora is None:  # the KL penalty's frozen reference copy: its linear
        heads = shape["vocab_size"] * d * (1 if shape["tie_word_embeddings"] else 2)  # layers in the compute dtype,
        copies += compute * (total - heads) + master * heads  # embeddings and head as the masters (frozen_reference)
    tokens = config.train.micro_batch_tokens
    working = tokens * (8 * d + 3 * inner) * compute
    saved = tokens * d * compute * layers + working if config.train.gradient_checkpointing else working * layers
    return states + copies + saved


# what an engine holds beside its weights and KV cache: activations of its largest batch, CUDA graphs, the allocator
ENGINE_OVERHEAD_BYTES = 2 << 30
ENGINE_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def engine_bytes(config: RunConfig, index: int, shape: dict | None, capacity: int) -> float:
    """What member `index`'s vLLM engine takes of a GPU of `capacity` bytes while awake: with vllm.kv_cache_gib its
    weights in the engine's dtype, that KV cache and ENGINE_OVERHEAD_BYTES (its gpu_memory_utilization share when the
    model's shape is unknown); else its gpu_memory_utilization share of the whole GPU."""
    settings = config.members[index].vllm
    if settings.kv_cache_gib is None or shape is None:
        return settings.gpu_memory_utilization * capacity
    weights = parameter_counts(shape, None)[0] * ENGINE_DTYPE_BYTES[settings.dtype]
    return weights + settings.kv_cache_gib * (1 << 30) + ENGINE_OVERHEAD_BYTES


def check_memory_plan(config: RunConfig, placed: list[int], device: torch.device, capacity: int) -> None:
    """The members placed on one GPU must fit it: each vLLM engine takes `engine_bytes` (awake during generation,
    asleep in the update but not freed at level 1), each member's training takes `training_bytes` plus a process's
    overhead. A plan that does not fit stops, naming the field to lower."""
    gib = 1 << 30
    planned = {i: plan_shape(config.members[i].model) for i in placed}
    shapes = {i: None if isinstance(shape, Unplanned) else shape for i, shape in planned.items()}
    vllm = [i for i in placed if config.members[i].generator == "vllm"]
    engines = sum(engine_bytes(config, i, shapes[i], capacity) for i in vllm)
    needs, least = {}, 0  # least: what the engines need at the very least (bf16 weights and 1 GiB of KV cache)
    for i in placed:
        shape = shapes[i]
        if shape is None:
            log.warning("members.%d.model: no config found to plan its memory with (%s); the memory plan on %s "
                        "leaves it out", i, planned[i].reason, device)
        if shape is not None:
            needs[i] = training_bytes(config, i, shape) + PROCESS_OVERHEAD_BYTES
            if config.members[i].generator == "vllm":
                least += 2 * parameter_counts(shape, None)[0] + gib
    if engines + sum(needs.values()) <= capacity:
        return
    largest = max(needs, key=needs.get)
    parts = ", ".join(f"members.{i} {needs[i] / gib:.1f}" for i in needs)
    where = f"{device} ({capacity / gib:.1f} GiB)"
    if vllm and sum(needs.values()) + least <= capacity:
        field = "kv_cache_gib" if config.members[vllm[-1]].vllm.kv_cache_gib is not None else "gpu_memory_utilization"
        raise ConfigError(f"members.{vllm[-1]}.vllm.{field}: the vLLM engines on {where} take "
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
    configured device (train.device through resolve_device, members.N.device); errors name `field`."""
    try:
        device = torch.device(spec)
    except RuntimeError:
        # from None: a one-line error for the user; the cause adds nothing to it
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


def resolve_device(spec: str, local_rank: int | None = None) -> torch.device:
    """train.device for this process. auto: its GPU (by local rank under --nproc/torchrun) when CUDA is available,
    else CPU; cuda without an index: the local rank's GPU; otherwise as check_device checks it."""
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", (local_rank or 0) % torch.cuda.device_count())
        return torch.device("cpu")
    device = check_device("train.device", spec)
    if device.type == "cuda" and local_rank is not None and torch.device(spec).index is None:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    return device


def member_device(config: RunConfig, index: int, local_rank: int | None) -> torch.device:
    """members.N.device when set, else this rank's device by train.device (by member index in one process)."""
    placed = config.members[index].device
    if placed is not None:
        return check_device(f"members.{index}.device", placed)
    return resolve_device(config.train.device, local_rank if local_rank is not None else index)


def _device_type(spec: str) -> str:
    """The kind of device a device setting names (auto: cuda where there is a GPU), before check_device checks it."""
    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return torch.device(spec).type
    except RuntimeError:
        return spec


def check_generator_placement(config: RunConfig, distributed: bool) -> None:
    """vLLM engines join the process's torch.distributed world: in a multi-process run every rank builds one (all
    members use vllm) or none does. One process holds at most one engine on a GPU: two in-process engines share
    vLLM's process-wide state (its parallel groups; the first one shut down tears them down for both) and have
    never been run on a GPU with sleep and wake between updates. Engines on the CPU, sized in GiB, never asleep and
    never shut down before the process ends, share a process (tested: tests/test_vllm_cpu.py)."""
    vllm = [i for i, m in enumerate(config.members) if m.generator == "vllm"]
    on_gpu = [i for i in vllm if _device_type(config.members[i].device or config.train.device) != "cpu"]
    if not distributed and len(on_gpu) > 1:
        raise ConfigError(f"members.{on_gpu[1]}.generator: one vLLM engine on a GPU per process; run one process per "
                          f"member with --nproc {len(config.members)} (or torchrun)")
    if distributed and 0 < len(vllm) < len(config.members):
        other = next(i for i in range(len(config.members)) if i not in vllm)
        raise ConfigError(f"members.{other}.generator: in a multi-process run either every member uses vllm or "
                          "none does (the engines set up their process groups together)")


def check_members(config: RunConfig, members: list[int] | None = None) -> list[object]:
    """Check the model, tokenizer and generator of every member (or of `members`) before anything is written.
    Returns the tokenizers (None for members not checked). Raises ConfigError naming the member field."""
    chosen = [i for i in range(len(config.members)) if members is None or i in members]
    for i in chosen:  # the generators first: checking them needs no download
        if config.members[i].generator == "vllm":
            problem = check_available(member_device(config, i, None))
            if problem:
                raise ConfigError(f"members.{i}.generator: {problem}")
    for i in chosen:
        settings = config.members[i]
        if settings.master_dtype != "float32":
            problem = precision.check_low_memory_optimizer(i, settings.optimizer, settings.weight_decay)
            if problem:
                raise ConfigError(problem)
    tokenizers = []
    for i, member in enumerate(config.members):
        if i not in chosen:
            tokenizers.append(None)
            continue
        try:
            context = check_model_spec(member.model)
        except ModelSpecError as exc:
            # from None: a one-line error for the user; the cause adds nothing to it
            raise ConfigError(f"members.{i}.model: {exc}") from None
        check_context(config, i, context)
        tokenizers.append(load_member_tokenizer(config, i))
    return tokenizers


def check_threads(threads: int) -> None:
    """train.threads beyond the cores this process may run on only slows it down (20,000 threads once crashed the
    machine): a check of where the run runs, not of its config (a config made on a bigger machine stays valid)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if threads > cores:
        raise ConfigError(f"train.threads: {threads} threads for the {cores} core(s) this process may use; at most "
                          f"{cores} (--set train.threads={cores})")


def check_backend(config: RunConfig, device: torch.device) -> None:
    """train.backend must run on the member's device (the op's own rule: ftis_kernels.resolve_backend)."""
    try:
        resolve_backend(config.train.backend, device)
    except ValueError as exc:
        # from None: a one-line error for the user; the cause adds nothing to it
        raise ConfigError(f"train.{exc} (train.device={config.train.device!r} gives {device.type} here)") from None


def check_before_launch(config: RunConfig, distributed: bool) -> list:
    """Everything that can be checked before any member is built or any process started; returns the tokenizers."""
    problem = missing_tracker(config.logging.report_to)
    if problem:
        raise ConfigError(problem)
    check_placement(config)
    check_backend(config, resolve_device(config.train.device, 0))
    for i in range(len(config.members)):  # Liger's kernels need a GPU: said before any process starts
        layers.resolve(config.train.layers, member_device(config, i, 0))
    check_generator_placement(config, distributed=distributed)
    return check_members(config)


def check_model(member) -> None:
    """Fail fast on a model the fused path would get wrong: (1) packed sequences must be isolated (two short
    sequences packed in one row give the hidden states they give alone); (2) the model's logits must be
    lm_head(final hidden state), with no soft-capping or scaling that the fused head would leave out."""
    from ftis_kernels import fused_linear_token_logprobs

    body, head = member.body_and_head()
    gen = torch.Generator().manual_seed(0)
    vocab = member.vocab_size
    a, b = torch.randint(0, vocab, (5,), generator=gen), torch.randint(0, vocab, (3,), generator=gen)
    device = member.device
    tolerance = 1e-3 if member.dtype == torch.float32 else 5e-2
    with torch.no_grad():
        # compiled layers run while autograd is on (layers.py): the check runs them as the update does
        with torch.set_grad_enabled(layers.compiled(member.model)), member.autocast():
            alone = torch.cat([body(input_ids=x[None].to(device), use_cache=False).last_hidden_state[0].detach()
                               for x in (a, b)])
            packed = body(input_ids=torch.cat([a, b])[None].to(device),
                          position_ids=torch.cat([torch.arange(5), torch.arange(3)])[None].to(device),
                          use_cache=False).last_hidden_state[0].detach()
        error = float((packed.float() - alone.float()).abs().max() / alone.float().abs().max().clamp(min=1e-6))
        if error > tolerance:
            import transformers

            raise ConfigError(
                f"members.{member.index}.model: packed sequences are not isolated by transformers "
                f"{transformers.__version__} with attn_implementation={member.causal_lm.config._attn_implementation} "
                f"(relative error {error:.3g}); use a transformers version that detects packing from position_ids"
            )
        if member.shared_prompt:
            check_shared_prompt(member, a, b, tolerance)
        with member.autocast():
            logits = member.causal_lm(input_ids=a[None].to(device), use_cache=False).logits[0].float()
            fused = fused_linear_token_logprobs(alone[:5], head.weight, b[:1].repeat(5).to(device), bias=head.bias)
        expected = torch.log_softmax(logits, -1).gather(1, b[:1].repeat(5)[:, None].to(device)).squeeze(1)
    gap = float((fused - expected).abs().max())
    if gap > (1e-3 if member.dtype == torch.float32 else 0.1):
        raise ConfigError(
            f"members.{member.index}.model: its logits are not lm_head(hidden) (log-prob gap {gap:.3g}; soft-capping "
            "or logit scaling?): the fused loss would score tokens differently from the model that samples them"
        )


def check_shared_prompt(member, prompt: torch.Tensor, completion: torch.Tensor, tolerance: float) -> None:
    """(3) train.shared_prompt: two completions after one copy of a prompt, each attending to it through the mask,
    give the hidden states the packed row gives them (a model whose attention ignores a 4D mask would not)."""

    items = [TrainItem(Rollout(member=0, prompt_index=0, completion_ids=ids.to(torch.int32),
                               gen_logprobs=torch.full((ids.numel(),), -1.0), reward=0.0, finish_reason="length",
                               policy_version=0), prompt.tolist(), 0.0, 0)
             for ids in (completion, completion.flip(0))]
    with torch.set_grad_enabled(layers.compiled(member.model)):
        packed = packed_hidden(member, pack(items)).detach().float()
        shared = packed_hidden(member, pack(items, shared_prompt=True)).detach().float()
    error = float((shared - packed).abs().max() / packed.abs().max().clamp(min=1e-6))
    if error > tolerance:
        raise ConfigError(
            f"members.{member.index}.model: the shared-prompt row does not give the packed row's hidden states with "
            f"attn_implementation={member.causal_lm.config._attn_implementation} (relative error {error:.3g}); set "
            "train.shared_prompt=false"
        )
