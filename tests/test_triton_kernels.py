"""The Triton vocabulary passes (run by Triton's interpreter on CPU) against the chunked torch twin and float64
log_softmax, over tile shapes that leave ragged edges in N, V and d, and several vocabulary slices."""

from __future__ import annotations

import pytest
import torch

from ftis_kernels.backward import TritonTokenLogprobs, backward_grid
from ftis_kernels.logprobs import Blocks, forward_grid
from ftis_kernels.reference import chunked_token_logprobs

BLOCKS = [
    Blocks(block_n=16, block_v=16, block_d=16, splits=1),
    Blocks(block_n=16, block_v=32, block_d=16, splits=3),
    Blocks(block_n=32, block_v=16, block_d=32, splits=8),
]


def _inputs(seed, n=37, vocab=75, dim=24, ignore=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, dim, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, dim, generator=g, dtype=torch.float64) / dim**0.5
    bias = torch.randn(vocab, generator=g, dtype=torch.float64)
    targets = torch.randint(0, vocab, (n,), generator=g)
    if ignore:
        targets[::5] = -100
    return hidden, weight, bias, targets


def _float64_reference(hidden, weight, bias, targets, temperature, grad_out):
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    logits = (h @ w.T + b) / temperature
    logp = torch.log_softmax(logits, -1)
    counted = targets != -100
    lp = torch.where(counted, logp.gather(1, targets.clamp(min=0)[:, None]).squeeze(1), 0.0)
    entropy = -(logp.exp() * logp).sum(-1)
    (lp * grad_out).sum().backward()
    return lp.detach(), entropy.detach(), h.grad, w.grad, b.grad


CHUNKED = [
    # chunk_elements / n gives 32 columns per chunk (3 chunks, the last ragged) and 16 (5 chunks)
    Blocks(block_n=16, block_v=16, block_d=16, splits=2, strategy="chunked", chunk_elements=37 * 32, group_n=2),
    Blocks(block_n=32, block_v=16, block_d=32, splits=1, strategy="chunked", chunk_elements=37 * 16, group_n=8),
]


def _blocks_id(b: Blocks) -> str:
    return f"{b.strategy}-n{b.block_n}-v{b.block_v}-d{b.block_d}-s{b.splits}-c{b.chunk_elements}"


