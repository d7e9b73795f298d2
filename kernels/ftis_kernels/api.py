"""Public functions of ftis_kernels: backend choice, the calls and the nn.Module wrappers (their inputs are
validated by checks.py)."""

from __future__ import annotations

import dataclasses
import os

import torch

from .checks import (
    check_count,
    check_device,
    check_finite_logprobs,
    check_inputs,
    check_linear,
    check_matrix,
    check_targets,
    check_temperature,
    require_tensor,
)
from .config import OPTIONAL_INPUTS, LossConfig, LossInputs, LossOutput
from .epilogue import ftis_objective
from .reference import chunked_token_logprobs

BACKENDS = ("auto", "triton", "torch")


# ----------------------------------------------------------------------------------------------- options


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """auto -> triton on CUDA, torch otherwise. Triton on CPU needs TRITON_INTERPRET=1 (set before import)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: unknown value {backend!r}; expected one of {', '.join(BACKENDS)}")
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError):
        raise ValueError(f"device: not a torch device: {device!r}") from None
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"backend: 'triton' needs CUDA tensors (got {device.type}); on CPU set TRITON_INTERPRET=1 before "
            "triton is imported, or use backend='torch'"
        )
    return backend


def _autocast_operands(device: torch.device, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Inside an autocast region the fused-linear op takes its matrix operands (hidden, weight, bias) as a linear
    layer there would: in autocast's dtype (a float32 master weight's cast keeps its gradient path). Its arithmetic
    stays float32 either way: the op runs with autocast off."""
    if not torch.is_autocast_enabled(device.type):
        return tensors
    dtype = torch.get_autocast_dtype(device.type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in (torch.float32, torch.float16,
                                                                            torch.bfloat16) else t for t in tensors)


_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(LossConfig))


def _split_options(targets, gen_logprobs, advantages, cu_seqlens, options: dict) -> tuple[LossInputs, dict]:
    """The call's LossInputs (the required four and the optional inputs among `options`), and the rest of
    `options`: LossConfig overrides (an unknown keyword is refused here, naming both kinds it could have been)."""
    unknown = sorted(k for k in options if k not in OPTIONAL_INPUTS and k not in _CONFIG_FIELDS)
    if unknown:
        raise ValueError(f"{unknown[0]}: neither an input of the loss ({', '.join(OPTIONAL_INPUTS)}) nor a LossConfig "
                        "field")
    optional = {k: v for k, v in options.items() if k in OPTIONAL_INPUTS}
    overrides = {k: v for k, v in options.items() if k not in OPTIONAL_INPUTS}
    return LossInputs(targets, gen_logprobs, advantages, cu_seqlens, **optional), overrides


def _only_inputs(options: dict) -> dict:
    """A module's keyword arguments: inputs only (its LossConfig is its own)."""
    other = sorted(set(options) - set(OPTIONAL_INPUTS))
    if other:
        raise ValueError(f"{other[0]}: not an input of the loss (inputs: {', '.join(OPTIONAL_INPUTS)}); a module's "
                        "loss options are its config's")
    return options


def _resolve_config(config: LossConfig | None, overrides: dict) -> LossConfig:
    if config is None:
        config = LossConfig()
    elif not isinstance(config, LossConfig):
        raise TypeError(f"config: expected a LossConfig, got {type(config).__name__}")
    return config.replace(**overrides) if overrides else config


# ----------------------------------------------------------------------------------------------- vocabulary pass


def _token_logprobs(x, weight, bias, targets, counted, temperature: float, backend: str):
    if backend == "triton":
        from .backward import TritonTokenLogprobs

        return TritonTokenLogprobs.apply(x, weight, bias, targets, counted, float(temperature), None)
    return chunked_token_logprobs(x, weight, bias, targets, counted, temperature)


def _loss(x, x_name, weight, bias, inputs: LossInputs, counted, cfg, backend) -> LossOutput:
    check_count("num_sequences", inputs.num_sequences, inputs.advantages.numel(), "sequences")
    if inputs.num_tokens is not None:
        check_count("num_tokens", inputs.num_tokens, int(counted.sum()), "counted tokens")
    logprobs, entropy = _token_logprobs(x, weight, bias, inputs.targets, counted, cfg.temperature, backend)
    check_finite_logprobs(x, x_name, counted, logprobs)
    loss, (sums, counts), per_sequence = ftis_objective(logprobs, entropy, counted, inputs, cfg)
    stats = {k: sums[k] / torch.clamp(counts[k], min=1).to(sums[k].dtype) for k in sums}
    return LossOutput(loss=loss, logprobs=logprobs.detach(), stats=stats, stat_sums=sums, stat_counts=counts,
                      sequences=per_sequence)


# ----------------------------------------------------------------------------------------------- public API


def ftis_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    gen_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    config: LossConfig | None = None,
    backend: str = "auto",
    **options,
) -> LossOutput:
    """F-TIS loss of packed completions from logits.

    logits: [N, V] bf16/fp16/fp32 (fp64 on the torch backend); row j predicts targets[j].
    targets, gen_logprobs, advantages, cu_seqlens and the optional inputs in `options` (old_logprobs, group_ids,
    num_sequences, num_tokens, gen_seq_logprobs, ref_logprobs; hacpo's is_self, gen_seq_tokens, capability_ratio,
    mini_batch_index): as LossInputs documents them.
    config / the other `options`: LossConfig and field overrides (e.g. method="tis").
    backend: "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "torch" (chunked PyTorch), "auto".
    Returns LossOutput(loss, logprobs, stats, stat_sums, stat_counts); `combine_stats` merges micro-batches'
    stats. NaN or inf in the logits raises ValueError. The gradient w.r.t. logits is the only N x V allocation.
    """
    inputs, overrides = _split_options(targets, gen_logprobs, advantages, cu_seqlens, options)
    cfg = _resolve_config(config, overrides)
    require_tensor("logits", logits)
    check_device("logits", logits)
    backend = resolve_backend(backend, logits.device)
    check_matrix("logits", logits, backend)
    counted = check_inputs(logits, "logits", logits.shape[1], inputs, cfg, backend)
    with torch.autocast(logits.device.type, enabled=False):  # the logits as given; arithmetic float32
        return _loss(logits, "logits", None, None, inputs, counted, cfg, backend)


