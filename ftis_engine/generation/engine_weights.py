"""What a vLLM engine loads, computed from the trainer's model without vLLM: the weights under the names vLLM's
loaders expect (a full member's, a LoRA member's base, or its adapted layers merged), streamed in the engine's dtype,
the files an engine that loads from disk reads, and the KV cache a run needs."""

from __future__ import annotations

import pathlib

import torch

from ..model.fsdp import full
from ..model.models import source as model_source
from ..model.saving import save_pretrained

GIB = 1 << 30
LEAST_CPU_KV_CACHE = GIB // 4


def checkpoint_names(model, state: dict) -> dict:
    """The state dict under the checkpoint's weight names, which vLLM's loaders expect: transformers >= 5 renames
    some families' weights on load (e.g. fused MoE experts); older versions keep the checkpoint's names."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return state
    return revert_weight_conversion(model, state)


def save_for_engine(model, tokenizer, directory: pathlib.Path) -> str:
    """Write a model's weights (in its dtype) and its tokenizer where an engine that loads from disk can read them
    (vLLM; also TRL's GRPOTrainer, benchmarks/trl_grpo.py); returns the directory as a string. A LoRA member's
    model (peft) is written as its base alone, under the base model's own names: peft's wrapped layers keep the
    base weight as `<layer>.base_layer.weight`, which no engine's loader knows; the adapter goes to the engine
    separately."""
    if hasattr(model, "peft_config"):
        base = model.get_base_model()
        state = {name.replace(".base_layer.", "."): tensor for name, tensor in base.state_dict().items()
                 if ".lora_" not in name}
        save_pretrained(base, directory, state_dict=state)
    else:
        save_pretrained(model, directory)
    tokenizer.save_pretrained(str(directory))
    return str(directory)


def engine_source(model, tokenizer, settings, directory: pathlib.Path) -> str:
    """Where the engine loads the member's starting weights from: the packaged model's or hub's own files, unless
    the trainer's weights differ from them (a built-in model's random init, or a warm start: the engine would
    otherwise generate step 1's rollouts, and a LoRA member all of them, from weights the trainer does not hold),
    then the trainer's weights written to `directory`."""
    if settings.model.startswith("builtin:") or settings.warm_start is not None:
        return save_for_engine(model, tokenizer, directory)
    return model_source(settings.model)  # a packaged model's folder, or the hub id / local path as given


def engine_weights(named: dict, dtype: torch.dtype):
    """(name, tensor) pairs for the engine's loader, each gathered (a sharded tensor: a collective over its member's
    ranks) and floating ones cast to the engine's dtype as it is taken. A value may be a function that makes the
    tensor (a merged LoRA layer): it is called only when its turn comes."""
    for name, tensor in named.items():
        value = tensor() if callable(tensor) else full(tensor.detach())
        yield name, (value.to(dtype) if value.is_floating_point() else value)


def lora_layers(model) -> dict[str, torch.nn.Module]:
    """A peft model's LoRA-adapted layers by the name of the base weight they adapt (`...q_proj.weight`, the
    base model's own name)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    return {f"{name}.weight": module for name, module in base.named_modules() if isinstance(module, LoraLayer)}


def merged_weight(layer) -> torch.Tensor:
    """An adapted layer's weight as one matrix: base + B A x scale (peft's LoRA delta for a Linear, fan_in_fan_out
    honoured), in float32, from gathered tensors; the trainer's model is only read."""
    (adapter,) = layer.active_adapters
    base = full(layer.get_base_layer().weight.detach()).float()
    delta = full(layer.lora_B[adapter].weight.detach()).float() @ full(layer.lora_A[adapter].weight.detach()).float()
    delta = delta * layer.scaling[adapter]
    if getattr(layer, "fan_in_fan_out", False):
        delta = delta.T
    return base + delta


def merged_state(model) -> dict:
    """What a LoRA member's engine holds when it runs without LoRA: every base weight under the base model's names,
    each adapted one as a function that merges it when the loader takes it (one merged matrix alive at a time)."""
    adapted = lora_layers(model)
    state = {}
    for name, tensor in model.get_base_model().state_dict().items():
        if ".lora_" in name:
            continue
        name = name.replace(".base_layer.", ".")
        layer = adapted.get(name)
        state[name] = (lambda layer=layer: merged_weight(layer)) if layer is not None else tensor
    return state


MOST_SEQUENCES = 256  # vLLM's default max_num_seqs: what an engine runs at once however many a call holds


def kv_cache_bytes(model_config, dtype: torch.dtype, max_len: int, sequences: int) -> int:
    """What an engine's KV cache needs to hold `sequences` sequences (at most MOST_SEQUENCES at once) of `max_len`
    tokens: keys and values of every layer's KV heads, in the engine's dtype; at least LEAST_CPU_KV_CACHE."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    per_token = 2 * model_config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize
    need = per_token * max_len * min(sequences, MOST_SEQUENCES)
    return max(LEAST_CPU_KV_CACHE, -(-need // (GIB // 16)) * (GIB // 16))  # in 1/16 GiB
