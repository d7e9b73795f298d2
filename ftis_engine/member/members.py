"""A Member = model (+ LoRA) + tokenizer + optimizer + generator, on one device.

Precision (precision.py): trainable parameters and the optimizer's states are float32 master weights; the forward
and backward passes run in the member's compute dtype (members.N.dtype) under autocast; a LoRA member's frozen
base is held in the compute dtype."""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass, field

import torch

from ..config import ConfigError, MemberSettings, RunConfig
from ..core.errors import first_line
from ..generation import Generator
from ..generation.hf import HFGenerator
from ..generation.vllm import VLLMGenerator
from ..model import attention, layers, precision
from ..model.fsdp import Shard, broadcast_weights, replica, shard_model
from ..model.models import ModelSpecError, load_model, load_tokenizer
from ..model.warmstart import warm_start
from ..topology.schedule import mix_seed


@dataclass
class Member:
    index: int
    settings: MemberSettings
    model: torch.nn.Module  # a transformers PreTrainedModel, or a peft PeftModel around one
    tokenizer: object
    optimizer: torch.optim.Optimizer | None  # None only while a member built for a shard awaits shard_member
    generator: Generator
    device: torch.device
    dtype: torch.dtype  # the compute dtype (members.N.dtype); trainable parameters are float32 whatever it is
    shard: Shard = field(default_factory=Shard.whole)  # this rank's part of it (a one-rank member: Shard.whole())
    policy: torch.nn.Module | None = None  # fsdp.ShardedPolicy: the FSDP2 root the update runs through
    reference: torch.nn.Module | None = None  # algorithm.beta > 0, full member: a frozen copy of its initial weights
    shared_prompt: bool = False  # the update packs a group's prompt once (train.shared_prompt, where the attention can)

    @property
    def name(self) -> str:
        return self.settings.name

    @property
    def leads(self) -> bool:
        """This rank reports the member (and writes its checkpoint): a one-rank member, or a sharded one's leader."""
        return self.shard.leader

    @property
    def causal_lm(self):
        """The transformers model underneath a possible peft wrapper (LoRA layers injected in place)."""
        return self.model.get_base_model() if self.settings.lora is not None else self.model

    def body_and_head(self):
        """(decoder body returning last_hidden_state, lm_head module). Tied embeddings share the head's weight."""
        lm = self.causal_lm
        return lm.get_decoder(), lm.get_output_embeddings()

    @property
    def vocab_size(self) -> int:
        """Rows of the lm_head: the token ids the loss accepts (may exceed the tokenizer's length)."""
        return int(self.causal_lm.get_output_embeddings().weight.shape[0])

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return trainable_parameters(self.model)

    def autocast(self):
        """The context every forward pass of the member runs in: autocast to its compute dtype (none for float32)."""
        return precision.autocast(self.device, self.dtype)


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What a member trains (and pushes to its samplers): every parameter, or a LoRA member's adapter."""
    return [p for p in model.parameters() if p.requires_grad]


def resolve_dtype(settings: MemberSettings, device: torch.device) -> torch.dtype:
    """The member's compute dtype (its parameters stay float32 masters)."""
    return precision.compute_dtype(settings.dtype, device)


def attention_implementation(choice: str, device: torch.device) -> str:
    if choice == "auto":  # on a GPU: flash-attn where installed, else torch's own FlashAttention kernel (2.1x sdpa's
        # update on an H100, update_step.json) where this torch has it; sdpa otherwise
        if device.type != "cuda":
            return "sdpa"
        if importlib.util.find_spec("flash_attn") is not None:
            return "flash_attention_2"
        choice = attention.NAME if attention.available() else "sdpa"
    if choice == "varlen":
        available = attention.available()
        if device.type != "cuda" or not available:
            raise ConfigError("train.attn_implementation: varlen runs torch's FlashAttention kernel "
                              "(torch.nn.attention.varlen, torch >= 2.10) on a CUDA GPU; "
                              f"{'this torch has none' if not available else f'this member is on {device}'}")
        attention.register()
    if choice == "flash_attention_2" and (device.type != "cuda" or importlib.util.find_spec("flash_attn") is None):
        raise ConfigError("train.attn_implementation: flash_attention_2 needs the flash-attn package and a CUDA GPU "
                          f"({'pip install flash-attn' if device.type == 'cuda' else f'this member is on {device}'}); "
                          "auto picks what this machine has")
    if choice == "flex_attention" and device.type != "cuda":
        raise ConfigError(f"train.attn_implementation: flex_attention runs on a CUDA GPU (this member is on "
                          f"{device}); auto picks sdpa here")
    return choice


# the attention implementations that take the shared-prompt row's [1, 1, T, T] mask as transformers passes it
MASKED_ATTENTION = ("sdpa", "eager")


