"""The objective between the vocabulary passes: `ftis_objective` runs the stages of objective/ on one call's
per-token log-probs (O(N) plain torch; autograd through it yields dL/dl_t for the backward pass)."""

from __future__ import annotations

import torch

from .config import LossConfig, LossInputs
from .objective import POLICY_TERMS, aggregate, prepare, statistics, with_regularisers


def ftis_objective(
    logprobs: torch.Tensor, entropy: torch.Tensor, counted: torch.Tensor, inputs: LossInputs, cfg: LossConfig,
) -> tuple[torch.Tensor, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Loss and stats of one update (or one micro-batch of it) from per-token log-probs.

    logprobs: [N] l_t, differentiable, computed in the arithmetic dtype (fp32, or fp64 for fp64 inputs);
    entropy: [N] (differentiable: used by the loss only with cfg.entropy_coef != 0); counted: [N] bool, False where
    the target is ignore_index; inputs: the op's inputs as LossInputs documents them (its targets are not read;
    the vocabulary pass has turned them into l_t), checked by the op before this is called.
    Returns the scalar loss, (sums, counts): per stat key, the detached sum and the int64 count it is over, and
    the per-sequence values behind the stats ([S] each, detached): kl (KL_i), filtered (the filter's verdict) and
    is_weight (the mean IS weight over the sequence's counted tokens).
    """
    batch = prepare(logprobs, entropy, counted, inputs, cfg)
    term = POLICY_TERMS[cfg.base_method](batch, cfg)
    loss = aggregate(with_regularisers(term, batch, cfg), batch, cfg)
    stats, per_sequence = statistics(batch, term, cfg)
    return loss, stats, per_sequence
