"""Stage 4 of the objective: the stats of one call, as sums and the counts they are over (so that micro-batches'
add up), and the per-sequence values behind them."""

from __future__ import annotations

import torch

from ..config import LossConfig
from .prepare import Prepared
from .segments import mean_of, segment_sum
from .terms import PolicyTerm


@torch.no_grad()
def statistics(batch: Prepared, term: PolicyTerm, cfg: LossConfig
               ) -> tuple[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """((sums, counts), per_sequence): per key of STAT_KEYS the detached sum and the int64 count it is over (the
    counted tokens, or the sequences with one; clip_frac counts what the term is per), and per sequence ([S] each,
    detached) kl (KL_i), filtered and is_weight (the mean IS weight over its counted tokens)."""
    counted, zero = batch.counted, batch.logprobs.new_zeros(())
    dtype = zero.dtype
    tokens = counted.sum()  # int64
    sequences = batch.has_tokens.sum()
    had_tokens = segment_sum(batch.given.to(dtype), batch.seq, batch.num_seqs) > 0  # before rejection
    by_token = term.level == "token"
    clipped = (term.clipped & (counted if by_token else batch.has_tokens)).to(dtype).sum()
    weights = torch.where(counted, batch.is_weight, zero)
    sums = {
        "is_weight_mean": (weights.sum(), tokens),
        "is_truncated_frac": ((batch.is_out_of_range & counted).to(dtype).sum(), tokens),
        "filtered_frac": (batch.filtered.to(dtype).sum(), sequences),
        "kl_mean": (torch.where(batch.has_tokens, batch.kl, zero).sum(), sequences),
        "clip_frac": (clipped, tokens if by_token else sequences),
        "entropy_mean": (torch.where(counted, batch.entropy, zero).sum(), tokens),
        "logprob_mean": (torch.where(counted, batch.logprobs, zero).sum(), tokens),
        "rejected_frac": ((batch.given & ~counted).to(dtype).sum(), batch.given.sum()),
        "rejected_seq_frac": (batch.emptied.to(dtype).sum(), had_tokens.sum()),
        "ref_kl_mean": (zero if batch.ref_kl is None else batch.ref_kl.sum(), tokens),
    }
    per_sequence = {"kl": batch.kl.detach(), "filtered": batch.filtered,
                    "is_weight": mean_of(segment_sum(weights, batch.seq, batch.num_seqs), batch.tokens_per_seq)}
    return ({k: v.detach() for k, (v, _) in sums.items()}, {k: n for k, (_, n) in sums.items()}), per_sequence
