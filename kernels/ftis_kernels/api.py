"""Public functions of ftis_kernels: input validation, backend choice, and the nn.Module wrappers."""

from __future__ import annotations

import dataclasses
import os

import torch

from .config import OPTIONAL_INPUTS, LossConfig, LossInputs, LossOutput, NonFiniteInputError
from .epilogue import ftis_objective
from .reference import chunked_token_logprobs

BACKENDS = ("auto", "triton", "torch")
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8)


# ----------------------------------------------------------------------------------------------- validation


def _require_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def _check_float(name: str, t: torch.Tensor, backend: str) -> None:
    allowed = _FLOAT_DTYPES + ((torch.float64,) if backend == "torch" else ())
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name}: dtype {t.dtype} is not supported by the {backend} backend (use {names})")


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {list(shape)} ({what}), got {list(t.shape)}")


def _check_finite(name: str, t: torch.Tensor) -> None:
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name}: contains NaN or inf")


def resolve_backend(backend: str, device: torch.device) -> str:
    """auto -> triton on CUDA, torch otherwise. Triton on CPU needs TRITON_INTERPRET=1 (set before import)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: unknown value {backend!r}; expected one of {', '.join(BACKENDS)}")
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


def _check_targets(targets, n: int, vocab: int, x_name: str, device, ignore_index: int | None) -> torch.Tensor:
    """Targets are [N] integer ids in [0, V) or ignore_index; returns the [N] bool mask of counted tokens."""
    _require_tensor("targets", targets)
    if targets.device != device:
        raise ValueError(f"targets: on {targets.device}, but {x_name} is on {device}")
    if targets.dtype not in _ID_DTYPES:
        raise TypeError(f"targets: expected a signed integer tensor (int64 or int32; ignore_index is negative), "
                        f"got {targets.dtype}")
    _check_shape("targets", targets, (n,), f"one target per row of {x_name}")
    counted = targets != ignore_index if ignore_index is not None else torch.ones_like(targets, dtype=torch.bool)
    bad = counted & ((targets < 0) | (targets >= vocab))
    if bool(bad.any()):
        value = int(targets[bad][0])
        allowed = f" and is not ignore_index={ignore_index}" if ignore_index is not None else ""
        raise ValueError(f"targets: id {value} is outside [0, {vocab}){allowed}")
    return counted


def _check_logprobs(name: str, t: torch.Tensor) -> None:
    _check_finite(name, t)
    if bool((t > 0).any()):
        raise ValueError(f"{name}: log-probabilities must be <= 0, found a positive value")


def _check_inputs(x: torch.Tensor, x_name: str, vocab: int, inputs: LossInputs, cfg: LossConfig, backend: str
                  ) -> torch.Tensor:
    """Validate the per-token and per-sequence inputs; returns the [N] bool mask of counted tokens."""
    targets, gen_logprobs, advantages, cu_seqlens = (inputs.targets, inputs.gen_logprobs, inputs.advantages,
                                                     inputs.cu_seqlens)
    old_logprobs, group_ids, gen_seq_logprobs, ref_logprobs = (inputs.old_logprobs, inputs.group_ids,
                                                               inputs.gen_seq_logprobs, inputs.ref_logprobs)
    n = x.shape[0]
    device = x.device
    counted = _check_targets(targets, n, vocab, x_name, device, cfg.ignore_index)
    tensors = {"gen_logprobs": gen_logprobs, "advantages": advantages, "cu_seqlens": cu_seqlens}
    if old_logprobs is not None:
        tensors["old_logprobs"] = old_logprobs
    if ref_logprobs is not None:
        tensors["ref_logprobs"] = ref_logprobs
    elif cfg.beta > 0:
        raise ValueError(f"ref_logprobs: required when beta={cfg.beta!r} > 0 (the reference policy's log-probs of "
                         "the targets)")
    if group_ids is not None:
        tensors["group_ids"] = group_ids
    if gen_seq_logprobs is not None:
        tensors["gen_seq_logprobs"] = gen_seq_logprobs
    for name, t in tensors.items():
        _require_tensor(name, t)
        if t.device != device:
            raise ValueError(f"{name}: on {t.device}, but {x_name} is on {device}")
    for name in ("cu_seqlens",) + (("group_ids",) if group_ids is not None else ()):
        t = tensors[name]
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError(f"{name}: expected an integer tensor, got {t.dtype}")
    per_token = [name for name in ("old_logprobs", "ref_logprobs") if name in tensors]
    for name in ("gen_logprobs", "advantages", *per_token) + (
            ("gen_seq_logprobs",) if gen_seq_logprobs is not None else ()):
        _check_float(name, tensors[name], backend)

    _check_shape("gen_logprobs", gen_logprobs, (n,), f"one per row of {x_name}")
    for name in per_token:
        _check_shape(name, tensors[name], (n,), f"one per row of {x_name}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected a 1-D tensor [S+1] with S >= 1, got shape {list(cu_seqlens.shape)}")
    num_seqs = cu_seqlens.numel() - 1
    _check_shape("advantages", advantages, (num_seqs,), "one per sequence: len(cu_seqlens) - 1")
    if group_ids is not None:
        _check_shape("group_ids", group_ids, (num_seqs,), "one per sequence: len(cu_seqlens) - 1")
    if gen_seq_logprobs is not None:
        _check_shape("gen_seq_logprobs", gen_seq_logprobs, (num_seqs,), "one per sequence: len(cu_seqlens) - 1")
        given = gen_seq_logprobs[~torch.isnan(gen_seq_logprobs)]
        if not bool(torch.isfinite(given).all()) or bool((given > 0).any()):
            raise ValueError("gen_seq_logprobs: a sequence's log-probability must be finite and <= 0 (NaN: the "
                             "sequence has per-token gen_logprobs)")

    cu = cu_seqlens.long()
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens: cu_seqlens[0] must be 0, got {int(cu[0])}")
    steps = cu[1:] <= cu[:-1]
    if bool(steps.any()):
        i = int(steps.nonzero()[0, 0]) + 1
        raise ValueError(f"cu_seqlens: must increase strictly (every sequence has at least one token), but "
                         f"cu_seqlens[{i}]={int(cu[i])} <= cu_seqlens[{i - 1}]={int(cu[i - 1])}")
    if int(cu[-1]) != n:
        raise ValueError(f"cu_seqlens: the last entry must be N={n} (the rows of {x_name}), got {int(cu[-1])}")
    _check_logprobs("gen_logprobs", gen_logprobs)
    for name in per_token:
        _check_logprobs(name, tensors[name])
    _check_finite("advantages", advantages)
    return counted


def _check_matrix(name: str, t, backend: str) -> torch.Tensor:
    _require_tensor(name, t)
    if t.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor, got shape {list(t.shape)}")
    _check_float(name, t, backend)
    return t


# ----------------------------------------------------------------------------------------------- vocabulary pass


def _token_logprobs(x, weight, bias, targets, counted, temperature: float, backend: str):
    if backend == "triton":
        from .backward import TritonTokenLogprobs

        return TritonTokenLogprobs.apply(x, weight, bias, targets, counted, float(temperature), None)
    return chunked_token_logprobs(x, weight, bias, targets, counted, temperature)


def _check_count(name: str, value, own: int, what: str) -> int | None:
    """A whole batch's count passed to a micro-batch call: None, or an int >= this call's own count."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < max(own, 1):
        raise ValueError(f"{name}: must be an int >= this call's {own} {what} (the whole batch's count, of which "
                         f"this call is a part), got {value!r}")
    return value


