"""LossConfig (the knobs of one F-TIS update) and the option tuples, without torch: the run config
(ftis_engine/config/) builds and checks its algorithm section from them and imports nothing that loads torch."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

METHODS = ("nois", "vis", "tis", "f-nois", "f-vis", "f-tis", "gepo", "hacpo")
KL_ESTIMATORS = ("k1", "k2", "k3", "k1-gen", "k3-gen")
IS_LEVELS = ("token", "sequence", "geometric")
IS_MODES = ("truncate", "mask")
IS_SOURCES = ("current", "old")
IS_TOKENS = ("kept", "all")
RATIO_LEVELS = ("token", "sequence")
POLICY_LOSSES = ("ppo", "cispo")
REJECT_LEVELS = ("none", "token", "sum", "mean", "max")
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
    "rejected_frac",
    "rejected_seq_frac",
    "ref_kl_mean",
)
REF_KL_ESTIMATORS = ("k1", "k2", "k3")
# The largest count or index the op takes (num_sequences, num_tokens, kl_max_len, norm_max_len, mini_batch_index):
# 2^53, the last integer a float64 holds exactly. A count is only ever used as a divisor or a factor in floating
# point, and no batch comes near it; a larger Python int would overflow torch's int64 scalar with an OverflowError
# that names nothing.
MAX_COUNT = 2**53
# The smallest IS cap: every log-ratio is clamped to [-20, 20] before exp, so no weight is below exp(-20) (2.1e-9);
# a cap at or below that makes every weight the cap (a constant factor, not a truncation), and a subnormal one
# (1e-320) makes every weight ~0.
MIN_IS_CAP = math.exp(-20.0)
# The lowest temperature: log-probs are log_softmax(logits / T) in float32, and below 1e-5 samplers no longer sample
# (vLLM's _SAMPLING_EPS: greedy), so no generator's log-probs are at such a temperature; 1 / T of a subnormal T is inf.
MIN_TEMPERATURE = 1e-5


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
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_COUNT:
        raise ValueError(f"LossConfig.{name}: expected a positive integer up to 2**53, got {value!r}")


def _in_range(name: str, value: object, low: float, high: float, what: str) -> None:
    if not low <= _number(name, value) <= high or not math.isfinite(value):
        raise ValueError(f"LossConfig.{name}: must be {what}, got {value!r}")


@dataclass(frozen=True)
class LossConfig:
    """Hyper-parameters of the F-TIS loss (docs/algorithm.md). Defaults are the paper's.

    method: nois | vis | tis | f-nois | f-vis | f-tis | gepo | hacpo ("f-" adds the KL filter).
    is_cap: C, the truncation of the importance weight w_t = min(exp(lb_t - g_t), C); C > exp(-20).
    kl_threshold: g; a sequence with A_i <= 0 and KL_i >= g is filtered (its advantage becomes 0); g >= 0 but with
        the signed estimators k1 and k1-gen.
    kl_estimator: k1 | k2 | k3 per-token terms of KL(pi_theta || pi_gen), x_t = g_t - lb_t.
    kl_reduction: sum | mean | padded_mean (sum / kl_max_len) over a sequence's tokens.
    eps_low, eps_high: PPO clip range [1 - eps_low, 1 + eps_high].
    temperature: the generator's sampling temperature; log-probs are log_softmax(logits / T).
    normalization: sequence (GRPO) | token (DAPO) | constant (Dr. GRPO, divides by S * norm_max_len).
    ignore_index: target id that marks positions which count nowhere.
    self_clip_low, self_clip_high, cross_clip_delta, cross_clip_step, alpha, max_abs_log_ratio: hacpo's, under its
        authors' names (zzx-peter/HACRL-code, recipe/hacpo/config/hacpo_trainer.yaml, hacpo.loss), with their
        defaults; see the fields' help and docs/algorithm.md.
    """

    # Each field's `help` (and `choices`) is also the description of the run config's `algorithm` section
    # (ftis_engine/config/schema.py derives that section from these fields): the paper's defaults live here only.
    method: str = field(default="f-tis", metadata={"choices": METHODS, "help": (
        "Loss: nois | vis | tis | f-nois | f-vis | f-tis (default) | gepo | hacpo (HACPO's sequence-level self and "
        "cross terms, as its authors coded them); f- adds the KL filter.")})
    is_cap: float = field(default=2.0, metadata={"help": (
        "C: truncation of the importance weight min(exp(l - g), C); above exp(-20), the smallest weight there is.")})
    kl_threshold: float = field(default=50.0, metadata={"help": (
        "g: a sequence with A <= 0 and KL >= g is filtered (.inf: never); >= 0 but with k1 and k1-gen, whose "
        "estimates may be negative.")})
    kl_estimator: str = field(default="k3", metadata={"choices": KL_ESTIMATORS, "help": (
        "Per-token KL term from x = g - l (clamped to [-20, 20]): k1 -x | k2 x^2/2 | k3 exp(x)-x-1 (default) (the "
        "paper authors', KL(pi_theta || pi_gen) written as if sampled from pi_theta) | k1-gen x | k3-gen exp(-x)-1+x "
        "(KL(pi_gen || pi_theta), unbiased under the generator's samples).")})
    kl_reduction: str = field(default="sum", metadata={"choices": KL_REDUCTIONS, "help": (
        "KL over a sequence's tokens: sum | mean | padded_mean (sum / kl_max_len).")})
    kl_max_len: int | None = field(default=None, metadata={"help": (
        "Padded length for kl_reduction padded_mean (the authors: 768).")})
    is_level: str = field(default="token", metadata={"choices": IS_LEVELS, "help": (
        "IS weight of tis / f-tis: token exp(l_t - g_t) | sequence exp(sum_t (l_t - g_t)) (TRL sequence_*) | "
        "geometric exp(mean_t (l_t - g_t)) (verl), one weight for all the sequence's tokens.")})
    is_mode: str = field(default="truncate", metadata={"choices": IS_MODES, "help": (
        "truncate: w <- clamp(w, is_min or 0, C) | mask (TRL *_mask): w <- 0 outside [is_min or 0, C] (the token "
        "or sequence keeps its place in the normaliser).")})
    is_min: float | None = field(default=None, metadata={"help": "Lower bound of the IS weight (default: none)."})
    is_source: str = field(default="current", metadata={"choices": IS_SOURCES, "help": (
        "The policy in the IS weight's numerator: current (the paper: l_t, recomputed each PPO epoch) | old (TRL, "
        "verl decoupled PPO: the given old_logprobs, constant across epochs).")})
    is_tokens: str = field(default="kept", metadata={"choices": IS_TOKENS, "help": (
        "The tokens a sequence or geometric IS weight is computed over when reject drops some: kept (default: "
        "those rejection left) | all (verl: the whole response, rejected tokens included).")})
    dual_clip: float | None = field(default=None, metadata={"help": (
        "Dual clip c > 1 (verl clip_ratio_c, 3.0): for A < 0 the term is max(PPO(r, A), c * A).")})
    delta: float | None = field(default=None, metadata={"help": (
        "Two-sided clip (INTELLECT-2, Liger delta) > 1 + eps_high: the unclipped ratio is capped at delta.")})
    ratio_level: str = field(default="token", metadata={"choices": RATIO_LEVELS, "help": (
        "The policy ratio r: token exp(l_t - o_t) | sequence (GSPO) exp(mean_t (l_t - o_t)), one per sequence "
        "(o: g for vis). Not for gepo, which has its own.")})
    policy_loss: str = field(default="ppo", metadata={"choices": POLICY_LOSSES, "help": (
        "ppo: min(r A, clip(r) A) | cispo (MiniMax-M1): sg(clip(r, 1 - eps_low, 1 + eps_high)) A l_t, a clipped "
        "stop-gradient weight on the log-prob's gradient (eps_low 1: no lower clip). Not for gepo.")})
    reject: str = field(default="none", metadata={"choices": REJECT_LEVELS, "help": (
        "Rejection (verl rollout_rs), whatever the advantage's sign: none (default) | token | sum | mean | max: a "
        "token, or a whole sequence by the sum / mean / max of its tokens' reject_estimator terms, outside "
        "[reject_min, reject_max] counts nowhere, in no normaliser. The terms' x is g - the is_source policy.")})
    reject_estimator: str = field(default="k3-gen", metadata={"choices": KL_ESTIMATORS, "help": (
        "Per-token term of the rejection statistic, as kl_estimator (verl's k1 is k1-gen, k3 is k3-gen).")})
    reject_max: float | None = field(default=None, metadata={"help": "Upper bound of the rejection statistic."})
    reject_min: float | None = field(default=None, metadata={"help": (
        "Lower bound of the rejection statistic (default: none; verl's k1 lower bound is log of its threshold).")})
    eps_low: float = field(default=0.2, metadata={"help": "PPO clip: 1 - eps_low."})
    eps_high: float = field(default=0.2, metadata={"help": (
        "PPO clip: 1 + eps_high (>= 0). cispo: its cap on the ratio is 1 + eps_high, which may be below 1 "
        "(eps_high > -eps_low): TRL's epsilon_high E is eps_high = E - 1 with eps_low = 1.")})
    temperature: float = field(default=1.0, metadata={"help": (
        "The generator's sampling temperature; log-probs are log_softmax(logits / T).")})
    normalization: str = field(default="sequence", metadata={"choices": NORMALIZATIONS, "help": (
        "sequence (GRPO) | token (DAPO) | constant (Dr. GRPO: S * norm_max_len).")})
    norm_max_len: int | None = field(default=None, metadata={"help": "Divisor length for normalization constant."})
    ignore_index: int = field(default=-100, metadata={"help": "Target id that marks positions which count nowhere."})
    beta: float = field(default=0.0, metadata={"help": (
        "KL penalty to the reference policy (the initial weights), TRL's beta, verl's kl_loss_coef: each counted "
        "token's term subtracts beta * KL_ref (0: the paper; needs the reference's log-probs). Not for gepo.")})
    ref_kl_estimator: str = field(default="k3", metadata={"choices": REF_KL_ESTIMATORS, "help": (
        "Per-token KL to the reference from x = ref - l (clamped to [-20, 20]): k3 exp(x) - x - 1 (default: TRL, "
        "verl low_var_kl) | k2 x^2/2 (verl mse) | k1 -x (verl kl).")})
    entropy_coef: float = field(default=0.0, metadata={"help": (
        "Entropy bonus, verl's entropy_coeff: each counted token's term adds entropy_coef * H_t (the entropy of "
        "the tempered distribution, differentiated through the fused passes), under the policy term's normaliser: "
        "the loss is verl's pg_loss - entropy_coeff * entropy_loss (0: the paper; negative: a penalty). Not for "
        "gepo or hacpo.")})
    # hacpo's options: its authors' names and defaults (recipe/hacpo/config/hacpo_trainer.yaml, hacpo.loss)
    self_clip_low: float = field(default=0.0003, metadata={"help": (
        "hacpo: the self term (the learner's own rollouts) is PPO's min on the sequence ratio clipped to "
        "[1 - self_clip_low, 1 + self_clip_high]; in [0, 1].")})
    self_clip_high: float = field(default=0.0004, metadata={"help": "hacpo: see self_clip_low; finite, >= 0."})
    cross_clip_delta: float = field(default=0.2, metadata={"help": (
        "hacpo: a peer rollout's sequence ratio is clamped to [lower, 1], lower = min(1, 1 - cross_clip_delta + m * "
        "cross_clip_step) at the step's m-th optimizer step (from 0); in [0, 1].")})
    cross_clip_step: float = field(default=0.025, metadata={"help": (
        "hacpo: how much the cross term's lower bound rises per optimizer step of a step's update; finite, >= 0.")})
    alpha: float = field(default=1.0, metadata={"help": (
        "hacpo: the cross term is clamp(r) * sg(clamp(r))^alpha * c * A (c: the capability ratio); finite, >= 0.")})
    max_abs_log_ratio: float = field(default=10.0, metadata={"help": (
        "hacpo: the sequence log-ratio is clamped to [-max_abs_log_ratio, max_abs_log_ratio] before exp; in (0, 20] "
        "(every log-ratio of the op is within [-20, 20]).")})

    def __post_init__(self) -> None:
        for spec in dataclasses.fields(self):  # every field with a fixed set of values declares it in `choices`
            if "choices" in spec.metadata:
                _choice(spec.name, getattr(self, spec.name), spec.metadata["choices"])
        if self.reject_max is not None:
            _number("reject_max", self.reject_max)
        if self.reject_min is not None:
            _number("reject_min", self.reject_min)
        if self.reject != "none" and self.reject_max is None:
            raise ValueError(f"LossConfig.reject_max: required when reject={self.reject!r}")
        if self.reject_max is not None and self.reject_min is not None and not self.reject_min < self.reject_max:
            raise ValueError(f"LossConfig.reject_min: must be below reject_max={self.reject_max!r}, "
                             f"got {self.reject_min!r}")
        if self.method in ("gepo", "hacpo") and (self.ratio_level != "token" or self.policy_loss != "ppo"):
            field_name = "ratio_level" if self.ratio_level != "token" else "policy_loss"
            raise ValueError(f"LossConfig.{field_name}: {self.method} has its own sequence-level ratio; use the "
                             "default")
        if self.method == "hacpo":  # its authors' loss has none of these (hacpo_core_algos.py, compute_hacpo_loss)
            for field_name, default in (("normalization", "sequence"), ("reject", "none"), ("dual_clip", None),
                                        ("delta", None), ("beta", 0.0), ("entropy_coef", 0.0)):
                if getattr(self, field_name) != default:
                    raise ValueError(f"LossConfig.{field_name}: hacpo's loss is its authors' sequence mean, without "
                                     f"this option; use {default!r}")
        if self.policy_loss == "cispo" and (self.dual_clip is not None or self.delta is not None):
            field_name = "dual_clip" if self.dual_clip is not None else "delta"
            raise ValueError(f"LossConfig.{field_name}: a PPO clip, which cispo does not use")
        if not _number("is_cap", self.is_cap) > MIN_IS_CAP:
            raise ValueError(f"LossConfig.is_cap: must be above exp(-20) = {MIN_IS_CAP:.3g} (the smallest IS weight: "
                             f"a cap at or below it truncates every weight), got {self.is_cap!r}")
        # k2, k3 and k3-gen never estimate a KL below 0, so a negative threshold filters as 0 does (every sequence
        # with A <= 0): a mistake, refused; k1 and k1-gen sum signed terms, which may lie below 0
        if _number("kl_threshold", self.kl_threshold) < 0 and self.kl_estimator not in ("k1", "k1-gen"):
            raise ValueError(f"LossConfig.kl_threshold: must be >= 0 with kl_estimator {self.kl_estimator} (its KL "
                             f"estimates are never negative; .inf: never filter), got {self.kl_threshold!r}")
        if not 0 <= _number("eps_low", self.eps_low) <= 1:
            raise ValueError(f"LossConfig.eps_low: must be in [0, 1], got {self.eps_low!r}")
        if self.policy_loss == "cispo":  # a cap on the weight, not a trust region: it may lie below 1
            if not -self.eps_low < _number("eps_high", self.eps_high) < math.inf:
                raise ValueError(f"LossConfig.eps_high: cispo's cap 1 + eps_high must lie above its floor 1 - eps_low"
                                 f" = {1 - self.eps_low!r}, got eps_high={self.eps_high!r}")
        elif not 0 <= _number("eps_high", self.eps_high) < math.inf:
            raise ValueError(f"LossConfig.eps_high: must be a finite number >= 0, got {self.eps_high!r}")
        if not MIN_TEMPERATURE <= _number("temperature", self.temperature) < math.inf:
            raise ValueError(f"LossConfig.temperature: must be a finite number >= {MIN_TEMPERATURE:g}, got "
                             f"{self.temperature!r}")
        if self.is_min is not None and not 0 < _number("is_min", self.is_min) < self.is_cap:
            raise ValueError(f"LossConfig.is_min: must be > 0 and below is_cap={self.is_cap!r}, got {self.is_min!r}")
        if self.dual_clip is not None and not 1 < _number("dual_clip", self.dual_clip) < math.inf:
            raise ValueError(f"LossConfig.dual_clip: must be a finite number > 1, got {self.dual_clip!r}")
        if self.delta is not None and not 1 + self.eps_high < _number("delta", self.delta) < math.inf:
            raise ValueError(f"LossConfig.delta: must be a finite number > 1 + eps_high = {1 + self.eps_high!r}, "
                             f"got {self.delta!r}")
        _positive_int_or_none("kl_max_len", self.kl_max_len)
        _positive_int_or_none("norm_max_len", self.norm_max_len)
        if self.kl_reduction == "padded_mean" and self.kl_max_len is None:
            raise ValueError("LossConfig.kl_max_len: required when kl_reduction='padded_mean'")
        if self.normalization == "constant" and self.norm_max_len is None:
            raise ValueError("LossConfig.norm_max_len: required when normalization='constant'")
        if not 0 <= _number("beta", self.beta) < math.inf:
            raise ValueError(f"LossConfig.beta: must be a finite number >= 0, got {self.beta!r}")
        if not math.isfinite(_number("entropy_coef", self.entropy_coef)):
            raise ValueError(f"LossConfig.entropy_coef: must be a finite number, got {self.entropy_coef!r}")
        if self.entropy_coef != 0 and self.method == "gepo":
            raise ValueError("LossConfig.entropy_coef: gepo's sequence-level loss has no per-token term; use 0")
        if self.beta > 0 and self.method == "gepo":
            raise ValueError("LossConfig.beta: gepo's sequence-level loss has no per-token KL term; use beta 0")
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int) \
                or not -2**63 <= self.ignore_index < 2**63:
            raise ValueError(f"LossConfig.ignore_index: expected an integer a target tensor can hold (int64), got "
                             f"{self.ignore_index!r}")
        _in_range("self_clip_low", self.self_clip_low, 0.0, 1.0, "in [0, 1]")
        _in_range("self_clip_high", self.self_clip_high, 0.0, math.inf, "finite and >= 0")
        _in_range("cross_clip_delta", self.cross_clip_delta, 0.0, 1.0, "in [0, 1]")
        _in_range("cross_clip_step", self.cross_clip_step, 0.0, math.inf, "finite and >= 0")
        _in_range("alpha", self.alpha, 0.0, math.inf, "finite and >= 0")
        if not 0 < _number("max_abs_log_ratio", self.max_abs_log_ratio) <= 20:
            raise ValueError(f"LossConfig.max_abs_log_ratio: must be in (0, 20], got {self.max_abs_log_ratio!r}")

    @property
    def filtered(self) -> bool:
        """True for the f-* methods, which apply the KL filter."""
        return self.method.startswith("f-")

    @property
    def base_method(self) -> str:
        """The method without its filter prefix: nois, vis, tis, gepo or hacpo."""
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
