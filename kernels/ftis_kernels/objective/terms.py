"""Stage 2 of the objective: the policy term u of each method, looked up by name in POLICY_TERMS (as verl's
registered policy losses). A term is one function of the prepared per-token and per-sequence tensors; it returns
u per token (nois, vis, tis) or per sequence (gepo, hacpo) and where a clip took it. The aggregation (stage 3)
masks it to what counts and divides it by the normaliser.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import LossConfig
from .prepare import Prepared
from .segments import exp_log_ratio, segment_logsumexp


@dataclass(frozen=True)
class PolicyTerm:
    """u ([N] per token or [S] per sequence, differentiable), `clipped` (the same shape, bool, detached: where a
    clip took the term, so that its gradient is zero) and `level`: "token" or "sequence"."""

    u: torch.Tensor
    clipped: torch.Tensor
    level: str


# ----------------------------------------------------------------------------------------------- the clip


def ppo(ratio: torch.Tensor, advantage: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """PPO(r, A) = min(r' A, clip(r, 1 - eps_low, 1 + eps_high) A), r' = min(r, delta) under the two-sided clip
    (else r' = r); under the dual clip, max(that, c A) where A < 0."""
    clipped = torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    capped = ratio if cfg.delta is None else torch.clamp(ratio, max=cfg.delta)
    u = torch.minimum(capped * advantage, clipped * advantage)
    if cfg.dual_clip is not None:
        u = torch.where(advantage < 0, torch.maximum(u, cfg.dual_clip * advantage), u)
    return u


def clip_active(ratio: torch.Tensor, advantage: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """Where a clip took PPO's term (its gradient is zero): the clipped branch strictly the smaller one, the ratio
    above delta on the chosen branch, or the dual clip's c A strictly the larger."""
    clipped = torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * advantage
    capped = ratio if cfg.delta is None else torch.clamp(ratio, max=cfg.delta)
    unclipped = capped * advantage
    active = clipped < unclipped
    if cfg.delta is not None:
        active |= (ratio > cfg.delta) & (unclipped <= clipped) & (advantage != 0)
    if cfg.dual_clip is not None:
        active |= (advantage < 0) & (cfg.dual_clip * advantage > torch.minimum(unclipped, clipped))
    return active


def _ppo_loss(ratio, advantage, logprobs, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    return ppo(ratio, advantage, cfg), clip_active(ratio.detach(), advantage, cfg)


def _cispo_loss(ratio, advantage, logprobs, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1): u_t = sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_i l_t, the clipped weight times A on
    the log-prob's gradient; a clip took the term where it bounded the weight."""
    low, high = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    weight = ratio.detach()
    return torch.clamp(weight, low, high) * advantage * logprobs, (weight > high) | (weight < low)


# the token methods' clipped objective, by LossConfig.policy_loss: (ratio, A, l) -> (u, clipped)
TOKEN_LOSSES = {"ppo": _ppo_loss, "cispo": _cispo_loss}


# ----------------------------------------------------------------------------------------------- token methods


def _token_term(batch: Prepared, cfg: LossConfig, reference: torch.Tensor, weight: torch.Tensor | None
                ) -> PolicyTerm:
    """u_t = [w_t] policy_loss(r_t, A_i, l_t) with r_t = exp(l_t - reference_t), or under ratio_level sequence
    (GSPO) s_i = exp(mean_t (l_t - reference_t)) for every token of sequence i."""
    log_ratio = torch.where(batch.counted, batch.logprobs - reference, batch.logprobs.new_zeros(()))
    if cfg.ratio_level == "sequence":
        log_ratio = batch.sequence_mean(log_ratio)[batch.seq]
    ratio = exp_log_ratio(log_ratio)
    u, clipped = TOKEN_LOSSES[cfg.policy_loss](ratio, batch.advantages[batch.seq], batch.logprobs, cfg)
    return PolicyTerm(u if weight is None else weight * u, clipped, "token")


def nois_term(batch: Prepared, cfg: LossConfig) -> PolicyTerm:
    """nois: u_t = PPO(exp(l_t - o_t), A_i)."""
    return _token_term(batch, cfg, batch.old, None)


def vis_term(batch: Prepared, cfg: LossConfig) -> PolicyTerm:
    """vis: u_t = PPO(exp(l_t - g_t), A_i)."""
    return _token_term(batch, cfg, batch.g, None)


def tis_term(batch: Prepared, cfg: LossConfig) -> PolicyTerm:
    """tis (F-TIS with the filter): u_t = w_t PPO(exp(l_t - o_t), A_i), w_t the truncated IS weight (a constant)."""
    return _token_term(batch, cfg, batch.old, batch.is_weight)


# ----------------------------------------------------------------------------------------------- sequence methods


def gepo_term(batch: Prepared, cfg: LossConfig) -> PolicyTerm:
    """GEPO: s_i = exp(mean_t l_t), q_i = exp(mean_t g_t), E_k = sum_j q_j^2 / sum_j q_j over group k
    (group_ids; one group without them), u_i = PPO(s_i / E_k, A_i)."""
    group_ids = batch.inputs.group_ids
    if group_ids is None:
        group, num_groups = torch.zeros(batch.num_seqs, dtype=torch.long, device=batch.seq.device), 1
    else:
        unique, group = torch.unique(group_ids, return_inverse=True)
        num_groups = unique.numel()
    mean_g = batch.sequence_mean(batch.g)
    # log E_k = logsumexp(2 mean_g) - logsumexp(mean_g) over the group's sequences that have tokens
    masked_g = torch.where(batch.has_tokens, mean_g, torch.full_like(mean_g, -torch.inf))
    log_e = segment_logsumexp(2.0 * masked_g, group, num_groups) - segment_logsumexp(masked_g, group, num_groups)
    log_e = torch.where(torch.isfinite(log_e), log_e, torch.zeros_like(log_e))
    ratio = exp_log_ratio(batch.sequence_mean(batch.logprobs) - log_e[group])
    return PolicyTerm(ppo(ratio, batch.advantages, cfg), clip_active(ratio.detach(), batch.advantages, cfg),
                      "sequence")


# HACPO (arXiv 2603.02604), as its authors coded it: zzx-peter/HACRL-code, recipe/hacpo/hacpo_core_algos.py,
# sequence_mean_log_prob (lines 153-165) and compute_hacpo_loss (lines 168-225); the lower bound is
# HacpoLossConfig.cross_clip_lower (lines 35-40), the index m the count of the step's optimizer steps
# (hacpo_workers.py, MinibatchUpdateCounter). Each side's mean is over its own tokens: the learner's over the
# targets it counts, the source's over the generator's (a final EOS left out of both by the caller, as the
# authors' hacpo_trajectory.py does before anything is computed).


def hacpo_source(batch: Prepared) -> torch.Tensor:
    """[S] the source's mean log-prob s_i of each sequence: mean_t o_t over a learner's own sequence (the authors'
    source actor recomputes its rollouts as the step starts: the old policy), mean_t g_t over a peer's with
    per-token log-probs, and G_i / n_i (the generator's log-prob over its own token count) over a foreign one."""
    inputs = batch.inputs
    own = batch.sequence_mean(batch.old)
    peer = batch.sequence_mean(batch.own_gen)
    if inputs.gen_seq_logprobs is not None and inputs.gen_seq_tokens is not None:  # (the op checks: both or none)
        gen_seq, tokens = inputs.gen_seq_logprobs, inputs.gen_seq_tokens
        foreign = ~torch.isnan(gen_seq)
        count = torch.where(foreign, tokens, torch.ones_like(tokens)).to(own.dtype)
        peer = torch.where(foreign, torch.nan_to_num(gen_seq.to(own.dtype), nan=0.0) / count, peer)
    return torch.where(inputs.is_self, own, peer)


def hacpo_term(batch: Prepared, cfg: LossConfig) -> PolicyTerm:
    """HACPO, from the sequence ratio r_i = exp(clamp(mean_t l_t - s_i, -M, M)), M = max_abs_log_ratio:

        self  (the learner's own):  u_i = min(r_i A_i, clip(r_i, 1 - self_clip_low, 1 + self_clip_high) A_i)
        cross (a peer's):           u_i = k_i sg(k_i)^alpha c_i A_i,   k_i = clip(r_i, lower_m, 1),
                                    lower_m = min(1, 1 - cross_clip_delta + m cross_clip_step)

    A clip took a self term where PPO's clipped branch is strictly the smaller, a cross term where r_i is outside
    [lower_m, 1]."""
    inputs, adv = batch.inputs, batch.advantages
    bound = cfg.max_abs_log_ratio  # <= 20: the op's own clamp of every log-ratio holds
    ratio = torch.exp(torch.clamp(batch.sequence_mean(batch.logprobs) - hacpo_source(batch), -bound, bound))
    clipped_self = torch.clamp(ratio, 1.0 - cfg.self_clip_low, 1.0 + cfg.self_clip_high)
    u_self = torch.minimum(ratio * adv, clipped_self * adv)
    lower = min(1.0, 1.0 - cfg.cross_clip_delta + (inputs.mini_batch_index or 0) * cfg.cross_clip_step)
    kept = torch.clamp(ratio, lower, 1.0)
    c = torch.ones_like(adv) if inputs.capability_ratio is None else inputs.capability_ratio.to(adv.dtype)
    u_cross = kept * kept.detach().pow(cfg.alpha) * c * adv
    with torch.no_grad():
        took = torch.where(inputs.is_self, clipped_self * adv < ratio * adv, (ratio < lower) | (ratio > 1.0))
    return PolicyTerm(torch.where(inputs.is_self, u_self, u_cross), took, "sequence")


# the policy term of each method (LossConfig.base_method: the method without its filter prefix)
POLICY_TERMS: dict[str, Callable[[Prepared, LossConfig], PolicyTerm]] = {
    "nois": nois_term,
    "vis": vis_term,
    "tis": tis_term,
    "gepo": gepo_term,
    "hacpo": hacpo_term,
}
