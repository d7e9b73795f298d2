"""Stage 1 of the objective: from the per-token log-probs and the op's inputs to what every policy term reads:
the tokens that count (after rejection), each sequence's KL_i and the filter's verdict, the IS weight, the
reference KL and the normalisers.

Notation as in docs/algorithm.md: l_t (with gradient), lb_t = l_t detached, g_t generation log-prob, o_t old
log-prob, n_t the IS weight's numerator (lb_t, or o_t under is_source old), A_i advantage of sequence i, |a_i| its
counted tokens, S sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import LossConfig, LossInputs
from .segments import LOG_RATIO_CLAMP, exp_log_ratio, mean_of, segment_max, segment_sum, sequence_index


@dataclass(frozen=True)
class Prepared:
    """What the policy terms, the aggregation and the stats read; [N] per token, [S] per sequence, all in the
    arithmetic dtype of l_t. Only `logprobs`, `entropy` and `ref_kl` carry a gradient."""

    logprobs: torch.Tensor  # [N] l_t
    entropy: torch.Tensor  # [N] H_t
    seq: torch.Tensor  # [N] int64: the sequence of each token
    given: torch.Tensor  # [N] bool: counted before rejection
    counted: torch.Tensor  # [N] bool: counted after rejection (a rejected token counts nowhere)
    emptied: torch.Tensor  # [S] bool: sequences rejection left without a token
    old: torch.Tensor  # [N] o_t (lb_t without old_logprobs), 0 where not given
    own_gen: torch.Tensor  # [N] the generators' per-token log-probs as given (before any spreading)
    g: torch.Tensor  # [N] g_t, spread over a foreign sequence, 0 where not counted
    tokens_per_seq: torch.Tensor  # [S] |a_i|
    kl: torch.Tensor  # [S] KL_i
    filtered: torch.Tensor  # [S] bool: the filter's verdict
    advantages: torch.Tensor  # [S] A_i, 0 where filtered
    is_weight: torch.Tensor  # [N] w_t
    is_out_of_range: torch.Tensor  # [N] bool: the raw weight outside [is_min or 0, C]
    ref_kl: torch.Tensor | None  # [N] KL_ref,t (with gradient), 0 where not counted; None without ref_logprobs
    seq_norm: torch.Tensor | int  # the sequences a sequence mean divides by
    token_norm: torch.Tensor | int  # the tokens a token mean divides by
    batch_sequences: int  # S, or the whole batch's num_sequences
    inputs: LossInputs  # the method-specific inputs (group_ids, is_self, ...) are read from here

    @property
    def num_seqs(self) -> int:
        return self.advantages.numel()

    @property
    def has_tokens(self) -> torch.Tensor:
        """[S] bool: a sequence without a counted token counts nowhere (no term, no per-sequence stat)."""
        return self.tokens_per_seq > 0

    def sequence_mean(self, values: torch.Tensor) -> torch.Tensor:
        """[S] mean_t values_t over each sequence's counted tokens (0 for a sequence without one)."""
        zero = values.new_zeros(())
        total = segment_sum(torch.where(self.counted, values, zero), self.seq, self.num_seqs)
        return mean_of(total, self.tokens_per_seq)


