"""train.attn_implementation: varlen (attention.py). torch's varlen kernel runs on CUDA only; here a float64-exact
stand-in with its signature takes its place, and the model-level tests check what the engine adds around it:
sequence bounds from the packed row's positions, grouped-query heads, causality, isolation of packed sequences,
and the sdpa path a generator's padded batch takes."""

from __future__ import annotations

import pytest
import torch

from ftis_engine.model import attention
from ftis_engine.config import ConfigError
from ftis_engine.model.models import load_model


def reference_kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False,
                     return_aux=None):
    """torch >= 2.12's varlen_attn, on the CPU: each sequence [cu[i], cu[i+1]) attends causally to itself."""
    assert window_size == (-1, 0) and torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
    assert max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
    if k.shape[1] != q.shape[1]:
        assert enable_gqa
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    out = torch.empty_like(q)
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), is_causal=True, scale=scale
        ).transpose(0, 1)
    return out


def old_kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False, scale=None, return_aux=None):
    """torch 2.10-2.11's signature: is_causal, and no grouped-query heads (they come repeated)."""
    assert is_causal and k.shape[1] == q.shape[1]
    return reference_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0))


@pytest.fixture(params=["current", "old"])
def kernel(request, monkeypatch):
    if request.param == "current":
        monkeypatch.setattr(attention, "_kernel", lambda: (reference_kernel, {"window_size": (-1, 0)}, True))
    else:
        monkeypatch.setattr(attention, "_kernel", lambda: (old_kernel, {"is_causal": True}, False))
    attention.register()
    return request.param


def test_sequence_bounds_come_from_the_restarting_positions():
    cu, longest = attention.sequence_bounds(torch.tensor([[0, 1, 2, 0, 1, 0]]))
    assert cu.tolist() == [0, 3, 5, 6] and cu.dtype == torch.int32 and longest == 3
    with pytest.raises(ValueError, match="position 0"):
        attention.sequence_bounds(torch.tensor([[1, 2, 0]]))


def _pair(spec="builtin:tiny-m"):
    varlen = load_model(spec, 101, torch.float64, 0, attention.NAME)
    sdpa = load_model(spec, 101, torch.float64, 0, "sdpa")
    return varlen.eval(), sdpa.eval()


def test_a_packed_row_equals_each_sequence_run_alone_with_grouped_query_heads(kernel):
    varlen, sdpa = _pair()  # tiny-m: 6 query heads, 2 KV heads
    assert varlen.config.num_attention_heads != varlen.config.num_key_value_heads
    lengths = [5, 3, 7]
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, 101, (n,), generator=g) for n in lengths]
    ids = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = varlen(input_ids=ids, position_ids=positions).logits[0]
        alone = torch.cat([sdpa(input_ids=s[None]).logits[0] for s in seqs])
    torch.testing.assert_close(packed, alone, rtol=1e-10, atol=1e-10)


def test_gradients_through_the_packed_row_equal_sdpa_per_sequence(kernel):
    varlen, sdpa = _pair("builtin:tiny-s")
    lengths = [4, 6]
    ids = torch.randint(1, 101, (sum(lengths),), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    varlen(input_ids=ids[None], position_ids=positions).logits.square().sum().backward()
    total = sum(sdpa(input_ids=part[None]).logits.square().sum() for part in ids.split(lengths))
    total.backward()
    for (name, a), b in zip(varlen.named_parameters(), sdpa.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-9, msg=name)


def test_a_padded_batch_generates_as_sdpa_does(kernel):
    varlen, sdpa = _pair()
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])  # the first row left-padded
    mask = (torch.arange(5) >= torch.tensor([[2], [0]])).long()
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        assert torch.equal(varlen.generate(ids, **kwargs), sdpa.generate(ids, **kwargs))


def test_varlen_needs_a_cuda_gpu():
    from ftis_engine.member.members import attention_implementation

    with pytest.raises(ConfigError, match="^train.attn_implementation: varlen"):
        attention_implementation("varlen", torch.device("cpu"))


def test_auto_picks_torchs_varlen_kernel_on_a_gpu_where_torch_has_it_and_sdpa_on_the_cpu(monkeypatch):
    """train.attn_implementation auto: flash_attention_2 where installed, else varlen where this torch has it (2.1x
    sdpa's update on an H100), else sdpa; on the CPU always sdpa. Decided without a GPU: the choice reads the
    device's type only."""
    import importlib.util

    from ftis_engine.member.members import attention_implementation

    cuda = torch.device("cuda")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else real(name, *a))
    assert attention_implementation("auto", torch.device("cpu")) == "sdpa"
    monkeypatch.setattr(attention, "available", lambda: True)
    assert attention_implementation("auto", cuda) == attention.NAME
    monkeypatch.setattr(attention, "available", lambda: False)
    assert attention_implementation("auto", cuda) == "sdpa"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else real(name, *a))
    assert attention_implementation("auto", cuda) == "flash_attention_2"
