"""The F-TIS objective on per-token log-probs: O(N) work between the vocabulary passes.

Everything here is plain differentiable torch on [N] / [S] vectors: the loss depends on the logits only through
the per-token log-probs l_t, so autograd through this file yields dL/dl_t, which the backward vocabulary pass
(Triton or chunked torch) turns into the gradient of the logits, or of hidden, weight and bias.
Notation as in docs/algorithm.md: l_t (with gradient), lb_t = l_t detached, g_t generation log-prob, o_t old
log-prob, A_i advantage of sequence i, |a_i| its counted tokens, S sequences.
"""

from __future__ import annotations

import torch

from .checks import check_rewards
from .config import LossConfig

LOG_RATIO_CLAMP = 20.0  # every log-ratio is clamped to [-20, 20] before exp


def sequence_index(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[N] int64: the sequence each packed token belongs to."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seqs = torch.arange(lengths.numel(), device=cu_seqlens.device)
    return torch.repeat_interleave(seqs, lengths, output_size=num_tokens)


def segment_sum(values: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """Differentiable sum of `values` into `size` buckets given by `index`."""
    return values.new_zeros(size).index_add(0, index, values)


def segment_logsumexp(values: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """log(sum(exp(values))) per bucket; -inf entries are ignored, an empty bucket gives -inf. No gradient."""
    peak = values.new_full((size,), -torch.inf).scatter_reduce(0, index, values, "amax", include_self=True)
    safe_peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    total = segment_sum(torch.exp(values - safe_peak[index]), index, size)
    return safe_peak + torch.log(total)


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, scale: bool = True) -> torch.Tensor:
    """GRPO's group advantage of each completion, computed in float64 and returned as float32:

        A_i = (r_i - mean_{j in G(i)} r_j) / (std_{j in G(i)} r_j + 1e-8)

    over the completions j of i's group G(i) (groups[j] == groups[i]; std unbiased, as torch.std). scale=False
    drops the division (Dr. GRPO's `scale_rewards: none`). A group of one has no spread: its advantage is 0.
    rewards, groups: [S] (any numeric dtype; groups any integer labels), on one device; rewards finite (an unscored
    completion's NaN reward is the caller's to leave out), else ValueError naming the argument, as the loss does."""
    check_rewards(rewards, groups)
    rewards = rewards.double()
    advantages = torch.zeros_like(rewards)
    for key in torch.unique(groups):
        members = groups == key
        r = rewards[members]
        if r.numel() < 2:
            continue
        centred = r - r.mean()
        advantages[members] = centred / (r.std() + 1e-8) if scale else centred
    return advantages.float()


def ppo(ratio: torch.Tensor, advantage: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """PPO(r, A) = min(r'*A, clip(r, 1-eps_low, 1+eps_high)*A) with r' = min(r, delta) under the two-sided clip
    (else r' = r); under the dual clip, max(that, c*A) where A < 0."""
    clipped = torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    capped = ratio if cfg.delta is None else torch.clamp(ratio, max=cfg.delta)
    u = torch.minimum(capped * advantage, clipped * advantage)
    if cfg.dual_clip is not None:
        u = torch.where(advantage < 0, torch.maximum(u, cfg.dual_clip * advantage), u)
    return u


def clip_active(ratio: torch.Tensor, advantage: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """Where a clip took the term (its gradient is zero): PPO's clipped branch strictly the smaller one, the
    ratio above delta on the chosen branch, or the dual clip's c*A strictly the larger."""
    clipped = torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * advantage
    capped = ratio if cfg.delta is None else torch.clamp(ratio, max=cfg.delta)
    unclipped = capped * advantage
    active = clipped < unclipped
    if cfg.delta is not None:
        active |= (ratio > cfg.delta) & (unclipped <= clipped) & (advantage != 0)
    if cfg.dual_clip is not None:
        active |= (advantage < 0) & (cfg.dual_clip * advantage > torch.minimum(unclipped, clipped))
    return active


def exp_log_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


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


def importance_weight(log_ratio: torch.Tensor, seq: torch.Tensor, tokens_per_seq: torch.Tensor,
                      counted: torch.Tensor, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(w, out_of_range) per token from the detached log-ratio log(pi/pi_gen) of each counted token:
    token: exp(log-ratio) · sequence: exp(sum over the sequence) · geometric: exp(mean over the sequence), each
    exponent clamped to [-20, 20]; then truncate: clamp(w, is_min or 0, C) · mask: 0 outside [is_min or 0, C]."""
    zero = log_ratio.new_zeros(())
    log_ratio = torch.where(counted, log_ratio, zero)
    if cfg.is_level != "token":
        per_seq = segment_sum(log_ratio, seq, tokens_per_seq.numel())
        if cfg.is_level == "geometric":
            per_seq = _mean(per_seq, tokens_per_seq)
        log_ratio = per_seq[seq]
    raw = exp_log_ratio(log_ratio)
    low = 0.0 if cfg.is_min is None else cfg.is_min
    out_of_range = (raw > cfg.is_cap) | (raw < low)
    if cfg.is_mode == "mask":
        return torch.where(out_of_range, zero, raw), out_of_range
    return torch.clamp(raw, min=low, max=cfg.is_cap), out_of_range


def rejection(numerator: torch.Tensor, gen_logprobs: torch.Tensor, seq: torch.Tensor, counted: torch.Tensor,
              num_seqs: int, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept [N] bool, emptied [S] bool): verl-style rejection, blind to the advantage's sign. Per counted token
    d_t = reject_estimator(x_t), x_t = g_t - numerator_t (detached, clamped to [-20, 20]); the statistic is d_t
    (token) or the sum / mean / max of the sequence's d_t; a token, or all of a sequence's tokens, is kept iff
    reject_min <= statistic <= reject_max. emptied: sequences that had counted tokens and have none left."""
    zero = numerator.new_zeros(())
    d = torch.where(counted, kl_per_token(gen_logprobs - numerator.detach(), cfg.reject_estimator), zero)
    count = segment_sum(counted.to(d.dtype), seq, num_seqs)
    if cfg.reject == "token":
        stat = d
    else:
        if cfg.reject == "max":
            masked = torch.where(counted, d, torch.full_like(d, -torch.inf))
            per_seq = d.new_full((num_seqs,), -torch.inf).scatter_reduce(0, seq, masked, "amax", include_self=True)
        else:
            per_seq = segment_sum(d, seq, num_seqs)
            if cfg.reject == "mean":
                per_seq = _mean(per_seq, count)
        stat = per_seq[seq]
    keep = stat <= cfg.reject_max
    if cfg.reject_min is not None:
        keep &= stat >= cfg.reject_min
    kept = counted & keep
    emptied = (count > 0) & ~(segment_sum(kept.to(d.dtype), seq, num_seqs) > 0)
    return kept, emptied


def spread_sequence_logprobs(gen_logprobs: torch.Tensor, gen_seq: torch.Tensor, numerator: torch.Tensor,
                             seq: torch.Tensor, given: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Per-token generation log-probs for the sequences that have only a sequence log-probability G_i (finite
    entries of gen_seq): n_t + (G_i - sum of n over its given tokens) / their count, so that the log-ratio
    n_t - g_t is the sequence's mean log-ratio on every token (and sums to the sequence's log-ratio)."""
    zero = numerator.new_zeros(())
    n = torch.where(given, numerator.detach(), zero)
    count = segment_sum(given.to(n.dtype), seq, num_seqs)
    shift = _mean(torch.nan_to_num(gen_seq, nan=0.0) - segment_sum(n, seq, num_seqs), count)
    foreign = ~torch.isnan(gen_seq)
    return torch.where(foreign[seq] & given, n + shift[seq], gen_logprobs)


def _mean(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return total / torch.clamp(count, min=1)


def ftis_objective(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    gen_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    cu_seqlens: torch.Tensor,
    counted: torch.Tensor,
    cfg: LossConfig,
    old_logprobs: torch.Tensor | None = None,
    group_ids: torch.Tensor | None = None,
    num_sequences: int | None = None,
    num_tokens: int | None = None,
    gen_seq_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    is_self: torch.Tensor | None = None,
    gen_seq_tokens: torch.Tensor | None = None,
    capability_ratio: torch.Tensor | None = None,
    mini_batch_index: int | None = None,
) -> tuple[torch.Tensor, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Loss and stats of one update (or one micro-batch of it) from per-token log-probs.

    logprobs: [N] l_t, differentiable, computed in the arithmetic dtype (fp32, or fp64 for fp64 inputs);
    entropy: [N] (differentiable: used by the loss only with cfg.entropy_coef != 0); gen_logprobs / old_logprobs: [N]; advantages: [S]; cu_seqlens: [S+1];
    counted: [N] bool, False where the target is ignore_index; group_ids: [S] (gepo only).
    num_sequences / num_tokens: the whole batch's sequences / counted tokens when this call is one micro-batch
    of it (the normaliser of sequence, constant and gepo / of token normalisation); None: this call's own.
    gen_seq_logprobs: [S], NaN or a sequence's generation log-probability G_i (per-token ones unknown): its tokens'
    gen_logprobs become n_t + (G_i - sum_t n_t) / |y_i| over its given tokens (n: the IS numerator), so every
    term below sees the sequence-level log-ratio spread evenly over its tokens.
    ref_logprobs: [N] the reference policy's log-probs, or None; with cfg.beta > 0 each counted token's u_t becomes
    u_t - beta * KL_ref,t (cfg.ref_kl_estimator of x = ref_t - l_t), under the policy term's normaliser.
    is_self, gen_seq_tokens [S], capability_ratio [S], mini_batch_index: hacpo's inputs (LossInputs; _hacpo).
    Returns the scalar loss, (sums, counts): per stat key, the detached sum and the int64 count it is over, and
    the per-sequence values behind the stats ([S] each, detached): kl (KL_i), filtered (the filter's verdict) and
    is_weight (the mean IS weight over the sequence's counted tokens).
    """
    dtype = logprobs.dtype
    num_seqs = advantages.numel()
    seq = sequence_index(cu_seqlens, logprobs.numel())
    zero = logprobs.new_zeros(())
    adv = advantages.to(dtype)
    lb = logprobs.detach()
    given = counted
    # The IS weight's numerator: l_t (the paper), or the given old policy o_t (decoupled PPO).
    old = lb if old_logprobs is None else torch.where(given, old_logprobs.to(dtype), zero)
    numerator = old if cfg.is_source == "old" else lb
    own_gen = gen_logprobs.to(dtype)  # the generators' per-token log-probs, before any spreading (hacpo's source)
    if gen_seq_logprobs is not None:
        gen_logprobs = spread_sequence_logprobs(gen_logprobs.to(dtype), gen_seq_logprobs.to(dtype), numerator, seq,
                                                given, num_seqs)
    emptied = torch.zeros(num_seqs, dtype=torch.bool, device=adv.device)
    if cfg.reject != "none":  # a rejected token counts nowhere from here on, as if its target were ignored
        counted, emptied = rejection(numerator, gen_logprobs.to(dtype), seq, given, num_seqs, cfg)
    g = torch.where(counted, gen_logprobs.to(dtype), zero)
    count_f = counted.to(dtype)
    tokens_per_seq = segment_sum(count_f, seq, num_seqs)  # |a_i|
    num_counted = count_f.sum()
    if num_sequences is not None:
        seq_norm = num_sequences
    elif cfg.reject != "none":  # a sequence rejection emptied leaves the sequence count (verl's seq-mean)
        seq_norm = torch.clamp(num_seqs - emptied.to(dtype).sum(), min=1)
    else:
        seq_norm = num_seqs
    token_norm = torch.clamp(num_counted, min=1) if num_tokens is None else num_tokens

    # KL_i from x_t = g_t - lb_t, reduced over the sequence's counted tokens.
    kl_tok = torch.where(counted, kl_per_token(g - lb, cfg.kl_estimator), zero)
    kl_seq = segment_sum(kl_tok, seq, num_seqs)
    if cfg.kl_reduction == "mean":
        kl_seq = _mean(kl_seq, tokens_per_seq)
    elif cfg.kl_reduction == "padded_mean":
        kl_seq = kl_seq / cfg.kl_max_len

    # The filter: A_i <= 0 and KL_i >= g; a filtered sequence keeps its place in every normaliser, advantage 0.
    # A sequence without a counted token counts nowhere: never filtered, out of the per-sequence stats.
    has_tokens = tokens_per_seq > 0
    if cfg.filtered:
        filtered = (adv <= 0) & (kl_seq >= cfg.kl_threshold) & has_tokens
    else:
        filtered = torch.zeros_like(adv, dtype=torch.bool)
    adv = torch.where(filtered, zero, adv)

    # IS weight, by default w_t = min(exp(lb_t - g_t), C): a constant, reported for every method. A sequence-level
    # weight sums over the tokens rejection kept, or (is_tokens all, verl) over every given token.
    if cfg.is_tokens == "all" and cfg.reject != "none" and cfg.is_level != "token":
        g_given = torch.where(given, gen_logprobs.to(dtype), zero)
        is_weight, out_of_range = importance_weight(numerator - g_given, seq, segment_sum(given.to(dtype), seq,
                                                    num_seqs), given, cfg)
    else:
        is_weight, out_of_range = importance_weight(numerator - g, seq, tokens_per_seq, counted, cfg)

    # KL to the reference, per token from x = ref_t - l_t (differentiable through l_t)
    ref_kl = None
    if ref_logprobs is not None:
        ref_kl = torch.where(counted, kl_per_token(ref_logprobs.to(dtype) - logprobs, cfg.ref_kl_estimator), zero)

    if cfg.base_method == "gepo":
        loss, clipped = _gepo(logprobs, g, adv, seq, tokens_per_seq, counted, cfg, group_ids, seq_norm)
    elif cfg.base_method == "hacpo":
        source = _hacpo_source(old, own_gen, seq, tokens_per_seq, counted, is_self, gen_seq_logprobs, gen_seq_tokens)
        loss, clipped = _hacpo(logprobs, source, adv, seq, tokens_per_seq, counted, cfg, is_self, capability_ratio,
                               mini_batch_index or 0, seq_norm)
    else:
        reference = g if cfg.base_method == "vis" else old
        log_ratio = torch.where(counted, logprobs - reference, zero)
        if cfg.ratio_level == "sequence":  # GSPO: s_i = exp(mean_t (l_t - o_t)) for every token of sequence i
            log_ratio = _mean(segment_sum(log_ratio, seq, num_seqs), tokens_per_seq)[seq]
        ratio = exp_log_ratio(log_ratio)
        adv_tok = adv[seq]
        if cfg.policy_loss == "cispo":  # u_t = sg(clip(r_t)) A_i l_t: the gradient is the clipped weight times A
            bounded = torch.clamp(ratio.detach(), 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
            u = bounded * adv_tok * logprobs
        else:
            u = ppo(ratio, adv_tok, cfg)
        if cfg.base_method == "tis":
            u = is_weight * u
        if ref_kl is not None and cfg.beta > 0:  # TRL's -(ppo - beta * KL_ref): the same normaliser as the rest
            u = u - cfg.beta * ref_kl
        if cfg.entropy_coef != 0:  # verl's pg_loss - entropy_coeff * entropy_loss, under the same normaliser
            u = u + cfg.entropy_coef * entropy.to(dtype)
        u = torch.where(counted, u, zero)
        if cfg.normalization == "sequence":
            loss = -_mean(segment_sum(u, seq, num_seqs), tokens_per_seq).sum() / seq_norm
        elif cfg.normalization == "token":
            loss = -u.sum() / token_norm
        else:
            loss = -u.sum() / ((num_seqs if num_sequences is None else num_sequences) * cfg.norm_max_len)
        if cfg.policy_loss == "cispo":  # weights the clip bounded
            low, high = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
            active = (ratio.detach() > high) | (ratio.detach() < low)
        else:
            active = clip_active(ratio.detach(), adv_tok, cfg)
        clipped = (active & counted).to(dtype).sum()

    with torch.no_grad():
        tokens = counted.sum()  # int64
        sequences = has_tokens.sum()  # the sequences with a counted token (int64)
        had_tokens = segment_sum(given.to(dtype), seq, num_seqs) > 0  # before rejection
        sums = {
            "is_weight_mean": (torch.where(counted, is_weight, zero).sum(), tokens),
            "is_truncated_frac": ((out_of_range & counted).to(dtype).sum(), tokens),
            "filtered_frac": (filtered.to(dtype).sum(), sequences),
            "kl_mean": (torch.where(has_tokens, kl_seq, zero).sum(), sequences),
            "clip_frac": (clipped, sequences if cfg.base_method in ("gepo", "hacpo") else tokens),
            "entropy_mean": (torch.where(counted, entropy.to(dtype), zero).sum(), tokens),
            "logprob_mean": (torch.where(counted, lb, zero).sum(), tokens),
            "rejected_frac": ((given & ~counted).to(dtype).sum(), given.sum()),
            "rejected_seq_frac": (emptied.to(dtype).sum(), had_tokens.sum()),
            "ref_kl_mean": (zero.detach() if ref_kl is None else ref_kl.detach().sum(), tokens),
        }
        per_sequence = {"kl": kl_seq.detach(), "filtered": filtered,
                        "is_weight": _mean(segment_sum(torch.where(counted, is_weight, zero), seq, num_seqs),
                                           tokens_per_seq).detach()}
    return loss, ({k: v.detach() for k, (v, _) in sums.items()}, {k: n for k, (_, n) in sums.items()}), per_sequence


def _gepo(
    logprobs: torch.Tensor,
    g: torch.Tensor,
    adv: torch.Tensor,
    seq: torch.Tensor,
    tokens_per_seq: torch.Tensor,
    counted: torch.Tensor,
    cfg: LossConfig,
    group_ids: torch.Tensor | None,
    seq_norm: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GEPO: s_i = exp(mean_t l_t), q_i = exp(mean_t g_t), E_k = sum q_j^2 / sum q_j over group k,
    u_i = PPO(s_i / E_k, A_i), L = -sum_i u_i / seq_norm (the batch's sequences). Returns the loss and the
    clipped-sequence count."""
    num_seqs = adv.numel()
    zero = logprobs.new_zeros(())
    has_tokens = tokens_per_seq > 0
    mean_l = _mean(segment_sum(torch.where(counted, logprobs, zero), seq, num_seqs), tokens_per_seq)
    mean_g = _mean(segment_sum(g, seq, num_seqs), tokens_per_seq)
    if group_ids is None:
        group, num_groups = torch.zeros(num_seqs, dtype=torch.long, device=adv.device), 1
    else:
        unique, group = torch.unique(group_ids, return_inverse=True)
        num_groups = unique.numel()
    # log E_k = logsumexp(2 * mean_g) - logsumexp(mean_g) over the group's sequences that have tokens.
    masked_g = torch.where(has_tokens, mean_g, torch.full_like(mean_g, -torch.inf))
    log_e = segment_logsumexp(2.0 * masked_g, group, num_groups) - segment_logsumexp(masked_g, group, num_groups)
    log_e = torch.where(torch.isfinite(log_e), log_e, torch.zeros_like(log_e))
    ratio = exp_log_ratio(mean_l - log_e[group])
    u = torch.where(has_tokens, ppo(ratio, adv, cfg), zero)
    clipped = (clip_active(ratio.detach(), adv, cfg) & has_tokens).to(logprobs.dtype).sum()
    return -u.sum() / seq_norm, clipped


# HACPO (arXiv 2603.02604), as its authors coded it: zzx-peter/HACRL-code, recipe/hacpo/hacpo_core_algos.py,
# sequence_mean_log_prob (lines 153-165) and compute_hacpo_loss (lines 168-225); the lower bound is
# HacpoLossConfig.cross_clip_lower (lines 35-40), the index m the count of the step's optimizer steps
# (hacpo_workers.py, MinibatchUpdateCounter). Each side's mean is over its own tokens: the learner's over the
# targets it counts, the source's over the generator's (a final EOS left out of both by the caller, as the
# authors' hacpo_trajectory.py does before anything is computed).


def _hacpo_source(old, gen, seq, tokens_per_seq, counted, is_self, gen_seq, gen_seq_tokens) -> torch.Tensor:
    """[S] the source's mean log-prob of each sequence: mean_t o_t over a learner's own sequence (the authors'
    source actor recomputes its rollouts as the step starts: the old policy), mean_t g_t over a peer's with
    per-token log-probs, and G_i / n_i (the generator's log-prob over its own token count) over a foreign one."""
    zero = old.new_zeros(())
    num_seqs = tokens_per_seq.numel()
    own = _mean(segment_sum(torch.where(counted, old, zero), seq, num_seqs), tokens_per_seq)
    peer = _mean(segment_sum(torch.where(counted, gen, zero), seq, num_seqs), tokens_per_seq)
    if gen_seq is not None and gen_seq_tokens is not None:  # (without counts no entry is finite: the op checks)
        foreign = ~torch.isnan(gen_seq)
        count = torch.where(foreign, gen_seq_tokens, torch.ones_like(gen_seq_tokens)).to(old.dtype)
        peer = torch.where(foreign, torch.nan_to_num(gen_seq.to(old.dtype), nan=0.0) / count, peer)
    return torch.where(is_self, own, peer)


def _hacpo(
    logprobs: torch.Tensor,
    source: torch.Tensor,
    adv: torch.Tensor,
    seq: torch.Tensor,
    tokens_per_seq: torch.Tensor,
    counted: torch.Tensor,
    cfg: LossConfig,
    is_self: torch.Tensor,
    capability: torch.Tensor | None,
    mini_batch_index: int,
    seq_norm: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HACPO's loss from the sequence ratio r_i = exp(clamp(mean_t l_t - source_i, -M, M)), M = max_abs_log_ratio:

        self  (the learner's own):  u_i = min(r_i A_i, clip(r_i, 1 - self_clip_low, 1 + self_clip_high) A_i)
        cross (a peer's):           u_i = k_i sg(k_i)^alpha c_i A_i,   k_i = clip(r_i, lower_m, 1),
                                    lower_m = min(1, 1 - cross_clip_delta + m cross_clip_step)

    and L = -sum_i u_i / seq_norm (the batch's sequences; a sequence without counted tokens adds 0). Returns the
    loss and the count of sequences a clip took (self: PPO's clipped branch strictly the smaller; cross: r_i outside
    [lower_m, 1])."""
    num_seqs = adv.numel()
    zero = logprobs.new_zeros(())
    has_tokens = tokens_per_seq > 0
    mean_l = _mean(segment_sum(torch.where(counted, logprobs, zero), seq, num_seqs), tokens_per_seq)
    bound = cfg.max_abs_log_ratio  # <= 20: the op's own clamp of every log-ratio holds
    ratio = torch.exp(torch.clamp(mean_l - source, -bound, bound))
    clipped_self = torch.clamp(ratio, 1.0 - cfg.self_clip_low, 1.0 + cfg.self_clip_high)
    u_self = torch.minimum(ratio * adv, clipped_self * adv)
    lower = min(1.0, 1.0 - cfg.cross_clip_delta + mini_batch_index * cfg.cross_clip_step)
    kept = torch.clamp(ratio, lower, 1.0)
    c = torch.ones_like(adv) if capability is None else capability.to(adv.dtype)
    u_cross = kept * kept.detach().pow(cfg.alpha) * c * adv
    u = torch.where(has_tokens, torch.where(is_self, u_self, u_cross), zero)
    with torch.no_grad():
        took = torch.where(is_self, clipped_self * adv < ratio * adv, (ratio < lower) | (ratio > 1.0))
        clipped = (took & has_tokens).to(logprobs.dtype).sum()
    return -u.sum() / seq_norm, clipped
