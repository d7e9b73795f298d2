"""Chunked PyTorch twin of the Triton vocabulary passes: the CPU backend.

Same contract as kernels/ftis_kernels/logprobs.py + kernels/ftis_kernels/backward.py: per-token log-prob of the target at temperature T,
entropy of the tempered distribution, and in backward the gradient of the logits, or of hidden, weight and bias,
recomputed chunk by chunk over tokens so that peak memory is chunk x V, never N x V.
Arithmetic is fp32 (fp64 for fp64 inputs, so that gradcheck can run on this backend).
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_ELEMENTS = 1 << 22  # 4M logits per chunk: 16 MiB per fp32 temporary


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunk_rows(vocab_size: int, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS, n: int | None = None) -> int:
    """Token rows per chunk: chunk_elements logits, and for n > 1 tokens at most half of them, so that no N x V
    tensor exists even where the whole batch would fit one chunk."""
    rows = max(1, chunk_elements // max(1, vocab_size))
    return rows if n is None or n <= 1 else min(rows, (n + 1) // 2)


def _tempered_logits(x, weight, bias, inv_temp: float, cdt: torch.dtype) -> torch.Tensor:
    if weight is None:
        z = x.to(cdt)
    else:
        z = x.to(cdt) @ weight.t()
        if bias is not None:
            z = z + bias
    return z * inv_temp


class ChunkedTokenLogprobs(torch.autograd.Function):
    """(x, weight, bias) -> per-token log-probs [N] and entropy [N], both differentiable (the entropy's gradient
    is computed only when the loss uses it: an entropy bonus).

    Logits mode: x is logits [N, V] and weight/bias are None. Fused-linear mode: x is hidden [N, d],
    weight [V, d], bias [V] or None; the logits only ever exist one chunk of rows at a time.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, targets, counted, temperature: float, rows: int):
        cdt = compute_dtype(x.dtype)
        inv_temp = 1.0 / temperature
        w = None if weight is None else weight.to(cdt)
        b = None if bias is None else bias.to(cdt)
        n = x.shape[0]
        safe_targets = torch.where(counted, targets, torch.zeros_like(targets)).long()
        target_logit = torch.empty(n, dtype=cdt, device=x.device)
        lse = torch.empty(n, dtype=cdt, device=x.device)
        entropy = torch.empty(n, dtype=cdt, device=x.device)
        for start in range(0, n, rows):
            sl = slice(start, min(start + rows, n))
            z = _tempered_logits(x[sl], w, b, inv_temp, cdt)
            lse[sl] = torch.logsumexp(z, dim=-1)
            log_p = z - lse[sl, None]
            p = torch.exp(log_p)
            entropy[sl] = -torch.where(p > 0, p * log_p, torch.zeros_like(p)).sum(-1)
            target_logit[sl] = z.gather(1, safe_targets[sl, None]).squeeze(1)
        logprobs = torch.where(counted, target_logit - lse, torch.zeros_like(lse))
        ctx.save_for_backward(x, weight, bias, safe_targets, counted, lse, entropy)
        ctx.inv_temp, ctx.rows = inv_temp, rows
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None, not zeros
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        x, weight, bias, targets, counted, lse, entropy = ctx.saved_tensors
        cdt = lse.dtype
        zero = torch.zeros_like(lse)
        # dl_t/dz_v = onehot_v - p_v and z = logits / T, so dL/dlogits = c_t (onehot - p) with c_t = dL/dl_t / T;
        # dH_t/dz_v = -p_v (log p_v + H_t), so an entropy term adds -e_t p_v (log p_v + H_t), e_t = dL/dH_t / T.
        coef = zero if grad_logprobs is None else torch.where(counted, grad_logprobs.to(cdt), zero) * ctx.inv_temp
        ecoef = None if grad_entropy is None else torch.where(counted, grad_entropy.to(cdt), zero) * ctx.inv_temp
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        w = None if weight is None else weight.to(cdt)
        b = None if bias is None else bias.to(cdt)
        dx = torch.empty_like(x) if need_x else None
        dw = torch.zeros_like(w) if (weight is not None and need_w) else None
        db = torch.zeros_like(b) if (bias is not None and need_b) else None
        n = x.shape[0]
        for start in range(0, n, ctx.rows):
            sl = slice(start, min(start + ctx.rows, n))
            z = _tempered_logits(x[sl], w, b, ctx.inv_temp, cdt)
            if ecoef is None:
                grad = torch.exp(z - lse[sl, None]).mul_(-coef[sl, None])
            else:
                log_p = z - lse[sl, None]
                grad = -torch.exp(log_p) * (coef[sl, None] + ecoef[sl, None] * (log_p + entropy[sl, None]))
            grad.scatter_add_(1, targets[sl, None], coef[sl, None])
            if weight is None:
                if dx is not None:
                    dx[sl] = grad.to(x.dtype)
                continue
            if dx is not None:
                dx[sl] = (grad @ w).to(x.dtype)
            if dw is not None:
                dw.addmm_(grad.t(), x[sl].to(cdt))
            if db is not None:
                db += grad.sum(0)
        dw = None if dw is None else dw.to(weight.dtype)
        db = None if db is None else db.to(bias.dtype)
        return dx, dw, db, None, None, None, None


def chunked_token_logprobs(x, weight, bias, targets, counted, temperature: float, chunk_elements: int | None = None):
    """[N] log-probs (differentiable) and [N] entropy through the chunked torch pass."""
    vocab = x.shape[1] if weight is None else weight.shape[0]
    rows = chunk_rows(vocab, chunk_elements or DEFAULT_CHUNK_ELEMENTS, x.shape[0])
    return ChunkedTokenLogprobs.apply(x, weight, bias, targets, counted, float(temperature), rows)
