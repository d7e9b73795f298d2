"""LossConfig (the knobs of one F-TIS update) and LossOutput (what the op returns)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

METHODS = ("nois", "vis", "tis", "f-nois", "f-vis", "f-tis", "gepo")
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_REDUCTIONS = ("sum", "mean", "padded_mean")
NORMALIZATIONS = ("sequence", "token", "constant")
STAT_KEYS = (
    "is_weight_mean",
    "is_truncated_frac",
    "filtered_frac",
    "kl_mean",
    "clip_frac",
    "entropy_mean",
    "logprob_mean",
)


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"LossConfig.{name}: unknown value {value!r}; expected one of {', '.join(allowed)}")


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"LossConfig.{name}: expected a number, got {value!r}")
    return float(value)


def _positive_int_or_none(name: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"LossConfig.{name}: expected a positive integer, got {value!r}")


@dataclass(frozen=True)
class LossConfig:
    """Hyper-parameters of the F-TIS loss (docs/algorithm.md). Defaults are the paper's.

    method: nois | vis | tis | f-nois | f-vis | f-tis | gepo ("f-" adds the KL filter).
    is_cap: C, the truncation of the importance weight w_t = min(exp(lb_t - g_t), C).
    kl_threshold: g; a sequence with A_i <= 0 and KL_i >= g is filtered (its advantage becomes 0).
    kl_estimator: k1 | k2 | k3 per-token terms of KL(pi_theta || pi_gen), x_t = g_t - lb_t.
    kl_reduction: sum | mean | padded_mean (sum / kl_max_len) over a sequence's tokens.
    eps_low, eps_high: PPO clip range [1 - eps_low, 1 + eps_high].
    temperature: the generator's sampling temperature; log-probs are log_softmax(logits / T).
    normalization: sequence (GRPO) | token (DAPO) | constant (Dr. GRPO, divides by S * norm_max_len).
    ignore_index: target id that marks positions which count nowhere.
    """

    method: str = "f-tis"
    is_cap: float = 2.0
    kl_threshold: float = 50.0
    kl_estimator: str = "k3"
    kl_reduction: str = "sum"
    kl_max_len: int | None = None
    eps_low: float = 0.2
    eps_high: float = 0.2
    temperature: float = 1.0
    normalization: str = "sequence"
    norm_max_len: int | None = None
    ignore_index: int = -100

    def __post_init__(self) -> None:
        _choice("method", self.method, METHODS)
        _choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _choice("kl_reduction", self.kl_reduction, KL_REDUCTIONS)
        _choice("normalization", self.normalization, NORMALIZATIONS)
        if not _number("is_cap", self.is_cap) > 0:
            raise ValueError(f"LossConfig.is_cap: must be > 0, got {self.is_cap!r}")
        _number("kl_threshold", self.kl_threshold)
        if not 0 <= _number("eps_low", self.eps_low) < 1:
            raise ValueError(f"LossConfig.eps_low: must be in [0, 1), got {self.eps_low!r}")
        if not 0 <= _number("eps_high", self.eps_high) < math.inf:
            raise ValueError(f"LossConfig.eps_high: must be a finite number >= 0, got {self.eps_high!r}")
        if not 0 < _number("temperature", self.temperature) < math.inf:
            raise ValueError(f"LossConfig.temperature: must be a finite number > 0, got {self.temperature!r}")
        _positive_int_or_none("kl_max_len", self.kl_max_len)
        _positive_int_or_none("norm_max_len", self.norm_max_len)
        if self.kl_reduction == "padded_mean" and self.kl_max_len is None:
            raise ValueError("LossConfig.kl_max_len: required when kl_reduction='padded_mean'")
        if self.normalization == "constant" and self.norm_max_len is None:
            raise ValueError("LossConfig.norm_max_len: required when normalization='constant'")
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise ValueError(f"LossConfig.ignore_index: expected an integer, got {self.ignore_index!r}")

    @property
    def filtered(self) -> bool:
        """True for the f-* methods, which apply the KL filter."""
        return self.method.startswith("f-")

    @property
    def base_method(self) -> str:
        """The method without its filter prefix: nois, vis, tis or gepo."""
        return self.method.removeprefix("f-")

    def replace(self, **overrides: object) -> "LossConfig":
        """A copy with some fields changed; unknown field names raise ValueError."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(
                f"unknown loss option(s) {', '.join(unknown)}; LossConfig fields are {', '.join(sorted(known))}"
            )
        return dataclasses.replace(self, **overrides)


@dataclass
class LossOutput:
    """Result of the fused op.

    loss: scalar (fp32; fp64 for fp64 inputs), differentiable w.r.t. the logits, or hidden, weight and bias.
    logprobs: [N] per-token log pi_theta(target) at the configured temperature, detached; 0 at ignored positions.
    stats: detached scalars named in STAT_KEYS, averaged over counted tokens (or sequences for
        filtered_frac and kl_mean, and for clip_frac under gepo).
    """

    loss: torch.Tensor
    logprobs: torch.Tensor
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