@pytest.mark.parametrize("blocks", BLOCKS + CHUNKED, ids=_blocks_id)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_fused_linear_pass_matches_float64(blocks, with_bias):
    """Both backward strategies; the chunked blocks cut the vocabulary (75) into ragged chunks of 32 and 16."""
    hidden, weight, bias, targets = _inputs(1)
    counted = targets != -100
    grad_out = torch.randn(hidden.shape[0], dtype=torch.float64)
    ref_lp, ref_ent, ref_dh, ref_dw, ref_db = _float64_reference(
        hidden, weight, bias if with_bias else torch.zeros_like(bias), targets, 0.9, grad_out
    )
    h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    b = bias.float().requires_grad_() if with_bias else None
    lp, ent = TritonTokenLogprobs.apply(h, w, b, targets, counted, 0.9, blocks)
    (lp * grad_out.float()).sum().backward()
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.grad.double(), ref_dh, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), ref_dw, rtol=1e-4, atol=1e-5)
    if with_bias:
        torch.testing.assert_close(b.grad.double(), ref_db, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("blocks", BLOCKS + CHUNKED, ids=_blocks_id)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_the_entropys_gradient_matches_float64_through_both_backward_strategies(blocks, backend):
    """An entropy bonus differentiates H_t too: d/dz of sum_t (a_t l_t + b_t H_t) against float64 autograd of a
    full log_softmax, the chunked and atomic Triton strategies and the chunked torch twin, ignored rows included
    (their entropy's gradient is zero, as their log-prob's)."""
    hidden, weight, bias, targets = _inputs(3)
    counted = targets != -100
    g = torch.Generator().manual_seed(4)
    grad_lp, grad_ent = (torch.randn(hidden.shape[0], generator=g, dtype=torch.float64) for _ in range(2))
    h64, w64, b64 = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    logp = torch.log_softmax((h64 @ w64.T + b64) / 0.8, -1)
    lp64 = torch.where(counted, logp.gather(1, targets.clamp(min=0)[:, None]).squeeze(1), 0.0)
    ent64 = torch.where(counted, -(logp.exp() * logp).sum(-1), 0.0)
    (lp64 * grad_lp + ent64 * grad_ent).sum().backward()
    h, w, b = (t.float().requires_grad_() for t in (hidden, weight, bias))
    if backend == "triton":
        lp, ent = TritonTokenLogprobs.apply(h, w, b, targets, counted, 0.8, blocks)
    else:
        lp, ent = chunked_token_logprobs(h, w, b, targets, counted, 0.8, chunk_elements=blocks.block_n * 75)
    (lp * grad_lp.float() + torch.where(counted, ent, 0.0) * grad_ent.float()).sum().backward()
    for ours, ref in ((h.grad, h64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
        torch.testing.assert_close(ours.double(), ref, rtol=1e-4, atol=1e-5)
    # the entropy alone (no log-prob term in the loss) still has its gradient
    h.grad = w.grad = b.grad = None
    lp, ent = TritonTokenLogprobs.apply(h, w, b, targets, counted, 0.8, blocks) if backend == "triton" else \
        chunked_token_logprobs(h, w, b, targets, counted, 0.8)
    torch.where(counted, ent, 0.0).sum().backward()
    h64 = hidden.clone().requires_grad_()
    logp = torch.log_softmax((h64 @ weight.T + bias) / 0.8, -1)
    (dh,) = torch.autograd.grad(torch.where(counted, -(logp.exp() * logp).sum(-1), 0.0).sum(), h64)
    torch.testing.assert_close(h.grad.double(), dh, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("blocks", BLOCKS, ids=lambda b: f"n{b.block_n}-v{b.block_v}-s{b.splits}")
def test_logits_pass_matches_float64_and_writes_only_the_input_gradient(blocks):
    hidden, weight, bias, targets = _inputs(2)
    counted = targets != -100
    logits64 = (hidden @ weight.T + bias).requires_grad_()
    grad_out = torch.randn(hidden.shape[0], dtype=torch.float64)
    logp = torch.log_softmax(logits64 / 1.3, -1)
    ref_lp = torch.where(counted, logp.gather(1, targets.clamp(min=0)[:, None]).squeeze(1), 0.0)
    (ref_lp * grad_out).sum().backward()
    logits = logits64.detach().float().requires_grad_()
    lp, _ = TritonTokenLogprobs.apply(logits, None, None, targets, counted, 1.3, blocks)
    (lp * grad_out.float()).sum().backward()
    torch.testing.assert_close(lp.double(), ref_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits.grad.double(), logits64.grad, rtol=1e-4, atol=1e-6)
    assert torch.all(logits.grad[~counted] == 0)


def test_frozen_weight_gets_no_gradient_and_hidden_still_does():
    """LoRA members freeze the lm_head: the pass must not compute (or allocate) dW then."""
    hidden, weight, _, targets = _inputs(3, ignore=False)
    counted = torch.ones_like(targets, dtype=torch.bool)
    h = hidden.float().requires_grad_()
    w = weight.float()
    lp, _ = TritonTokenLogprobs.apply(h, w, None, targets, counted, 1.0, BLOCKS[1])
    lp.sum().backward()
    ref_lp, ref_ent = chunked_token_logprobs(hidden, weight, None, targets, counted, 1.0)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)
    assert h.grad is not None and w.grad is None


def test_blocks_with_all_zero_gradient_are_skipped_exactly():
    """Token blocks whose upstream gradient is zero contribute exactly nothing (they are skipped)."""
    hidden, weight, _, targets = _inputs(4, n=48, ignore=False)
    counted = torch.ones_like(targets, dtype=torch.bool)
    h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    lp, _ = TritonTokenLogprobs.apply(h, w, None, targets, counted, 1.0, BLOCKS[0])
    grad_out = torch.zeros(48)
    grad_out[16:32] = 1.0
    (lp * grad_out).sum().backward()
    assert torch.all(h.grad[:16] == 0) and torch.all(h.grad[32:] == 0)
    assert torch.any(h.grad[16:32] != 0)


def test_half_precision_inputs_run_with_fp32_accumulation():
    hidden, weight, bias, targets = _inputs(5)
    counted = targets != -100
    for dtype in (torch.bfloat16, torch.float16):
        h, w, b = hidden.to(dtype), weight.to(dtype), bias.to(dtype)
        lp, ent = TritonTokenLogprobs.apply(h, w, b, targets, counted, 1.0, BLOCKS[1])
        ref_lp, ref_ent = chunked_token_logprobs(h.double(), w.double(), b.double(), targets, counted, 1.0)
        assert lp.dtype == torch.float32
        torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)


def test_no_grid_dimension_limits_the_number_of_tokens():
    """Liger's kernel breaks at L >= 65,536 (grid axis 1). Ours keeps tokens on axis 0 (limit 2^31 - 1) and the
    vocabulary slices on axis 1 small, at any N."""
    blocks = Blocks()
    for n in (65_536, 1_000_000, 50_000_000):
        (n_blocks, splits), _ = forward_grid(n, 151_936, torch.device("cpu"), blocks)
        (tiles,), _ = backward_grid(n, 151_936, blocks)
        assert n_blocks * blocks.block_n >= n and splits <= 65_535
        assert tiles < 2**31 - 1
    (n_blocks, splits), per_split = forward_grid(4096, 151_936, torch.device("cpu"), blocks.replace(splits=4))
    assert splits == 4 and per_split % blocks.block_v == 0 and splits * per_split >= 151_936


def test_a_long_sequence_beyond_65536_tokens_runs():
    """A 70,000-token batch through the Triton pass (tiny vocabulary so the interpreter stays quick)."""
    g = torch.Generator().manual_seed(6)
    n, vocab = 70_000, 16
    logits = torch.randn(n, vocab, generator=g)
    targets = torch.randint(0, vocab, (n,), generator=g)
    counted = torch.ones(n, dtype=torch.bool)
    blocks = Blocks(block_n=4096, block_v=16, block_d=16, splits=1)
    lp, _ = TritonTokenLogprobs.apply(logits, None, None, targets, counted, 1.0, blocks)
    ref = torch.log_softmax(logits.double(), -1).gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(lp.double(), ref, rtol=1e-5, atol=1e-5)


def test_chunked_torch_pass_is_independent_of_the_chunk_size():
    hidden, weight, bias, targets = _inputs(7)
    counted = targets != -100
    outs = []
    for chunk in (75, 75 * 5, 75 * 100):
        h = hidden.float().requires_grad_()
        lp, ent = chunked_token_logprobs(h, weight.float(), bias.float(), targets, counted, 1.0, chunk_elements=chunk)
        lp.sum().backward()
        outs.append((lp.detach(), ent, h.grad))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_fp16_gradients_keep_the_many_tiny_softmax_terms():
    """With a larger vocabulary most c_t * p_v are below fp16's normal range: rounding the gradient tile to fp16
    before the matmuls would lose them (the kernel multiplies fp16 inputs in fp32)."""
    hidden, weight, _, targets = _inputs(8, n=32, vocab=3000, dim=32, ignore=False)
    counted = torch.ones_like(targets, dtype=torch.bool)
    h, w = hidden.half().requires_grad_(), weight.half().requires_grad_()
    lp, _ = TritonTokenLogprobs.apply(h, w, None, targets, counted, 1.0, Blocks(block_n=16, block_v=64, block_d=16))
    (lp * 1e-3).sum().backward()  # small upstream gradients, as a mean over many tokens gives
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = torch.log_softmax(h64 @ w64.T, -1).gather(1, targets[:, None]).squeeze(1)
    (ref * 1e-3).sum().backward()
    for ours, exact in ((h.grad, h64.grad), (w.grad, w64.grad)):
        assert float((ours.double() - exact).abs().max() / exact.abs().max()) < 2e-2




def test_chunked_backward_writes_zeros_for_skipped_blocks_and_respects_frozen_weights():
    """Skipped blocks (zero upstream gradient) must still write zeros into the unzeroed chunk buffer; a frozen
    weight gets no gradient."""
    from ftis_kernels.backward import chunk_columns

    hidden, weight, _, targets = _inputs(10, n=48, ignore=False)
    counted = torch.ones_like(targets, dtype=torch.bool)
    blocks = CHUNKED[0]
    assert chunk_columns(48, 75, blocks) == 16 and chunk_columns(48, 75, blocks.replace(chunk_elements=1)) == 16
    assert chunk_columns(48, 75, blocks.replace(chunk_elements=10**9)) == 48  # half the vocabulary, in whole tiles
    grad_out = torch.zeros(48)
    grad_out[16:32] = torch.randn(16, dtype=torch.float64).float()
    for frozen in (False, True):
        h = hidden.float().requires_grad_()
        w = weight.float().requires_grad_(not frozen)
        lp, _ = TritonTokenLogprobs.apply(h, w, None, targets, counted, 1.0, blocks)
        (lp * grad_out).sum().backward()
        _, _, ref_dh, ref_dw, _ = _float64_reference(hidden, weight, torch.zeros(75, dtype=torch.float64),
                                                     targets, 1.0, grad_out.double())
        assert torch.all(h.grad[:16] == 0) and torch.all(h.grad[32:] == 0)
        torch.testing.assert_close(h.grad.double(), ref_dh, rtol=1e-4, atol=1e-5)
        if frozen:
            assert w.grad is None
        else:
            torch.testing.assert_close(w.grad.double(), ref_dw, rtol=1e-4, atol=1e-5)


def test_chunked_backward_in_bf16_keeps_fp32_accumulation():
    hidden, weight, _, targets = _inputs(11, n=64, vocab=300, dim=32, ignore=False)
    counted = torch.ones_like(targets, dtype=torch.bool)
    blocks = Blocks(block_n=16, block_v=32, block_d=16, strategy="chunked", chunk_elements=64 * 96)
    h, w = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    lp, _ = TritonTokenLogprobs.apply(h, w, None, targets, counted, 1.0, blocks)
    grad_out = torch.randn(64, generator=torch.Generator().manual_seed(0))
    (lp * grad_out).sum().backward()
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = torch.log_softmax(h64 @ w64.T, -1).gather(1, targets[:, None]).squeeze(1)
    (ref * grad_out.double()).sum().backward()
    for ours, exact in ((h.grad, h64.grad), (w.grad, w64.grad)):
        assert ours.dtype == torch.bfloat16
        assert float((ours.double() - exact).abs().max() / exact.abs().max()) < 2e-2


def test_the_addmm_overload_is_probed_once_and_a_real_error_passes_through(monkeypatch):
    from ftis_kernels import backward

    monkeypatch.setattr(backward, "_ADDMM_OUT_DTYPE", {})
    acc, a, b = torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(4, 3, dtype=torch.bfloat16)
    backward._add_product(acc, a, b)
    assert torch.equal(acc, torch.full((2, 3), 4.0))
    assert backward._ADDMM_OUT_DTYPE == {("cpu", torch.bfloat16): False}  # CPU torch has no such overload
    calls = []

    def addmm(acc, a, b, out_dtype=None, out=None):  # a torch that has the overload, then a device fault
        calls.append(a.shape)
        if a.shape[0] > 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return out

    monkeypatch.setattr(backward, "_ADDMM_OUT_DTYPE", {})
    monkeypatch.setattr(backward.torch, "addmm", addmm)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        backward._add_product(acc, a, b)
    assert backward._ADDMM_OUT_DTYPE == {("cpu", torch.bfloat16): True} and calls == [(1, 1), (2, 4)]
