"""Packed-row attention with torch's own FlashAttention-2 kernel (`torch.nn.attention.varlen.varlen_attn`, torch >=
2.10): no flash-attn package, no mask. `train.attn_implementation: varlen` registers it with transformers under the
name "varlen".

The update packs a member's sequences in one row with position ids that restart at 0 for each sequence
(batch.py); the sequences' boundaries (cu_seqlens) come from those restarts, so each sequence attends to itself
only, causally, with grouped-query heads (Qwen's 2 KV heads) passed to the kernel as they are where it takes
them, repeated where it does not. Anything else (a generator's padded batch, decoding with a KV cache) goes
through sdpa with the padding mask, so one model object serves both.
"""

from __future__ import annotations

import functools
import inspect

import torch

NAME = "varlen"


def available() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel():
    """(varlen_attn, how it is told 'causal', whether it takes grouped-query heads): torch 2.10-2.11 take
    is_causal, later releases window_size=(-1, 0) and enable_gqa."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    return varlen_attn, causal, "enable_gqa" in params


def sequence_bounds(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """cu_seqlens (int32, [N + 1]) and the longest sequence of one packed row whose positions restart at 0."""
    positions = position_ids.reshape(-1)
    starts = torch.nonzero(positions == 0).flatten()
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("a packed row must start a sequence at its first token (position 0)")
    cu = torch.cat([starts, torch.tensor([positions.numel()], device=positions.device)]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, position_ids=None,
                     **kwargs):
    """transformers' attention interface: query [B, H, T, D], key and value [B, H_kv, S, D]; returns the output
    [B, T, H, D] and no weights."""
    packed = query.shape[0] == 1 and position_ids is not None and query.shape[2] == key.shape[2] and (
        attention_mask is None or bool(attention_mask.all()))
    if not packed:
        return _sdpa(module, query, key, value, attention_mask, scaling)
    kernel, causal, gqa = _kernel()
    # FlashAttention takes fp16/bf16 only, and autocast does not cover this kernel as it covers sdpa: with float32
    # master weights the rotary embedding widens q and k to float32 (cos and sin are float32). Compute in the
    # autocast dtype, as sdpa would.
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    if torch.float32 in (q.dtype, k.dtype, v.dtype):
        low = (torch.get_autocast_dtype(q.device.type) if torch.is_autocast_enabled(q.device.type)
               else torch.bfloat16)
        q, k, v = q.to(low), k.to(low), v.to(low)
    if not gqa and k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    cu, longest = sequence_bounds(position_ids)
    extra = {"enable_gqa": True} if gqa and k.shape[1] != q.shape[1] else {}
    out = kernel(q, k, v, cu, cu, longest, longest, scale=scaling, **causal, **extra)
    return out[None], None


def _sdpa(module, query, key, value, attention_mask, scaling):
    """The unpacked case: causal attention over a padded batch (attention_mask [B, S], 1 = a token), the query
    being the last T of the S positions (decoding with a cache)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    t, s = query.shape[2], key.shape[2]
    mask = torch.ones(t, s, dtype=torch.bool, device=query.device).tril(s - t)[None, None]
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, None, -s:].bool()
        mask = mask | ~mask.any(-1, keepdim=True)  # a padding query that sees nothing: finite garbage, not NaN
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make "varlen" an attention implementation transformers models can be loaded with (its mask: none, as for
    FlashAttention; the 2D padding mask passes through for the sdpa fallback)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, varlen_attention)
    AttentionMaskInterface.register(NAME, flash_attention_mask)