def _check_finite_logprobs(x: torch.Tensor, x_name: str, counted: torch.Tensor, logprobs: torch.Tensor) -> None:
    """NaN or inf in the inputs of the vocabulary pass: a counted row's log-prob is then not finite (its
    log-sum-exp reads all of weight and bias), so one check of [N] finds it; the rows of ignored targets (whose
    log-prob is 0 by definition, but which a NaN would still turn into NaN gradients) are read directly."""
    names = "logits" if x_name == "logits" else "hidden, weight or bias"
    bad = ~torch.isfinite(logprobs.detach())
    if not bool(counted.all()):
        bad |= ~counted & ~torch.isfinite(x.detach()).all(dim=1)
    if bool(bad.any()):
        raise NonFiniteInputError(f"{names}: contains NaN or inf (it reaches row {int(bad.nonzero()[0, 0])} of "
                                  f"{x_name})")


def _loss(x, x_name, weight, bias, inputs: LossInputs, counted, cfg, backend) -> LossOutput:
    num_sequences = _check_count("num_sequences", inputs.num_sequences, inputs.advantages.numel(), "sequences")
    num_tokens = inputs.num_tokens
    if num_tokens is not None:
        num_tokens = _check_count("num_tokens", num_tokens, int(counted.sum()), "counted tokens")
    logprobs, entropy = _token_logprobs(x, weight, bias, inputs.targets, counted, cfg.temperature, backend)
    _check_finite_logprobs(x, x_name, counted, logprobs)
    loss, (sums, counts), per_sequence = ftis_objective(
        logprobs, entropy, inputs.gen_logprobs, inputs.advantages, inputs.cu_seqlens, counted, cfg,
        inputs.old_logprobs, inputs.group_ids, num_sequences=num_sequences, num_tokens=num_tokens,
        gen_seq_logprobs=inputs.gen_seq_logprobs, ref_logprobs=inputs.ref_logprobs,
    )
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
    num_sequences, num_tokens, gen_seq_logprobs, ref_logprobs): as LossInputs documents them.
    config / the other `options`: LossConfig and field overrides (e.g. method="tis").
    backend: "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "torch" (chunked PyTorch), "auto".
    Returns LossOutput(loss, logprobs, stats, stat_sums, stat_counts); `combine_stats` merges micro-batches'
    stats. NaN or inf in the logits raises ValueError. The gradient w.r.t. logits is the only N x V allocation.
    """
    inputs, overrides = _split_options(targets, gen_logprobs, advantages, cu_seqlens, options)
    cfg = _resolve_config(config, overrides)
    _require_tensor("logits", logits)
    backend = resolve_backend(backend, logits.device)
    _check_matrix("logits", logits, backend)
    counted = _check_inputs(logits, "logits", logits.shape[1], inputs, cfg, backend)
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
    _require_tensor("hidden", hidden)
    backend = resolve_backend(backend, hidden.device)
    _require_tensor("weight", weight)
    hidden, weight, bias = _autocast_operands(hidden.device, hidden, weight, bias)
    _check_linear(hidden, weight, bias, backend)
    counted = _check_inputs(hidden, "hidden", weight.shape[0], inputs, cfg, backend)
    with torch.autocast(hidden.device.type, enabled=False):
        return _loss(hidden, "hidden", weight, bias, inputs, counted, cfg, backend)


def _check_linear(hidden, weight, bias, backend: str) -> None:
    _check_matrix("hidden", hidden, backend)
    _check_matrix("weight", weight, backend)
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight: expected shape [V, {hidden.shape[1]}] to match hidden's d, got {list(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight: dtype {weight.dtype} differs from hidden's {hidden.dtype}")
    if weight.device != hidden.device:
        raise ValueError(f"weight: on {weight.device}, but hidden is on {hidden.device}")
    if bias is not None:
        _require_tensor("bias", bias)
        _check_shape("bias", bias, (weight.shape[0],), "one per vocabulary row of weight")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias: dtype {bias.dtype} differs from hidden's {hidden.dtype}")
        if bias.device != hidden.device:
            raise ValueError(f"bias: on {bias.device}, but hidden is on {hidden.device}")


def _check_temperature(temperature: float) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature < float("inf"):
        raise ValueError(f"temperature: must be a finite number > 0, got {temperature!r}")
    return float(temperature)


@torch.no_grad()
def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T)[j, targets[j]] as [N] fp32, without materialising log_softmax. No gradient."""
    temperature = _check_temperature(temperature)
    _require_tensor("logits", logits)
    backend = resolve_backend("auto", logits.device)
    _check_matrix("logits", logits, backend)
    counted = _check_targets(targets, logits.shape[0], logits.shape[1], "logits", logits.device, None)
    with torch.autocast(logits.device.type, enabled=False):
        return _token_logprobs(logits, None, None, targets, counted, temperature, backend)[0].float()


@torch.no_grad()
def fused_linear_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """log_softmax((hidden @ weight^T + bias) / T)[j, targets[j]] as [N] fp32, with no N x V tensor. No gradient.
    Under autocast, hidden, weight and bias are cast to its dtype first (as in fused_linear_ftis_loss)."""
    temperature = _check_temperature(temperature)
    _require_tensor("hidden", hidden)
    backend = resolve_backend("auto", hidden.device)
    _require_tensor("weight", weight)
    hidden, weight, bias = _autocast_operands(hidden.device, hidden, weight, bias)
    _check_linear(hidden, weight, bias, backend)
    counted = _check_targets(targets, hidden.shape[0], weight.shape[0], "hidden", hidden.device, None)
    with torch.autocast(hidden.device.type, enabled=False):
        return _token_logprobs(hidden, weight, bias, targets, counted, temperature, backend)[0].float()


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
