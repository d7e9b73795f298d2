"""The objective between the vocabulary passes: `ftis_objective` runs the stages of objective/ on one call's
per-token log-probs (O(N) plain torch; autograd through it yields dL/dl_t for the backward pass)."""

from __future__ import annotations

import torch

from .config import LossConfig
from .objective import POLICY_TERMS, ObjectiveInputs, aggregate, prepare, statistics, with_regularisers


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
    entropy: [N] (differentiable: used by the loss only with cfg.entropy_coef != 0); gen_logprobs / old_logprobs:
    [N]; advantages: [S]; cu_seqlens: [S+1]; counted: [N] bool, False where the target is ignore_index;
    group_ids: [S] (gepo only).
    num_sequences / num_tokens: the whole batch's sequences / counted tokens when this call is one micro-batch
    of it (the normaliser of sequence, constant and gepo / of token normalisation); None: this call's own.
    gen_seq_logprobs: [S], NaN or a sequence's generation log-probability G_i (per-token ones unknown): its
    tokens' g_t are spread from it (objective/prepare.py, spread_sequence_logprobs).
    ref_logprobs: [N] the reference policy's log-probs, or None (with cfg.beta > 0, the KL penalty's).
    is_self, gen_seq_tokens [S], capability_ratio [S], mini_batch_index: hacpo's inputs (LossInputs).
    Returns the scalar loss, (sums, counts): per stat key, the detached sum and the int64 count it is over, and
    the per-sequence values behind the stats ([S] each, detached): kl (KL_i), filtered (the filter's verdict) and
    is_weight (the mean IS weight over the sequence's counted tokens).
    """
    inputs = ObjectiveInputs(
        logprobs, entropy, gen_logprobs, advantages, cu_seqlens, counted, old_logprobs=old_logprobs,
        group_ids=group_ids, num_sequences=num_sequences, num_tokens=num_tokens, gen_seq_logprobs=gen_seq_logprobs,
        ref_logprobs=ref_logprobs, is_self=is_self, gen_seq_tokens=gen_seq_tokens, capability_ratio=capability_ratio,
        mini_batch_index=mini_batch_index,
    )
    batch = prepare(inputs, cfg)
    term = POLICY_TERMS[cfg.base_method](batch, cfg)
    loss = aggregate(with_regularisers(term, batch, cfg), batch, cfg)
    stats, per_sequence = statistics(batch, term, cfg)
    return loss, stats, per_sequence
