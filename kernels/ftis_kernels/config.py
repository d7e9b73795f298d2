"""LossInputs (what the op computes the loss on) and LossOutput (what it returns); LossConfig and the option
tuples live in options.py (no torch) and are imported here, the same objects."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from .options import (IS_LEVELS, IS_MODES, IS_SOURCES, IS_TOKENS, KL_ESTIMATORS, KL_REDUCTIONS, MAX_COUNT,
                      METHODS, MIN_IS_CAP, MIN_TEMPERATURE, NORMALIZATIONS, POLICY_LOSSES, RATIO_LEVELS,
                      REF_KL_ESTIMATORS, REJECT_LEVELS, STAT_KEYS, LossConfig)

__all__ = ["IS_LEVELS", "IS_MODES", "IS_SOURCES", "IS_TOKENS", "KL_ESTIMATORS", "KL_REDUCTIONS", "MAX_COUNT", "METHODS",
           "MIN_IS_CAP", "MIN_TEMPERATURE", "NORMALIZATIONS", "OPTIONAL_INPUTS", "POLICY_LOSSES", "RATIO_LEVELS",
           "REF_KL_ESTIMATORS", "REJECT_LEVELS", "STAT_KEYS", "LossConfig", "LossInputs", "LossOutput",
           "NonFiniteInputError", "combine_stats", "rejection_scale"]



@dataclass(frozen=True)
class LossInputs:
    """What the loss is computed on besides the logits (or the hidden states and the head): one field per input,
    the one declaration that ftis_loss, fused_linear_ftis_loss and their modules share (their keyword arguments
    beyond the four required ones are the optional fields here). N rows (tokens) of S packed sequences.

    targets: [N] int, ids in [0, V) or config.ignore_index; row j predicts targets[j].
    gen_logprobs: [N] fp32, <= 0: the generator's log-probs of the targets.
    advantages: [S] fp32.
    cu_seqlens: [S+1] int32, 0 = cu[0] < cu[1] < ... < cu[S] = N: every sequence has at least one row (an empty
        completion has nothing to train on: leave it out), so N >= S >= 1.
    old_logprobs: [N] fp32, <= 0, or None: the log-probs under the policy the update started from (PPO's old
        policy, from a step's second optimizer step on).
    group_ids: [S] int or None (gepo: the groups E_k is taken over; default one group).
    num_sequences, num_tokens: when the call is one micro-batch of a larger batch (gradient accumulation), the
        whole batch's sequences and counted tokens: the loss is then divided as the whole batch's is, so the
        micro-batches' gradients add up to the whole batch's. Split gepo batches at group boundaries (E_k is taken
        over the groups within the call). None: the call's own counts.
    gen_seq_logprobs: [S] fp32 or None. A finite value is the generator's log-probability of the whole sequence,
        for a sequence whose per-token generation log-probs are unknown (another tokenizer made it, and the
        targets are its text re-encoded): its gen_logprobs entries are ignored and every term that uses them sees
        the sequence's log-ratio spread evenly over its tokens, log(pi/pi_gen)_t = (sum_t l_t - gen_seq) / |y|:
        its IS weight is the geometric-mean ratio (is_level token or geometric) or the sequence ratio (sequence),
        its KL and rejection terms are built from that same log-ratio. NaN: the sequence's own per-token
        gen_logprobs (the default).
    ref_logprobs: [N] fp32, <= 0, or None: the reference policy's log-probs of the targets (the initial weights).
        With config.beta > 0 (required then) each counted token's loss term subtracts beta * KL_ref,t (the
        ref_kl_estimator of x = ref_t - l_t: k3 exp(x) - x - 1, TRL's beta term and verl's low_var_kl),
        normalised as the policy term; ref_kl_mean reports its mean whenever ref_logprobs are given.
    The inputs of hacpo (the other methods read none of them; docs/algorithm.md):
    is_self: [S] bool, required by hacpo: the learner's own sequences (the self term; the others are its peers').
    gen_seq_tokens: [S] int or None: for each sequence with a finite gen_seq_logprobs, how many of its generator's
        own tokens that log-probability is over (>= 1; other entries are not read). hacpo's source mean is
        gen_seq_logprobs / gen_seq_tokens (its authors divide by the peer's length, not the receiver's); required
        by hacpo where gen_seq_logprobs is finite. Leave a token hacpo is not to count out of both sides: its target
        ignore_index here, out of gen_seq_logprobs and gen_seq_tokens there (its authors drop a final EOS so).
    capability_ratio: [S] fp32 > 0 or None (1): hacpo's c of each peer sequence, its generator's capability over
        the learner's (the authors' source_to_target_capability_ratio); not read for the learner's own sequences.
    mini_batch_index: int in [0, 2^53] or None (0): m, the optimizer step of this step's update the call belongs to
        (from 0, across epochs and mini-batches: the authors' minibatch_update_index); hacpo's cross term's lower
        bound rises with it.
    """

    targets: torch.Tensor
    gen_logprobs: torch.Tensor
    advantages: torch.Tensor
    cu_seqlens: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    group_ids: torch.Tensor | None = None
    num_sequences: int | None = None
    num_tokens: int | None = None
    gen_seq_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    is_self: torch.Tensor | None = None
    gen_seq_tokens: torch.Tensor | None = None
    capability_ratio: torch.Tensor | None = None
    mini_batch_index: int | None = None


# the keyword arguments of the op's functions and modules that are inputs (the rest are LossConfig overrides)
OPTIONAL_INPUTS = tuple(f.name for f in dataclasses.fields(LossInputs) if f.default is None)


@dataclass
class LossOutput:
    """Result of the fused op.

    loss: scalar (fp32; fp64 for fp64 inputs), differentiable w.r.t. the logits, or hidden, weight and bias.
    logprobs: [N] per-token log pi_theta(target) at the configured temperature, detached; 0 at ignored positions.
    stats: detached scalars named in STAT_KEYS: this call's means, stats[k] = stat_sums[k] / max(stat_counts[k], 1).
    stat_sums: detached scalars (the arithmetic dtype), the sum behind each mean: over counted tokens for the token
        stats, over the sequences with a counted token for filtered_frac and kl_mean, and for clip_frac under gepo.
    stat_counts: detached int64 scalars, what each sum is over: this call's counted tokens or its sequences that
        have one (a sequence whose every target is ignore_index counts in no stat).
        Sums and counts add up over the calls of one batch: `combine_stats` gives the whole batch's means.
    sequences: detached [S] tensors, one value per sequence behind the stats: `kl` (KL_i), `filtered` (bool: the
        filter's verdict) and `is_weight` (the mean IS weight over its counted tokens), for a person to read.
    """

    loss: torch.Tensor
    logprobs: torch.Tensor
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    stat_sums: dict[str, torch.Tensor] = field(default_factory=dict)
    stat_counts: dict[str, torch.Tensor] = field(default_factory=dict)
    sequences: dict[str, torch.Tensor] = field(default_factory=dict)


class NonFiniteInputError(ValueError):
    """NaN or inf in the logits, or in hidden, weight or bias: a trainer's sign that its model diverged."""


def combine_stats(outputs: Iterable[LossOutput]) -> dict[str, float]:
    """The whole batch's stats from the LossOutputs of its micro-batch calls: per key in STAT_KEYS,
    sum of stat_sums / max(sum of stat_counts, 1), as one call on the whole batch would report them.
    One device sync per output."""
    sums = dict.fromkeys(STAT_KEYS, 0.0)
    counts = dict.fromkeys(STAT_KEYS, 0)
    seen = 0
    for out in outputs:
        if not isinstance(out, LossOutput):
            raise TypeError(f"outputs: expected LossOutput items, got {type(out).__name__}")
        values = torch.stack([out.stat_sums[k].double() for k in STAT_KEYS]).tolist()
        numbers = torch.stack([out.stat_counts[k] for k in STAT_KEYS]).tolist()
        for key, value, number in zip(STAT_KEYS, values, numbers):
            sums[key] += value
            counts[key] += int(number)
        seen += 1
    if seen == 0:
        raise ValueError("outputs: no LossOutput given")
    return {key: sums[key] / max(counts[key], 1) for key in STAT_KEYS}


def rejection_scale(config: LossConfig, stats: dict[str, float], num_sequences: int, num_tokens: int) -> float:
    """The factor that turns micro-batch losses normalised by the whole batch's counts before rejection
    (num_sequences, num_tokens, as given to each call) into the loss normalised by the counts rejection left:
    S / S_kept (sequence normalisation, gepo), N / N_kept (token), 1 (constant, or reject none). `stats` are the
    whole batch's, from combine_stats. Multiply the accumulated loss and gradients by it before clipping."""
    if not isinstance(config, LossConfig):
        raise TypeError(f"config: expected a LossConfig, got {type(config).__name__}")
    for name, value in (("num_sequences", num_sequences), ("num_tokens", num_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_COUNT:
            raise ValueError(f"{name}: must be an int in [1, 2**53] (the whole batch's count), got {value!r}")
    if config.reject == "none" or config.normalization == "constant" and config.base_method != "gepo":
        return 1.0
    for key in ("rejected_frac", "rejected_seq_frac"):
        value = stats.get(key) if isinstance(stats, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ValueError(f"stats: {key} must be a fraction in [0, 1] (combine_stats gives it), got {value!r}")
    if config.normalization == "token" and config.base_method != "gepo":
        kept = num_tokens - round(num_tokens * stats["rejected_frac"])
        return num_tokens / max(kept, 1)
    kept = num_sequences - round(num_sequences * stats["rejected_seq_frac"])
    return num_sequences / max(kept, 1)