def kl_per_token(x: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL term from x_t = g_t - lb_t (detached; the reference term passes x = ref_t - l_t with its
    gradient), x clamped to [-20, 20] for every estimator.

    KL(pi_theta || pi_gen), the paper authors' convention: k1: -x · k2: x^2 / 2 · k3: exp(x) - x - 1.
    KL(pi_gen || pi_theta), unbiased under the generator's samples: k1-gen: x · k3-gen: exp(-x) - 1 + x.
    """
    x = torch.clamp(x, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k3":
        return torch.exp(x) - x - 1.0
    if estimator == "k2":
        return 0.5 * x * x
    if estimator == "k1-gen":
        return x
    if estimator == "k3-gen":
        return torch.exp(-x) - 1.0 + x
    return -x


def spread_sequence_logprobs(gen_logprobs: torch.Tensor, gen_seq: torch.Tensor, numerator: torch.Tensor,
                             seq: torch.Tensor, given: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Per-token generation log-probs for the sequences that have only a sequence log-probability G_i (finite
    entries of gen_seq):

        g_t := n_t + (G_i - sum_t n_t) / |y_i|   over its given tokens,

    so that the log-ratio n_t - g_t is the sequence's mean log-ratio on every token (and sums to its log-ratio)."""
    zero = numerator.new_zeros(())
    n = torch.where(given, numerator.detach(), zero)
    count = segment_sum(given.to(n.dtype), seq, num_seqs)
    shift = mean_of(torch.nan_to_num(gen_seq, nan=0.0) - segment_sum(n, seq, num_seqs), count)
    foreign = ~torch.isnan(gen_seq)
    return torch.where(foreign[seq] & given, n + shift[seq], gen_logprobs)


def rejection(numerator: torch.Tensor, gen_logprobs: torch.Tensor, seq: torch.Tensor, given: torch.Tensor,
              num_seqs: int, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept [N] bool, emptied [S] bool): verl-style rejection, blind to the advantage's sign. Per given token
    d_t = reject_estimator(x_t), x_t = g_t - n_t (detached, clamped to [-20, 20]); the statistic is d_t (token) or
    the sum / mean / max of the sequence's d_t; a token, or all of a sequence's tokens, is kept iff
    reject_min <= statistic <= reject_max. emptied: sequences that had given tokens and have none left."""
    zero = numerator.new_zeros(())
    d = torch.where(given, kl_per_token(gen_logprobs - numerator.detach(), cfg.reject_estimator), zero)
    count = segment_sum(given.to(d.dtype), seq, num_seqs)
    if cfg.reject == "token":
        stat = d
    elif cfg.reject == "max":
        stat = segment_max(torch.where(given, d, torch.full_like(d, -torch.inf)), seq, num_seqs)[seq]
    else:
        per_seq = segment_sum(d, seq, num_seqs)
        stat = (mean_of(per_seq, count) if cfg.reject == "mean" else per_seq)[seq]
    keep = stat <= cfg.reject_max
    if cfg.reject_min is not None:
        keep &= stat >= cfg.reject_min
    kept = given & keep
    emptied = (count > 0) & ~(segment_sum(kept.to(d.dtype), seq, num_seqs) > 0)
    return kept, emptied


def importance_weight(log_ratio: torch.Tensor, seq: torch.Tensor, tokens_per_seq: torch.Tensor,
                      counted: torch.Tensor, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(w, out_of_range) per token from the detached log-ratio n_t - g_t of each counted token, by is_level:

        token: exp(n_t - g_t) · sequence: exp(sum_t (n_t - g_t)) · geometric: exp(mean_t (n_t - g_t)),

    each exponent clamped to [-20, 20]; then by is_mode, truncate: w = clamp(w, is_min or 0, C) (the paper's
    w_t = min(exp(lb_t - g_t), C)) · mask: w = 0 outside [is_min or 0, C]."""
    zero = log_ratio.new_zeros(())
    log_ratio = torch.where(counted, log_ratio, zero)
    if cfg.is_level != "token":
        per_seq = segment_sum(log_ratio, seq, tokens_per_seq.numel())
        if cfg.is_level == "geometric":
            per_seq = mean_of(per_seq, tokens_per_seq)
        log_ratio = per_seq[seq]
    raw = exp_log_ratio(log_ratio)
    low = 0.0 if cfg.is_min is None else cfg.is_min
    out_of_range = (raw > cfg.is_cap) | (raw < low)
    if cfg.is_mode == "mask":
        return torch.where(out_of_range, zero, raw), out_of_range
    return torch.clamp(raw, min=low, max=cfg.is_cap), out_of_range


def kl_filter(g: torch.Tensor, lb: torch.Tensor, advantages: torch.Tensor, seq: torch.Tensor,
              counted: torch.Tensor, tokens_per_seq: torch.Tensor, cfg: LossConfig
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(KL_i, filtered, A_i after the filter), each [S]. KL_i reduces the kl_estimator's terms of x_t = g_t - lb_t
    over the sequence's counted tokens by kl_reduction: sum · mean · padded_mean (sum / kl_max_len). The f-*
    methods' filter:

        filtered_i = A_i <= 0 and KL_i >= kl_threshold,   A_i := 0 where filtered_i

    (a filtered sequence keeps its place in every normaliser; one without a counted token is never filtered)."""
    zero = lb.new_zeros(())
    num_seqs = advantages.numel()
    kl = segment_sum(torch.where(counted, kl_per_token(g - lb, cfg.kl_estimator), zero), seq, num_seqs)
    if cfg.kl_reduction == "mean":
        kl = mean_of(kl, tokens_per_seq)
    elif cfg.kl_reduction == "padded_mean":
        kl = kl / cfg.kl_max_len
    if cfg.filtered:
        filtered = (advantages <= 0) & (kl >= cfg.kl_threshold) & (tokens_per_seq > 0)
    else:
        filtered = torch.zeros_like(advantages, dtype=torch.bool)
    return kl, filtered, torch.where(filtered, zero, advantages)


def _normalisers(inputs: LossInputs, counted: torch.Tensor, emptied: torch.Tensor, dtype: torch.dtype,
                 cfg: LossConfig) -> tuple[torch.Tensor | int, torch.Tensor | int, int]:
    """(sequences, tokens, batch sequences): what the sequence and token means divide by, this call's own counts
    unless it is one micro-batch of a batch whose num_sequences / num_tokens are given. Sequences that rejection
    emptied leave the sequence count (verl's seq-mean); the constant normaliser counts every sequence. Counts in
    `dtype`, the arithmetic one."""
    num_seqs = inputs.advantages.numel()
    if inputs.num_sequences is not None:
        seq_norm = inputs.num_sequences
    elif cfg.reject != "none":
        seq_norm = torch.clamp(num_seqs - emptied.to(dtype).sum(), min=1)
    else:
        seq_norm = num_seqs
    token_norm = inputs.num_tokens
    if token_norm is None:
        token_norm = torch.clamp(counted.to(dtype).sum(), min=1)
    return seq_norm, token_norm, num_seqs if inputs.num_sequences is None else inputs.num_sequences


def _policies(lb: torch.Tensor, given: torch.Tensor, inputs: LossInputs, seq: torch.Tensor, cfg: LossConfig
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o_t, n_t, g_t) per token: the old policy (lb_t unless given), the IS weight's numerator (lb_t, the paper,
    or o_t under is_source old: decoupled PPO) and the generators' log-probs, spread over the sequences that have
    only a sequence log-probability. lb: [N] l_t detached; given: [N] bool, the tokens counted before rejection."""
    dtype = lb.dtype
    old = lb
    if inputs.old_logprobs is not None:
        old = torch.where(given, inputs.old_logprobs.to(dtype), lb.new_zeros(()))
    numerator = old if cfg.is_source == "old" else lb
    gen = inputs.gen_logprobs.to(dtype)
    if inputs.gen_seq_logprobs is not None:
        gen = spread_sequence_logprobs(gen, inputs.gen_seq_logprobs.to(dtype), numerator, seq, given,
                                       inputs.advantages.numel())
    return old, numerator, gen


def prepare(logprobs: torch.Tensor, entropy: torch.Tensor, given: torch.Tensor, inputs: LossInputs,
            cfg: LossConfig) -> Prepared:
    """Stage 1: the rejection, the KL filter, the IS weight, the reference KL and the normalisers of one call.
    logprobs: [N] l_t (with gradient, in the arithmetic dtype); entropy: [N]; given: [N] bool, False where the target
    is ignore_index; inputs: the op's (its targets are not read)."""
    lb = logprobs.detach()
    dtype, zero = lb.dtype, lb.new_zeros(())
    num_seqs = inputs.advantages.numel()
    seq = sequence_index(inputs.cu_seqlens, lb.numel())
    old, numerator, gen = _policies(lb, given, inputs, seq, cfg)
    counted, emptied = given, torch.zeros(num_seqs, dtype=torch.bool, device=inputs.advantages.device)
    if cfg.reject != "none":  # a rejected token counts nowhere from here on, as if its target were ignored
        counted, emptied = rejection(numerator, gen, seq, given, num_seqs, cfg)
    g = torch.where(counted, gen, zero)
    tokens_per_seq = segment_sum(counted.to(dtype), seq, num_seqs)
    kl, filtered, advantages = kl_filter(g, lb, inputs.advantages.to(dtype), seq, counted, tokens_per_seq, cfg)
    # A sequence-level weight sums over the tokens rejection kept, or (is_tokens all, verl) over every given one.
    if cfg.is_tokens == "all" and cfg.reject != "none" and cfg.is_level != "token":
        is_weight, out_of_range = importance_weight(numerator - torch.where(given, gen, zero), seq,
                                                    segment_sum(given.to(dtype), seq, num_seqs), given, cfg)
    else:
        is_weight, out_of_range = importance_weight(numerator - g, seq, tokens_per_seq, counted, cfg)
    ref_kl = None
    if inputs.ref_logprobs is not None:  # KL_ref,t from x = ref_t - l_t, differentiable through l_t
        x = inputs.ref_logprobs.to(dtype) - logprobs
        ref_kl = torch.where(counted, kl_per_token(x, cfg.ref_kl_estimator), zero)
    seq_norm, token_norm, batch_sequences = _normalisers(inputs, counted, emptied, dtype, cfg)
    return Prepared(
        logprobs=logprobs, entropy=entropy.to(dtype), seq=seq, given=given, counted=counted,
        emptied=emptied, old=old, own_gen=inputs.gen_logprobs.to(dtype), g=g, tokens_per_seq=tokens_per_seq,
        kl=kl, filtered=filtered, advantages=advantages, is_weight=is_weight, is_out_of_range=out_of_range,
        ref_kl=ref_kl, seq_norm=seq_norm, token_norm=token_norm, batch_sequences=batch_sequences, inputs=inputs,
    )
