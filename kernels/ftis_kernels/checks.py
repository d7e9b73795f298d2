"""Validation of the op's inputs: every bad value is refused where it enters, naming the argument (ValueError, or
TypeError for dtypes), before any arithmetic."""

from __future__ import annotations

import torch

from .config import MAX_COUNT, MIN_TEMPERATURE, LossConfig, LossInputs, NonFiniteInputError

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8)
_PER_SEQUENCE = "one per sequence: len(cu_seqlens) - 1"


def require_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def check_float(name: str, t: torch.Tensor, backend: str) -> None:
    allowed = _FLOAT_DTYPES + ((torch.float64,) if backend == "torch" else ())
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name}: dtype {t.dtype} is not supported by the {backend} backend (use {names})")


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {list(shape)} ({what}), got {list(t.shape)}")


def check_finite(name: str, t: torch.Tensor) -> None:
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name}: contains NaN or inf")


def check_device(name: str, t: torch.Tensor | None) -> None:
    """A tensor the op computes on: on a device that holds values and that torch's autocast knows (cpu, cuda, and
    the like); a meta tensor holds no values."""
    if t is not None and (t.device.type == "meta" or not torch.amp.is_autocast_available(t.device.type)):
        raise ValueError(f"{name}: on the {t.device.type} device, which holds no values the op can compute on "
                         "(move it to cpu or cuda)")


def check_integer(name: str, t: torch.Tensor) -> None:
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor, got {t.dtype}")


def check_targets(targets, n: int, vocab: int, x_name: str, device, ignore_index: int | None) -> torch.Tensor:
    """Targets are [N] integer ids in [0, V) or ignore_index; returns the [N] bool mask of counted tokens."""
    require_tensor("targets", targets)
    if targets.device != device:
        raise ValueError(f"targets: on {targets.device}, but {x_name} is on {device}")
    if targets.dtype not in _ID_DTYPES:
        raise TypeError(f"targets: expected a signed integer tensor (int64 or int32; ignore_index is negative), "
                        f"got {targets.dtype}")
    check_shape("targets", targets, (n,), f"one target per row of {x_name}")
    counted = targets != ignore_index if ignore_index is not None else torch.ones_like(targets, dtype=torch.bool)
    bad = counted & ((targets < 0) | (targets >= vocab))
    if bool(bad.any()):
        value = int(targets[bad][0])
        allowed = f" and is not ignore_index={ignore_index}" if ignore_index is not None else ""
        raise ValueError(f"targets: id {value} is outside [0, {vocab}){allowed}")
    return counted


def check_logprobs(name: str, t: torch.Tensor) -> None:
    check_finite(name, t)
    if bool((t > 0).any()):
        raise ValueError(f"{name}: log-probabilities must be <= 0, found a positive value")


def check_inputs(x: torch.Tensor, x_name: str, vocab: int, inputs: LossInputs, cfg: LossConfig, backend: str
                  ) -> torch.Tensor:
    """Validate the per-token and per-sequence inputs; returns the [N] bool mask of counted tokens."""
    targets, gen_logprobs, advantages, cu_seqlens = (inputs.targets, inputs.gen_logprobs, inputs.advantages,
                                                     inputs.cu_seqlens)
    old_logprobs, group_ids, gen_seq_logprobs, ref_logprobs = (inputs.old_logprobs, inputs.group_ids,
                                                               inputs.gen_seq_logprobs, inputs.ref_logprobs)
    n = x.shape[0]
    device = x.device
    counted = check_targets(targets, n, vocab, x_name, device, cfg.ignore_index)
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
    hacpo = {name: getattr(inputs, name) for name in ("is_self", "gen_seq_tokens", "capability_ratio")}
    if cfg.method == "hacpo" and hacpo["is_self"] is None:
        raise ValueError("is_self: required by hacpo ([S] bool: which sequences are the learner's own)")
    tensors.update({name: t for name, t in hacpo.items() if t is not None})
    for name, t in tensors.items():
        require_tensor(name, t)
        if t.device != device:
            raise ValueError(f"{name}: on {t.device}, but {x_name} is on {device}")
    for name in ("cu_seqlens", "group_ids", "gen_seq_tokens"):
        if name in tensors:
            check_integer(name, tensors[name])
    if "is_self" in tensors and tensors["is_self"].dtype != torch.bool:
        raise TypeError(f"is_self: expected a bool tensor, got {tensors['is_self'].dtype}")
    per_token = [name for name in ("old_logprobs", "ref_logprobs") if name in tensors]
    for name in ("gen_logprobs", "advantages", *per_token, "gen_seq_logprobs", "capability_ratio"):
        if name in tensors:
            check_float(name, tensors[name], backend)

    check_shape("gen_logprobs", gen_logprobs, (n,), f"one per row of {x_name}")
    for name in per_token:
        check_shape(name, tensors[name], (n,), f"one per row of {x_name}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected a 1-D tensor [S+1] with S >= 1, got shape {list(cu_seqlens.shape)}")
    num_seqs = cu_seqlens.numel() - 1
    check_shape("advantages", advantages, (num_seqs,), "one per sequence: len(cu_seqlens) - 1")
    for name in ("group_ids", "gen_seq_logprobs", "is_self", "gen_seq_tokens", "capability_ratio"):
        if name in tensors:
            check_shape(name, tensors[name], (num_seqs,), _PER_SEQUENCE)
    if gen_seq_logprobs is not None:
        given = gen_seq_logprobs[~torch.isnan(gen_seq_logprobs)]
        if not bool(torch.isfinite(given).all()) or bool((given > 0).any()):
            raise ValueError("gen_seq_logprobs: a sequence's log-probability must be finite and <= 0 (NaN: the "
                             "sequence has per-token gen_logprobs)")
    check_hacpo_inputs(cfg, inputs)

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
    check_logprobs("gen_logprobs", gen_logprobs)
    for name in per_token:
        check_logprobs(name, tensors[name])
    check_finite("advantages", advantages)
    return counted