def enable_checkpointing(model) -> None:
    """Recompute each layer's activations in backward, non-reentrant (transformers >= 5.2x names it activation
    checkpointing; older releases gradient checkpointing)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def load_member_tokenizer(config: RunConfig, index: int):
    """members.N's tokenizer (its own, or members.N.tokenizer); a ConfigError naming the field."""
    member = config.members[index]
    try:
        return load_tokenizer(member.tokenizer or member.model)
    except ModelSpecError as exc:
        field_name = "tokenizer" if member.tokenizer else "model"
        # from None: a one-line error for the user; the cause adds nothing to it
        raise ConfigError(f"members.{index}.{field_name}: {exc}") from None


def check_warm_start(index: int, settings: MemberSettings, task) -> None:
    """The task must offer demonstrations in the member's warm-start style."""
    if settings.warm_start is None:
        return
    if task is None or task.demonstrations is None:
        raise ConfigError(f"members.{index}.warm_start: task {getattr(task, 'name', None)!r} has no demonstrations "
                          "(arith has)")
    try:
        task.demonstrations(settings.warm_start.style, 0, 0)
    except ValueError as exc:
        # from None: a one-line error for the user; the cause adds nothing to it
        raise ConfigError(f"members.{index}.warm_start.style: {exc}") from None


