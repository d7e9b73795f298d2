"""How a member's decoder layers run (`train.layers`): as transformers writes them (`eager`), with Liger-Kernel's
fused Triton RMSNorm and SwiGLU (`liger`), compiled one layer at a time with torch.compile (`compile`,
regional compilation), or both (`liger+compile`). The fused loss head is ours in every case.

- Liger patches this model instance's norms and MLPs, nothing else: Liger's own patch functions also replace the
  model family's classes and RoPE function module-wide (every model of the family built or run later in the process
  would change, an eager member or benchmark row too), so fuse() puts the module back as it found it, and Liger's
  RoPE, which exists only as such a module-wide swap, is not used. The parameters and their names do not change:
  checkpoints stay plain HF models.
- Compilation covers what the update runs: a decoder layer's forward is compiled and used while autograd is on (the
  update's forward, and its recompute in backward); without grad (generation with a KV cache, the log-prob passes)
  the layer runs eagerly, so `model.generate` never traces cache objects. One compiled function serves every layer
  of a class (torch.compile inlines the module's parameters as inputs), so it compiles once, not once per layer.
- `auto` is `eager` until a GPU measurement says which is faster (benchmarks/update.py --layers; issue 27).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import sys
import types
import typing

import torch

from ..config import ConfigError, TrainSettings

CHOICES = typing.get_args(TrainSettings.model_fields["layers"].annotation)
FIELD = "train.layers"


def resolve(choice: str, device: torch.device) -> str:
    """The setting a member runs with: `auto` resolved, and what it needs checked (exit 2 naming train.layers)."""
    if choice not in CHOICES:
        raise ConfigError(f"{FIELD}: {choice!r} is not one of {', '.join(CHOICES)}")
    if choice == "auto":  # measured on an H100 (benchmarks/results/update_step.json): compile 1.23-1.24x eager
        return "compile" if device.type == "cuda" else "eager"
    if "liger" in choice:
        if importlib.util.find_spec("liger_kernel") is None:
            raise ConfigError(f"{FIELD}: {choice} needs the liger-kernel package (pip install liger-kernel, or "
                              "pip install '.[gpu]')")
        if device.type != "cuda":  # they do not run in Triton's CPU interpreter either
            raise ConfigError(f"{FIELD}: {choice} runs Liger-Kernel's Triton kernels on a CUDA GPU; this member is "
                              f"on {device}")
    return choice


def _causal_lm(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def find_decoder_layers(model) -> list[torch.nn.Module] | None:
    """The decoder layers of a causal LM (or of the model a LoRA wrapper holds): its decoder's `layers`
    (`get_decoder()`, else `<base model>.layers`: Llama, Qwen, Mistral and their kin); None where it has none.
    The one rule for every user (compilation here, FSDP2 sharding in fsdp.py)."""
    causal_lm = _causal_lm(model)
    decoder = causal_lm.get_decoder() if hasattr(causal_lm, "get_decoder") else \
        getattr(causal_lm, causal_lm.base_model_prefix, causal_lm)
    layers = getattr(decoder, "layers", None)
    return None if layers is None else list(layers)


def decoder_layers(model) -> list[torch.nn.Module]:
    """find_decoder_layers, or a ConfigError naming train.layers where there are none."""
    layers = find_decoder_layers(model)
    if layers is None:
        raise ConfigError(f"{FIELD}: cannot find the decoder layers of {type(_causal_lm(model)).__name__}")
    return layers


def fuse(model, choice: str) -> None:
    """Liger's RMSNorm and SwiGLU on `model` alone (before LoRA wraps it) when `choice` asks for them."""
    if "liger" not in choice:
        return
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type = model.config.model_type
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply is None:
        raise ConfigError(f"{FIELD}: Liger-Kernel has no kernels for model type {model_type!r}")
    wanted = {"rope": False, "rms_norm": True, "swiglu": True, "cross_entropy": False,
              "fused_linear_cross_entropy": False}
    accepted = inspect.signature(apply).parameters
    family = sys.modules[type(_causal_lm(model)).__module__]
    before = dict(vars(family))
    try:
        apply(model=model, **{k: v for k, v in wanted.items() if k in accepted})
    finally:  # the instance keeps its patched norms and MLPs; the family's module is as it was
        for name, value in list(vars(family).items()):
            if name not in before:
                delattr(family, name)
            elif value is not before[name]:
                setattr(family, name, before[name])


# Variants a process may need of the one compiled layer function: members of different shapes, full and LoRA (whose
# layer inputs do not require grad), packed rows and the start-up check's single sequences, with and without recompute.
RECOMPILE_LIMIT = 64


@functools.cache
def _compiled(forward):
    """One compiled function per layer class, with dynamic sequence lengths (packed rows differ every step)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
    return torch.compile(forward, dynamic=True)


def _grad_compiled_forward(self, *args, **kwargs):
    forward = type(self).forward
    if torch.is_grad_enabled():
        return _compiled(forward)(self, *args, **kwargs)
    return forward(self, *args, **kwargs)


def compile_layers(model, choice: str) -> None:
    """Regional compilation of `model`'s decoder layers (after LoRA and checkpointing are set up) when `choice`
    asks for it. A bound method, so a deep copy of the model (a sampling replica) calls its own layers."""
    if "compile" not in choice:
        return
    for layer in decoder_layers(model):
        layer.forward = types.MethodType(_grad_compiled_forward, layer)


def compiled(model) -> bool:
    """Whether compile_layers() compiled `model`'s layers (False for a model whose layers it cannot find)."""
    return any(getattr(layer.forward, "__func__", None) is _grad_compiled_forward for layer in find_decoder_layers(model) or [])