def fused_linear_ftis_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    gen_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    config: LossConfig | None = None,
    backend: str = "auto",
    **options,
) -> LossOutput:
    """F-TIS loss of packed completions from hidden states and the lm_head, without any N x V tensor.

    hidden: [N, d]; weight: [V, d] (the lm_head / tied embedding); bias: [V] or None; all the same dtype,
    bf16/fp16/fp32 (fp64 on the torch backend). Other arguments as in `ftis_loss` (the inputs: LossInputs).
    The loss is differentiable w.r.t. hidden, weight and bias (gradients only for those that require them).
    NaN or inf in hidden, weight or bias raises ValueError (found through the log-probs, at no extra pass).
    Inside an autocast region the three are first cast to autocast's dtype, as a linear layer's would be (float32
    master weights under bf16 autocast: a bf16 head, gradients back in float32); the arithmetic stays float32.
    """
    inputs, overrides = _split_options(targets, gen_logprobs, advantages, cu_seqlens, options)
    cfg = _resolve_config(config, overrides)
    backend = _linear_operands(hidden, weight, backend)
    hidden, weight, bias = _autocast_operands(hidden.device, hidden, weight, bias)
    check_linear(hidden, weight, bias, backend)
    counted = check_inputs(hidden, "hidden", weight.shape[0], inputs, cfg, backend)
    with torch.autocast(hidden.device.type, enabled=False):
        return _loss(hidden, "hidden", weight, bias, inputs, counted, cfg, backend)


@torch.no_grad()
def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T)[j, targets[j]] as [N] fp32, without materialising log_softmax. No gradient.
    NaN or inf in the logits raises NonFiniteInputError (a ValueError), as the loss does."""
    temperature = check_temperature(temperature)
    require_tensor("logits", logits)
    check_device("logits", logits)
    backend = resolve_backend("auto", logits.device)
    check_matrix("logits", logits, backend)
    counted = check_targets(targets, logits.shape[0], logits.shape[1], "logits", logits.device, None)
    with torch.autocast(logits.device.type, enabled=False):
        logprobs = _token_logprobs(logits, None, None, targets, counted, temperature, backend)[0]
    check_finite_logprobs(logits, "logits", counted, logprobs)  # NaN or inf in the logits, named as the loss does
    return logprobs.float()


@torch.no_grad()
def fused_linear_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """log_softmax((hidden @ weight^T + bias) / T)[j, targets[j]] as [N] fp32, with no N x V tensor. No gradient.
    Under autocast, hidden, weight and bias are cast to its dtype first (as in fused_linear_ftis_loss). NaN or inf in
    hidden, weight or bias raises NonFiniteInputError (a ValueError), as the loss does."""
    temperature = check_temperature(temperature)
    backend = _linear_operands(hidden, weight, "auto")
    hidden, weight, bias = _autocast_operands(hidden.device, hidden, weight, bias)
    check_linear(hidden, weight, bias, backend)
    counted = check_targets(targets, hidden.shape[0], weight.shape[0], "hidden", hidden.device, None)
    with torch.autocast(hidden.device.type, enabled=False):
        logprobs = _token_logprobs(hidden, weight, bias, targets, counted, temperature, backend)[0]
    check_finite_logprobs(hidden, "hidden", counted, logprobs)
    return logprobs.float()


def _linear_operands(hidden, weight, backend: str) -> str:
    """hidden and weight are tensors on devices the op computes on; returns the backend for hidden's device."""
    require_tensor("hidden", hidden)
    check_device("hidden", hidden)
    require_tensor("weight", weight)
    check_device("weight", weight)
    return resolve_backend(backend, hidden.device)


# ----------------------------------------------------------------------------------------------- modules


class FTISLoss(torch.nn.Module):
    """nn.Module form of `ftis_loss`: holds a LossConfig and a backend; forward returns LossOutput."""

    def __init__(self, config: LossConfig | None = None, backend: str = "auto"):
        super().__init__()
        self.config = _resolve_config(config, {})
        if backend not in BACKENDS:
            raise ValueError(f"backend: unknown value {backend!r}; expected one of {', '.join(BACKENDS)}")
        self.backend = backend

    def forward(self, logits, targets, gen_logprobs, advantages, cu_seqlens, **inputs) -> LossOutput:
        """As ftis_loss, with this module's config and backend; inputs: LossInputs' optional fields."""
        return ftis_loss(logits, targets, gen_logprobs, advantages, cu_seqlens, config=self.config,
                         backend=self.backend, **_only_inputs(inputs))


class FusedLinearFTISLoss(FTISLoss):
    """nn.Module form of `fused_linear_ftis_loss`: forward(hidden, weight, targets, ..., bias=None)."""

    def forward(self, hidden, weight, targets, gen_logprobs, advantages, cu_seqlens, bias=None, **inputs
                ) -> LossOutput:
        """As fused_linear_ftis_loss, with this module's config and backend; inputs: LossInputs' optional fields."""
        return fused_linear_ftis_loss(hidden, weight, targets, gen_logprobs, advantages, cu_seqlens, bias=bias,
                                      config=self.config, backend=self.backend, **_only_inputs(inputs))
