"""Triton backward pass: recompute logit tiles and turn dL/dl_t into the gradient of the logits, or of hidden,
weight and bias, without an N x V scratch.

With c_t = (dL/dl_t) / T and p = softmax(logits / T), the gradient of the logits is c_t * (onehot(target) - p);
with an entropy term (e_t = (dL/dH_t) / T, H_t the entropy of p) it is c_t * onehot - p * (c_t + e_t (log p + H_t)).
Each program owns one [BLOCK_N, BLOCK_V] tile (flattened on grid axis 0, so neither N nor V is bounded by a
grid limit; GROUP_N token blocks walk the vocabulary tiles together for L2 reuse) and recomputes it from the
saved log-sum-exp. Then, by Blocks.strategy:

- logits mode: the tile is the gradient of the logits and is stored;
- fused-linear, "chunked" (bf16 and fp32 default): the vocabulary is taken in chunks of at most
  Blocks.chunk_elements entries; the kernel stores the chunk's gradient G_c [N, chunk] in the input dtype and
  cuBLAS computes dH += G_c W_c (fp32 accumulator) and dW_c = G_c^T H. No atomics, each dW row written once;
  on an H100 this took the backward from 144 ms to 37 ms at N=16384, d=1536 (benchmarks/results/gpu_h100.md);
- fused-linear, "atomic" (fp16): the tile is multiplied into fp32 dH = G @ W and dW = G^T @ H inside the kernel
  and added with atomics (fp16 would flush the many tiny c_t * p_v terms, so the products run in fp32).

Token blocks whose c_t are all zero (ignored tokens, filtered or zero-advantage sequences) skip the recompute:
their gradient is exactly zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .logprobs import Blocks, _dot_precision, _logit_tile, _mm, _upcast_dots, default_blocks, triton_forward


@triton.jit
def _backward_kernel(
    X, W, B, T, LSE, C, EC, ENT, DX, DW, DB,
    N, V, D, stride_x, stride_w, stride_dx, inv_temp, v_blocks, v_offset,
    FUSED: tl.constexpr, HAS_BIAS: tl.constexpr, NEED_DX: tl.constexpr, NEED_DW: tl.constexpr,
    NEED_DB: tl.constexpr, STORE_GRAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr, GROUP_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    FP32_GRAD: tl.constexpr, HAS_ENT: tl.constexpr,
):
    # Tiles are visited in groups of GROUP_N token blocks that sweep the vocabulary tiles together, so the
    # programs running at one time share their weight tiles (and hidden blocks) in L2.
    pid = tl.program_id(0).to(tl.int64)
    n_blocks = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_N * v_blocks
    first_n = (pid // per_group) * GROUP_N
    group_size = tl.minimum(n_blocks - first_n, GROUP_N)
    pid_n = first_n + (pid % per_group) % group_size
    pid_v = (pid % per_group) // group_size
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rn < N
    rn64 = rn.to(tl.int64)
    rv = (pid_v * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int32)
    col_ok = rv < V
    coef = tl.load(C + rn, mask=row_ok, other=0.0)
    if HAS_ENT:
        ecoef = tl.load(EC + rn, mask=row_ok, other=0.0)
        live = tl.max(tl.abs(coef), 0) + tl.max(tl.abs(ecoef), 0)
    else:
        live = tl.max(tl.abs(coef), 0)
    store_mask = row_ok[:, None] & col_ok[None, :]
    g_ptrs = DX + rn64[:, None] * stride_dx + rv[None, :]
    if FUSED:
        if live == 0.0:
            if STORE_GRAD:  # the chunk buffer is not zeroed: write the tile's zeros without recomputing it
                tl.store(g_ptrs, tl.zeros((BLOCK_N, BLOCK_V), DX.dtype.element_ty), mask=store_mask)
            return
    lse = tl.load(LSE + rn, mask=row_ok, other=0.0)
    # targets are global ids; this launch sees columns [v_offset, v_offset + V) of the vocabulary
    target = tl.load(T + rn, mask=row_ok, other=-1) - v_offset
    z = _logit_tile(X, W, B, rn64, row_ok, rv, col_ok, D, stride_x, stride_w, inv_temp,
                    FUSED, HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION, UPCAST)
    p = tl.where(col_ok[None, :], tl.exp(z - lse[:, None]), 0.0)
    onehot = tl.where(rv[None, :] == target[:, None], 1.0, 0.0)
    if HAS_ENT:
        ent = tl.load(ENT + rn, mask=row_ok, other=0.0)
        log_p = tl.where(col_ok[None, :], z - lse[:, None], 0.0)
        grad = coef[:, None] * onehot - p * (coef[:, None] + ecoef[:, None] * (log_p + ent[:, None]))
    else:
        grad = coef[:, None] * (onehot - p)
    if FUSED and not STORE_GRAD:
        rv64 = rv.to(tl.int64)
        # bf16 keeps fp32's exponent range, so the tile may be rounded to it for the tensor cores; fp16 would
        # flush the many tiny c_t * p_v entries to zero, so fp16 inputs multiply in fp32 instead.
        g = grad if FP32_GRAD else grad.to(X.dtype.element_ty)
        for d0 in range(0, D, BLOCK_D):
            rd = d0 + tl.arange(0, BLOCK_D)
            d_ok = rd < D
            if NEED_DX:
                w = tl.load(W + rv64[:, None] * stride_w + rd[None, :], mask=col_ok[:, None] & d_ok[None, :],
                            other=0.0)
                dh = _mm(g, w.to(tl.float32), None, "ieee", True) if FP32_GRAD else _mm(g, w, None, PRECISION, UPCAST)
                tl.atomic_add(DX + rn64[:, None] * D + rd[None, :], dh, mask=row_ok[:, None] & d_ok[None, :],
                              sem="relaxed")
            if NEED_DW:
                h = tl.load(X + rn64[:, None] * stride_x + rd[None, :], mask=row_ok[:, None] & d_ok[None, :],
                            other=0.0)
                dw = _mm(tl.trans(g), h.to(tl.float32), None, "ieee", True) if FP32_GRAD \
                    else _mm(tl.trans(g), h, None, PRECISION, UPCAST)
                tl.atomic_add(DW + rv64[:, None] * D + rd[None, :], dw, mask=col_ok[:, None] & d_ok[None, :],
                              sem="relaxed")
        if NEED_DB:
            tl.atomic_add(DB + rv, tl.sum(grad, 0), mask=col_ok, sem="relaxed")
    else:
        # logits mode (the gradient of the logits), or a fused chunk whose gradient cuBLAS multiplies out
        tl.store(g_ptrs, grad.to(DX.dtype.element_ty), mask=store_mask)


def backward_grid(n: int, vocab: int, blocks: Blocks) -> tuple[tuple[int], int]:
    """((tiles,), vocabulary blocks): one program per [BLOCK_N, BLOCK_V] tile, flattened onto axis 0."""
    v_blocks = triton.cdiv(vocab, blocks.block_v)
    return (triton.cdiv(n, blocks.block_n) * v_blocks,), v_blocks


def _launch(x, weight, bias, targets, lse, coef, dx, dw, db, vocab: int, dim: int, temperature: float,
            blocks: Blocks, needs, v_offset: int = 0, store_grad: bool = False, entropy_term=None) -> None:
    fused = weight is not None
    placeholder = coef  # stands in for pointers the constexpr flags keep the kernel from touching
    ecoef, entropy = entropy_term if entropy_term is not None else (placeholder, placeholder)
    grid, v_blocks = backward_grid(x.shape[0], vocab, blocks)
    _backward_kernel[grid](
        x, weight if fused else x, placeholder if bias is None else bias, targets, lse, coef, ecoef, entropy,
        placeholder if dx is None else dx, placeholder if dw is None else dw, placeholder if db is None else db,
        x.shape[0], vocab, dim, x.stride(0), weight.stride(0) if fused else 0, 0 if dx is None else dx.stride(0),
        1.0 / temperature, v_blocks, v_offset,
        FUSED=fused, HAS_BIAS=bias is not None, NEED_DX=needs[0], NEED_DW=needs[1], NEED_DB=needs[2],
        STORE_GRAD=store_grad, BLOCK_N=blocks.block_n, BLOCK_V=blocks.block_v, BLOCK_D=blocks.block_d,
        GROUP_N=blocks.group_n, PRECISION=_dot_precision(x.dtype), UPCAST=_upcast_dots(x.dtype),
        FP32_GRAD=x.dtype == torch.float16, HAS_ENT=entropy_term is not None, num_warps=blocks.num_warps,
        num_stages=blocks.num_stages,
    )


_ADDMM_OUT_DTYPE: dict[tuple[str, torch.dtype], bool] = {}


def addmm_out_dtype(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch has addmm(out_dtype=float32) for `dtype` inputs on `device` (CUDA, torch >= 2.8):
    probed once per device type and dtype on 1 x 1 tensors, so an error of a real product (a CUDA fault, out of
    memory) is never taken for a missing overload. Only the errors a missing overload raises count as "no"."""
    key = (device.type, dtype)
    if key not in _ADDMM_OUT_DTYPE:
        a = torch.zeros(1, 1, dtype=dtype, device=device)
        acc = torch.zeros(1, 1, dtype=torch.float32, device=device)
        try:
            torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
            _ADDMM_OUT_DTYPE[key] = True
        except NotImplementedError:  # the operator exists, not for this backend
            _ADDMM_OUT_DTYPE[key] = False
        except (TypeError, RuntimeError) as exc:  # an older torch: no such keyword or overload
            if "out_dtype" not in str(exc) and "dtype_out" not in str(exc) and not isinstance(exc, TypeError):
                raise
            _ADDMM_OUT_DTYPE[key] = False
    return _ADDMM_OUT_DTYPE[key]


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with acc fp32 and a, b in the input dtype: one cuBLAS call with an fp32 output where this torch
    has addmm(out_dtype=) for the device (addmm_out_dtype), else a product in the input dtype added in fp32."""
    if a.dtype != acc.dtype and addmm_out_dtype(acc.device, a.dtype):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += a @ b if a.dtype == acc.dtype else (a @ b).to(acc.dtype)


def chunk_columns(n: int, vocab: int, blocks: Blocks) -> int:
    """Vocabulary columns per chunk of the chunked backward: a multiple of block_v with n * columns <=
    blocks.chunk_elements (at least one tile), and at most half the vocabulary rounded up to a tile, so that the
    scratch is never N x V (a vocabulary of one tile is one chunk)."""
    block = blocks.block_v
    columns = max(1, blocks.chunk_elements // max(1, n)) // block * block
    half = -(-((vocab + 1) // 2) // block) * block
    return min(max(columns, block), half if half < vocab else vocab)


def _chunked_backward(x, weight, bias, targets, lse, coef, temperature, need_dx, need_dw, need_db,
                      blocks: Blocks, entropy_term=None):
    """Fused-linear backward by vocabulary chunks: the Triton kernel recomputes a chunk's logit tiles and stores
    its gradient G_c [N, chunk] in the input dtype; cuBLAS adds G_c W_c into the fp32 dH and writes
    dW_c = G_c^T H (each row of dW once, accumulated in fp32 inside the matmul). Scratch: N x chunk entries."""
    n, dim = x.shape
    vocab = weight.shape[0]
    if not (need_dx or need_dw or need_db):
        return None, None, None
    columns = chunk_columns(n, vocab, blocks)
    grad_dtype = x.dtype
    scratch = torch.empty((n, columns), dtype=grad_dtype, device=x.device)
    dx = torch.zeros((n, dim), dtype=torch.float32, device=x.device) if need_dx else None
    dw = torch.empty_like(weight) if need_dw else None
    db = torch.empty(vocab, dtype=torch.float32, device=x.device) if need_db else None
    for v0 in range(0, vocab, columns):
        v1 = min(v0 + columns, vocab)
        g = scratch[:, : v1 - v0]
        _launch(x, weight[v0:v1], None if bias is None else bias[v0:v1], targets, lse, coef, g, None, None,
                v1 - v0, dim, temperature, blocks, (False, False, False), v_offset=v0, store_grad=True,
                entropy_term=entropy_term)
        if need_dx:
            _add_product(dx, g, weight[v0:v1])
        if need_dw:
            torch.mm(g.t(), x, out=dw[v0:v1])
        if need_db:
            db[v0:v1] = g.sum(0, dtype=torch.float32)
    return (None if dx is None else dx.to(x.dtype), dw, None if db is None else db.to(bias.dtype))


def triton_backward(x, weight, bias, targets, lse, coef, temperature: float, needs, blocks: Blocks | None = None,
                    entropy_term=None):
    """Gradients (dx, dweight, dbias) given c_t = (dL/dl_t) / T per token ([N] fp32, 0 where ignored).
    `needs` = which of the three are wanted; the others come back as None. entropy_term: (e_t = (dL/dH_t) / T,
    H_t), each [N] fp32, when the loss depends on the entropy too; None: it does not."""
    fused = weight is not None
    blocks = blocks or default_blocks("backward", "fused" if fused else "logits", x.dtype)
    n = x.shape[0]
    vocab = weight.shape[0] if fused else x.shape[1]
    dim = x.shape[1] if fused else 1
    x, targets = x.contiguous(), targets.contiguous()
    need_dx, need_dw, need_db = needs[0], fused and needs[1], bias is not None and needs[2]
    if fused:
        weight = weight.contiguous()
    if fused and blocks.strategy == "chunked" and x.dtype != torch.float16:
        return _chunked_backward(x, weight, bias, targets, lse, coef, temperature, need_dx, need_dw, need_db,
                                 blocks, entropy_term)
    if fused:
        dx = torch.zeros((n, dim), dtype=torch.float32, device=x.device) if need_dx else None
        dw = torch.zeros((vocab, dim), dtype=torch.float32, device=x.device) if need_dw else None
        db = torch.zeros(vocab, dtype=torch.float32, device=x.device) if need_db else None
    else:
        dx, dw, db = torch.empty_like(x), None, None
    _launch(x, weight, bias, targets, lse, coef, dx, dw, db, vocab, dim, temperature, blocks,
            (need_dx, need_dw, need_db), entropy_term=entropy_term)
    if fused:
        dx = None if dx is None else dx.to(x.dtype)
        dw = None if dw is None else dw.to(weight.dtype)
        db = None if db is None else db.to(bias.dtype)
    return dx, dw, db


class TritonTokenLogprobs(torch.autograd.Function):
    """(x, weight, bias) -> per-token log-probs [N] fp32 and entropy [N] fp32, both differentiable (the entropy's
    gradient is computed only when the loss uses it: an entropy bonus), on Triton.
    Logits mode: x is logits [N, V], weight and bias None. Fused-linear mode: x is hidden [N, d]."""

    @staticmethod
    def forward(ctx, x, weight, bias, targets, counted, temperature: float, blocks: Blocks | None = None):
        target_minus_lse, entropy, lse = triton_forward(x, weight, bias, targets, temperature, blocks)
        logprobs = torch.where(counted, target_minus_lse, torch.zeros_like(lse))
        ctx.save_for_backward(x, weight, bias, targets, counted, lse, entropy)
        ctx.temperature, ctx.blocks = temperature, blocks
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None, not zeros
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        x, weight, bias, targets, counted, lse, entropy = ctx.saved_tensors
        zero = torch.zeros_like(lse)
        coef = zero if grad_logprobs is None else torch.where(counted, grad_logprobs.float(), zero) / ctx.temperature
        entropy_term = None
        if grad_entropy is not None:
            ecoef = torch.where(counted, grad_entropy.float(), zero) / ctx.temperature
            entropy_term = (ecoef.contiguous(), entropy.float().contiguous())
        dx, dw, db = triton_backward(
            x, weight, bias, targets, lse, coef.contiguous(), ctx.temperature, ctx.needs_input_grad[:3], ctx.blocks,
            entropy_term,
        )
        return dx, dw, db, None, None, None, None