def check_hacpo_inputs(cfg: LossConfig, inputs: LossInputs) -> None:
    """hacpo's own inputs (LossInputs), their shapes, dtypes and devices checked: counts behind every foreign
    sequence's log-prob (required by hacpo), capability ratios finite and > 0, the mini-batch index an int."""
    index = inputs.mini_batch_index
    if index is not None and (isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= MAX_COUNT):
        raise ValueError(f"mini_batch_index: must be an int in [0, 2**53] (the step's optimizer step, from 0), got "
                         f"{index!r}")
    ratio = inputs.capability_ratio
    if ratio is not None and (not bool(torch.isfinite(ratio).all()) or bool((ratio <= 0).any())):
        raise ValueError("capability_ratio: must be finite and > 0 (a peer's capability over the learner's)")
    gen_seq, counts = inputs.gen_seq_logprobs, inputs.gen_seq_tokens
    foreign = None if gen_seq is None else ~torch.isnan(gen_seq)
    if cfg.method == "hacpo" and foreign is not None and bool(foreign.any()):
        if counts is None:
            raise ValueError("gen_seq_tokens: required by hacpo where gen_seq_logprobs is finite (the generator's "
                             "token count its source mean divides by)")
        if bool((counts[foreign] < 1).any()):
            raise ValueError("gen_seq_tokens: must be >= 1 where gen_seq_logprobs is finite (a sequence has a "
                             "token)")


def check_matrix(name: str, t, backend: str) -> torch.Tensor:
    require_tensor(name, t)
    if t.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor, got shape {list(t.shape)}")
    check_float(name, t, backend)
    return t


def check_count(name: str, value, own: int, what: str) -> int | None:
    """A whole batch's count passed to a micro-batch call: None, or an int >= this call's own count."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not max(own, 1) <= value <= MAX_COUNT:
        raise ValueError(f"{name}: must be an int >= this call's {own} {what} and <= 2**53 (the whole batch's "
                         f"count, of which this call is a part), got {value!r}")
    return value


def check_finite_logprobs(x: torch.Tensor, x_name: str, counted: torch.Tensor, logprobs: torch.Tensor) -> None:
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


def check_linear(hidden, weight, bias, backend: str) -> None:
    check_matrix("hidden", hidden, backend)
    check_matrix("weight", weight, backend)
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight: expected shape [V, {hidden.shape[1]}] to match hidden's d, got {list(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight: dtype {weight.dtype} differs from hidden's {hidden.dtype}")
    if weight.device != hidden.device:
        raise ValueError(f"weight: on {weight.device}, but hidden is on {hidden.device}")
    if bias is not None:
        require_tensor("bias", bias)
        check_device("bias", bias)
        check_shape("bias", bias, (weight.shape[0],), "one per vocabulary row of weight")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias: dtype {bias.dtype} differs from hidden's {hidden.dtype}")
        if bias.device != hidden.device:
            raise ValueError(f"bias: on {bias.device}, but hidden is on {hidden.device}")


def check_temperature(temperature: float) -> float:
    """The same bound as LossConfig.temperature (config.MIN_TEMPERATURE)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not MIN_TEMPERATURE <= temperature < float("inf"):
        raise ValueError(f"temperature: must be a finite number >= {MIN_TEMPERATURE:g}, got {temperature!r}")
    return float(temperature)


def check_rewards(rewards, groups) -> None:
    """group_advantages' inputs: [S] finite real rewards and [S] integer group labels, on one device that holds
    values."""
    check_device("rewards", require_tensor("rewards", rewards))
    require_tensor("groups", groups)
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected a 1-D tensor [S], got shape {list(rewards.shape)}")
    check_shape("groups", groups, tuple(rewards.shape), "one group label per reward")
    check_integer("groups", groups)
    if groups.device != rewards.device:
        raise ValueError(f"groups: on {groups.device}, but rewards is on {rewards.device}")
    if rewards.dtype == torch.bool or rewards.is_complex():
        raise TypeError(f"rewards: expected a real number tensor, got {rewards.dtype}")
    check_finite("rewards", rewards)
