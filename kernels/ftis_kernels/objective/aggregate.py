"""Stage 3 of the objective: the per-token regularisers and one aggregation by normalisation mode (as verl's
agg_loss), from the policy term to the scalar loss."""

from __future__ import annotations

import torch

from ..config import LossConfig
from .prepare import Prepared
from .segments import mean_of, segment_sum
from .terms import PolicyTerm


def with_regularisers(term: PolicyTerm, batch: Prepared, cfg: LossConfig) -> PolicyTerm:
    """A token-level term with the KL penalty to the reference (TRL's beta, verl's kl_loss) and the entropy bonus
    (verl's entropy_coeff), under the policy term's own normaliser:

        u_t := u_t - beta KL_ref,t + entropy_coef H_t

    A sequence-level term has neither (LossConfig refuses them for gepo and hacpo)."""
    if term.level != "token":
        return term
    u = term.u
    if batch.ref_kl is not None and cfg.beta > 0:
        u = u - cfg.beta * batch.ref_kl
    if cfg.entropy_coef != 0:
        u = u + cfg.entropy_coef * batch.entropy
    return PolicyTerm(u, term.clipped, term.level)


def aggregate(term: PolicyTerm, batch: Prepared, cfg: LossConfig) -> torch.Tensor:
    """The loss L from u, which counts only where there is something to count (a counted token; a sequence with one).

    A token-level term, by normalization:
        sequence (GRPO):      L = -(1/S) sum_i (1/|a_i|) sum_t u_t
        token (DAPO):         L = -sum_i sum_t u_t / sum_i |a_i|
        constant (Dr. GRPO):  L = -sum_i sum_t u_t / (S norm_max_len)
    A sequence-level term (gepo, hacpo), whatever the normalization:  L = -(1/S) sum_i u_i.
    S and sum_i |a_i| are the whole batch's when the call is one micro-batch of it; S leaves out the sequences that
    rejection emptied."""
    zero = term.u.new_zeros(())
    if term.level == "sequence":
        return -torch.where(batch.has_tokens, term.u, zero).sum() / batch.seq_norm
    u = torch.where(batch.counted, term.u, zero)
    if cfg.normalization == "sequence":
        return -mean_of(segment_sum(u, batch.seq, batch.num_seqs), batch.tokens_per_seq).sum() / batch.seq_norm
    if cfg.normalization == "token":
        return -u.sum() / batch.token_norm
    return -u.sum() / (batch.batch_sequences * cfg.norm_max_len)
