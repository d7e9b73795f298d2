"""Random packed problems for the loss-op tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Problem:
    hidden: torch.Tensor  # [N, d] float64
    weight: torch.Tensor  # [V, d] float64
    bias: torch.Tensor  # [V] float64
    targets: torch.Tensor  # [N] int64
    gen: torch.Tensor  # [N] float32
    old: torch.Tensor  # [N] float32
    adv: torch.Tensor  # [S] float32
    cu: torch.Tensor  # [S+1] int32
    group_ids: torch.Tensor  # [S] int64

    def logits(self, with_bias: bool = True) -> torch.Tensor:
        z = self.hidden @ self.weight.T
        return z + self.bias if with_bias else z


def make_problem(seed: int, n_seqs: int = 6, max_len: int = 9, vocab: int = 75, dim: int = 24,
                 ignore_frac: float = 0.15, spread: float = 1.0, ignore_index: int = -100) -> Problem:
    """Sequences of random length (always including a length-1 one), a vocabulary that is not a multiple of any
    block size, some ignored targets, and generation log-probs that differ from the model's by `spread` nats."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (n_seqs,), generator=g)
    lengths[0] = 1
    cu = torch.zeros(n_seqs + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    n = int(cu[-1])
    hidden = torch.randn(n, dim, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, dim, generator=g, dtype=torch.float64) / dim**0.5
    bias = 0.3 * torch.randn(vocab, generator=g, dtype=torch.float64)
    targets = torch.randint(0, vocab, (n,), generator=g)
    ignored = torch.rand(n, generator=g) < ignore_frac
    ignored[0] = False  # the length-1 sequence counts
    targets[ignored] = ignore_index
    logp = torch.log_softmax(hidden @ weight.T + bias, -1)
    model_lp = logp.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    gen = (model_lp + spread * torch.randn(n, generator=g, dtype=torch.float64)).clamp(max=0).float()
    old = (model_lp + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)).clamp(max=0).float()
    adv = torch.randn(n_seqs, generator=g)
    adv[1] = -abs(float(adv[1]))
    group_ids = torch.arange(n_seqs) % 2
    return Problem(hidden, weight, bias, targets, gen, old, adv, cu, group_ids)
