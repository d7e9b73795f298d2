"""Reductions over the packed batch ([N] tokens of S sequences, delimited by cu_seqlens) and the clamped exp that
every log-ratio goes through."""

from __future__ import annotations

import torch

LOG_RATIO_CLAMP = 20.0  # every log-ratio is clamped to [-20, 20] before exp


def sequence_index(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[N] int64: the sequence each packed token belongs to."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seqs = torch.arange(lengths.numel(), device=cu_seqlens.device)
    return torch.repeat_interleave(seqs, lengths, output_size=num_tokens)


def segment_sum(values: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """Differentiable sum of `values` into `size` buckets given by `index`."""
    return values.new_zeros(size).index_add(0, index, values)


def segment_max(values: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """Max of `values` per bucket; an empty bucket gives -inf. No gradient."""
    return values.new_full((size,), -torch.inf).scatter_reduce(0, index, values, "amax", include_self=True)


def segment_logsumexp(values: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """log(sum(exp(values))) per bucket; -inf entries are ignored, an empty bucket gives -inf. No gradient."""
    peak = segment_max(values, index, size)
    safe_peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    total = segment_sum(torch.exp(values - safe_peak[index]), index, size)
    return safe_peak + torch.log(total)


def mean_of(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """total / count, where an empty count (0 / 0, a sequence without a counted token) gives 0."""
    return total / torch.clamp(count, min=1)


def exp_log_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp of a log-ratio clamped to [-20, 20]."""
    return torch.exp(torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