def make_optimizer(settings: MemberSettings, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """Adam(W) over the member's trainable parameters, its states in their master dtype (precision.py)."""
    return precision.make_optimizer(params, settings.optimizer, settings.lr, tuple(settings.betas),
                                    settings.weight_decay, precision.master_dtype(settings.master_dtype))


def shard_member(member: Member, shard: Shard, config: RunConfig) -> None:
    """Spread a member built for its shards (build_member(..., sharded=True)) and restored over its ranks: FSDP2
    over its model, then its optimizer over the shards (built once, here), and for the HF generator a plain
    replica of the leader's weights to sample from (vLLM engines hold their own weights and take them gathered,
    one tensor at a time)."""
    if member.optimizer is not None:
        raise ValueError(f"members.{member.index}: build it with build_member(..., sharded=True) to shard it")
    if not shard.sharded:  # FSDP2 over one part would be saved and updated as a whole member's
        raise ValueError(f"members.{member.index}: a shard of one part (Shard.whole()) is the whole member")
    settings = config.members[member.index]
    broadcast_weights(member.model, shard)  # every shard starts from the leader's bits (a GPU warm start may differ)
    if settings.generator == "hf":
        member.generator = HFGenerator(replica(member.model), member.tokenizer, member.device,
                                       batch_size=config.rollout.generation_batch_size, replica=True,
                                       dtype=member.dtype)
    member.policy = shard_model(member.index, member.model, member.causal_lm, shard, member.device, member.dtype)
    member.optimizer = make_optimizer(settings, trainable_parameters(member.model))
    member.shard = shard
    member.generator.sync(member.model)  # a vLLM engine's weights from now on come gathered from the shards


def check_lora_rank(index: int, lora, model: torch.nn.Module) -> None:
    """A LoRA rank above the narrowest side of a layer it adapts adds nothing a full update would not, and a rank
    such as 1e9 would try to allocate hundreds of GB: refused before peft builds anything."""
    targets = set(lora.target_modules)
    widths = [min(m.in_features, m.out_features) for name, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets]
    if widths and lora.r > min(widths):
        raise ConfigError(f"members.{index}.lora.r: {lora.r} exceeds the narrowest layer it adapts ({min(widths)} "
                          "wide); at most that")


def member_init_seed(config: RunConfig, index: int) -> int:
    """The seed of member `index`'s random init and warm start: its `seed`, else the run seed mixed with its
    `seed_offset` (default: its index). Mixed, not added: with run seed + index, member 1 at run seed s started
    from member 0's weights at run seed s + 1, so a study's seeds were not independent replications."""
    settings = config.members[index]
    if settings.seed is not None:
        return settings.seed
    return mix_seed(config.seed, settings.seed_offset if settings.seed_offset is not None else index)


def disable_dropout(model: torch.nn.Module) -> None:
    """Dropout off in the trainer (its forward runs in train mode, for gradient checkpointing): the loss's log-probs
    must be those of the policy that generated, and generation runs without dropout; a model whose config sets
    some (GPT-2 and OPT style: 0.1) would otherwise draw a new mask every forward, biasing every importance weight
    and KL (TRL's disable_dropout does the same)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):  # HF attention reads it in train mode
            module.attention_dropout = 0.0
    for name in ("attention_dropout", "hidden_dropout", "dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop",
                 "hidden_dropout_prob", "attention_probs_dropout_prob"):
        if isinstance(getattr(model.config, name, None), float):
            setattr(model.config, name, 0.0)


def check_lora_head(index: int, model) -> None:
    """The fused loss reads the output head as one plain weight (the model runs without its head): an adapter on
    the head would never be trained, so it is refused rather than left at zero."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    head = model.get_output_embeddings()
    if isinstance(head, BaseTunerLayer):
        name = next((n for n, module in model.named_modules() if module is head), "the output head")
        raise ConfigError(f"members.{index}.lora.target_modules: {name.split('.')[-1]!r} is the output head, which "
                          "the fused loss reads as a plain weight (its adapter would never train); leave it out")


def frozen_reference(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The KL penalty's reference of a full member: a frozen copy of its initial weights that computes as the
    policy does under autocast. Its linear layers are stored in the compute dtype (autocast casts the policy's
    float32 masters to exactly those values for every matmul: half the memory, the same numbers); embeddings,
    norms and the output head (the op casts it as a linear layer) stay in the master dtype, so its residual stream
    runs in float32 as the policy's does and the KL to it is 0 before the first step (a copy cast whole to bf16
    was already 1e-4 away)."""
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    head = reference.get_output_embeddings()
    kept = {id(p) for module in (head, reference.get_input_embeddings()) for p in module.parameters()}
    for module in reference.modules():
        if isinstance(module, torch.nn.Linear) and not any(id(p) in kept for p in module.parameters()):
            module.to(dtype)
    return reference


def draws_on_device(config: RunConfig, index: int) -> bool:
    """Whether a built-in member is drawn on its own device (a GPU: seconds, not the CPU's minute for the 3B shape)
    rather than on the CPU. A GPU's draws depend on the GPU model, so only where the drawn weights are never drawn
    again elsewhere: a full member (a LoRA member's base is redrawn at every resume and eval: checkpoints hold its
    adapter), without a KL reference (beta > 0 copies the draw, never saved), a warm start (its cache is keyed by the
    seed, not the device) or samplers (a sampler generates from its own draw until its learner's first push). A
    member on several ranks starts every shard from its leader's bits (shard_member's broadcast)."""
    settings = config.members[index]
    return (settings.lora is None and config.algorithm.beta == 0 and settings.warm_start is None
            and not settings.samplers)


def build_member(index: int, config: RunConfig, tokenizer, device: torch.device, task=None,
                 trains: bool = True, sharded: bool = False) -> Member:
    """Load the model in float32 (random init for built-ins), warm-start it on the task's demonstrations if asked,
    wrap it in LoRA if asked (the frozen base then in the compute dtype, the adapter float32), build its optimizer
    (over float32 master weights) and generator. trains=False (eval, a sampler rank): no KL reference copy.
    sharded: a member on several ranks: its optimizer is built over the shards, by shard_member once the weights are
    restored."""
    settings = config.members[index]
    dtype = resolve_dtype(settings, device)
    master = precision.master_dtype(settings.master_dtype)
    if master != torch.float32 and dtype != master:
        raise ConfigError(f"members.{index}.master_dtype: {settings.master_dtype} masters compute in "
                          f"{settings.master_dtype}; set members.{index}.dtype={settings.master_dtype} (this member "
                          f"computes in {str(dtype).removeprefix('torch.')} on {device})")
    attn = attention_implementation(config.train.attn_implementation, device)
    layer_mode = layers.resolve(config.train.layers, device)
    seed = member_init_seed(config, index)
    try:
        model = load_model(settings.model, len(tokenizer), master, seed, attn,
                           device if draws_on_device(config, index) else None)
    except ModelSpecError as exc:
        # from None: a one-line error for the user; the cause adds nothing to it
        raise ConfigError(f"members.{index}.model: {exc}") from None
    model.to(device)
    if settings.warm_start is not None:
        check_warm_start(index, settings, task)
        warm_start(model, tokenizer, task, settings.warm_start, settings.model, seed, device, dtype)
    layers.fuse(model, layer_mode)
    disable_dropout(model)
    reference = None
    if trains and config.algorithm.beta > 0 and settings.lora is None:  # the KL penalty's reference: initial weights
        reference = frozen_reference(model, dtype)
    if settings.lora is not None:
        from peft import LoraConfig, get_peft_model

        check_lora_rank(index, settings.lora, model)
        lora = LoraConfig(r=settings.lora.r, lora_alpha=settings.lora.alpha, lora_dropout=settings.lora.dropout,
                          target_modules=list(settings.lora.target_modules), task_type="CAUSAL_LM")
        model.to(dtype)  # the frozen base is never stepped: it may be held in the compute dtype
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)  # the adapter's random init (lora_A) is part of the run's seed
                # peft widens bf16 adapters to float32 (autocast_adapter_dtype): they are the master weights
                model = get_peft_model(model, lora, autocast_adapter_dtype=master == torch.float32)
        except ValueError as exc:
            # from None: a one-line error for the user; the cause adds nothing to it
            raise ConfigError(f"members.{index}.lora.target_modules: {first_line(exc)}") from None
        check_lora_head(index, model)
    if config.train.gradient_checkpointing:
        enable_checkpointing(model)
        if settings.lora is not None:
            model.enable_input_require_grads()
    layers.compile_layers(model, layer_mode)
    optimizer = None if sharded else make_optimizer(settings, trainable_parameters(model))
    if settings.generator == "vllm":
        generator = VLLMGenerator(model, tokenizer, device, settings, config, seed)
    else:
        generator = HFGenerator(model, tokenizer, device, batch_size=config.rollout.generation_batch_size,
                                dtype=dtype)
    return Member(index=index, settings=settings, model=model, tokenizer=tokenizer, optimizer=optimizer,
                  generator=generator, device=device, dtype=dtype, reference=reference,
                  shared_prompt=config.train.shared_prompt and attn in MASKED_ATTENTION)
