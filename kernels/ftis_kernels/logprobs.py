"""Triton forward pass: one sweep over the vocabulary per block of tokens.

For a block of BLOCK_N tokens and one slice of the vocabulary, the kernel forms logit tiles (a tiled matmul
hidden @ weight^T in fused-linear mode, or loads of the logits), divides by the temperature and keeps, per token,
an online log-sum-exp (running max m and sum s of exp(z - m)), the running sum e of exp(z - m) * (z - m) for the
entropy, and the target's logit. Nothing vocabulary-sized is written: the outputs are 4 floats per token per
vocabulary slice. Slices (a split of V over the second grid axis) keep the GPU busy when N is small; they are
merged in O(N * slices). Token blocks live on grid axis 0, whose limit (2^31 - 1) does not bound N.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# a finite "minus infinity" for running maxima: exp(NEG_BIG - m) == 0 and 0 * NEG_BIG == 0 (a constexpr: jit code
# may only read constexpr globals)
NEG_BIG = tl.constexpr(-1.0e30)


@dataclass(frozen=True)
class Blocks:
    """Tile sizes and launch options of the Triton passes. splits=None picks the vocabulary split by occupancy."""

    block_n: int = 64
    block_v: int = 128
    block_d: int = 64
    num_warps: int = 8
    num_stages: int = 3
    splits: int | None = None
    # backward only: "atomic" multiplies each gradient tile into fp32 dH/dW with atomics inside the kernel;
    # "chunked" stores the bf16/fp32 gradient of one vocabulary chunk (at most chunk_elements entries) and lets
    # cuBLAS do dH += G_c W_c and dW_c = G_c^T H, so each dW row is written once and no atomics are needed.
    strategy: str = "atomic"
    chunk_elements: int = 1 << 28
    group_n: int = 8  # token blocks that walk the vocabulary tiles together (L2 reuse of the weight tiles)

    def replace(self, **changes) -> "Blocks":
        return dataclasses.replace(self, **changes)


DEFAULT_BLOCKS = Blocks()

# Tiles per (pass, mode, input dtype). The bf16/fp16 fused tiles and the chunked bf16 backward were chosen by
# timing on an H100 (benchmarks/tune.py, results/gpu_h100.md): 128 x 256 x 64 tiles ran the forward in 17.5 ms
# against 34.1 ms for the 128 x 128 x 32 ones, although ptxas reports small spills for them; the rest (fp32, the
# fp16 backward, logits mode) were chosen spill-free by ptxas (benchmarks/compile_sm90.py --sweep) and are not
# yet timed on a GPU. fp32 runs the chunked backward too (deterministic, no atomics); fp16 keeps the atomic one.
_TILES = {
    ("forward", "fused", "half"): Blocks(block_n=128, block_v=256, block_d=64, num_warps=8, num_stages=3),
    ("forward", "fused", "fp32"): Blocks(block_n=64, block_v=64, block_d=32, num_warps=8, num_stages=3),
    ("backward", "fused", "bf16"): Blocks(block_n=128, block_v=256, block_d=64, num_warps=8, num_stages=3,
                                          strategy="chunked"),
    ("backward", "fused", "fp16"): Blocks(block_n=64, block_v=64, block_d=32, num_warps=8, num_stages=3),
    ("backward", "fused", "fp32"): Blocks(block_n=64, block_v=64, block_d=32, num_warps=8, num_stages=3,
                                          strategy="chunked"),
    ("forward", "logits", "any"): Blocks(block_n=8, block_v=512, block_d=16, num_warps=8, num_stages=3),
    ("backward", "logits", "any"): Blocks(block_n=8, block_v=512, block_d=16, num_warps=8, num_stages=3),
}

# The bf16/fp16 fused backward's tiles when strategy="atomic" is asked for (fp16's default strategy; bf16 for
# comparison): spill-free under ptxas, 106 ms at N=16384, d=1536 on an H100 against the chunked default's 37 ms.
ATOMIC_HALF_BLOCKS = Blocks(block_n=128, block_v=128, block_d=32, num_warps=8, num_stages=3, strategy="atomic")


def default_blocks(kernel: str, mode: str, dtype) -> Blocks:
    """Tile sizes per pass ("forward" | "backward"), mode ("fused" | "logits") and input dtype (a torch dtype or
    one of "bf16", "fp16", "fp32")."""
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, dtype)
    for key in ((kernel, mode, name), (kernel, mode, "half" if name in ("bf16", "fp16") else name),
                (kernel, mode, "any")):
        if key in _TILES:
            return _TILES[key]
    return DEFAULT_BLOCKS


def _dot_precision(dtype: torch.dtype) -> tl.constexpr:
    # fp32 inputs get true fp32 products (not tf32): the op promises fp32 arithmetic.
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast_dots(dtype: torch.dtype) -> bool:
    # Triton's CPU interpreter multiplies bf16 operands of tl.dot as raw bits; fp32 operands give the same exact
    # products that bf16 tensor cores accumulate in fp32, so the interpreter gets upcast operands instead.
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _mm(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _logit_tile(
    X, W, B, rn64, row_ok, rv, col_ok, D, stride_x, stride_w, inv_temp,
    FUSED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """[BLOCK_N, BLOCK_V] fp32 tile of logits / T; columns outside the vocabulary are -inf."""
    if FUSED:
        acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        rv64 = rv.to(tl.int64)
        for d0 in range(0, D, BLOCK_D):
            rd = d0 + tl.arange(0, BLOCK_D)
            d_ok = rd < D
            h = tl.load(X + rn64[:, None] * stride_x + rd[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            w = tl.load(W + rv64[:, None] * stride_w + rd[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            acc = _mm(h, tl.trans(w), acc, PRECISION, UPCAST)
        if HAS_BIAS:
            acc += tl.load(B + rv, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    else:
        acc = tl.load(
            X + rn64[:, None] * stride_x + rv[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0
        ).to(tl.float32)
    return tl.where(col_ok[None, :], acc * inv_temp, float("-inf"))


@triton.jit
def _forward_kernel(
    X, W, B, T, M_OUT, S_OUT, E_OUT, Z_OUT,
    N, V, D, stride_x, stride_w, inv_temp, v_per_split,
    FUSED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rn < N
    rn64 = rn.to(tl.int64)
    target = tl.load(T + rn, mask=row_ok, other=-1)
    m = tl.full((BLOCK_N,), NEG_BIG, tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    e = tl.zeros((BLOCK_N,), tl.float32)
    z_target = tl.zeros((BLOCK_N,), tl.float32)
    v_lo = pid_s * v_per_split
    v_hi = tl.minimum(v_lo + v_per_split, V)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        rv = v0 + tl.arange(0, BLOCK_V)
        col_ok = rv < v_hi
        z = _logit_tile(X, W, B, rn64, row_ok, rv, col_ok, D, stride_x, stride_w, inv_temp,
                        FUSED, HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION, UPCAST)
        m_new = tl.maximum(m, tl.max(z, 1))
        alpha = tl.exp(m - m_new)
        shifted = z - m_new[:, None]
        p = tl.exp(shifted)
        # e tracks sum exp(z - m) * (z - m); moving m to m_new adds (m - m_new) to every term already summed.
        e = alpha * (e + s * (m - m_new)) + tl.sum(p * tl.where(p > 0, shifted, 0.0), 1)
        s = alpha * s + tl.sum(p, 1)
        z_target += tl.sum(tl.where(rv[None, :] == target[:, None], z, 0.0), 1)
        m = m_new
    out = pid_s.to(tl.int64) * N + rn64
    tl.store(M_OUT + out, m, mask=row_ok)
    tl.store(S_OUT + out, s, mask=row_ok)
    tl.store(E_OUT + out, e, mask=row_ok)
    tl.store(Z_OUT + out, z_target, mask=row_ok)


def _num_splits(n_blocks: int, v_blocks: int, device: torch.device, requested: int | None) -> int:
    if requested is not None:
        return max(1, min(requested, v_blocks))
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(v_blocks, triton.cdiv(2 * sms, n_blocks)))


def forward_grid(n: int, vocab: int, device: torch.device, blocks: Blocks) -> tuple[tuple[int, int], int]:
    """((token blocks, vocabulary slices), columns per slice). Token blocks go on axis 0 (limit 2^31 - 1)."""
    v_blocks = triton.cdiv(vocab, blocks.block_v)
    n_blocks = triton.cdiv(n, blocks.block_n)
    splits = _num_splits(n_blocks, v_blocks, device, blocks.splits)
    v_per_split = triton.cdiv(v_blocks, splits) * blocks.block_v
    return (n_blocks, triton.cdiv(vocab, v_per_split)), v_per_split


def triton_forward(x, weight, bias, targets, temperature: float, blocks: Blocks | None = None):
    """Per-token (target logit - lse, entropy, lse) in fp32 at temperature T, targets outside [0, V) give no
    target logit (the caller masks them). Logits mode: weight is None and x is [N, V]."""
    fused = weight is not None
    blocks = blocks or default_blocks("forward", "fused" if fused else "logits", x.dtype)
    n = x.shape[0]
    vocab = weight.shape[0] if fused else x.shape[1]
    dim = x.shape[1] if fused else 1
    x, targets = x.contiguous(), targets.contiguous()
    weight = weight.contiguous() if fused else x
    bias_arg = bias.contiguous() if bias is not None else x
    grid, v_per_split = forward_grid(n, vocab, x.device, blocks)
    partial = torch.empty((4, grid[1], n), dtype=torch.float32, device=x.device)
    _forward_kernel[grid](
        x, weight, bias_arg, targets, partial[0], partial[1], partial[2], partial[3],
        n, vocab, dim, x.stride(0), weight.stride(0), 1.0 / temperature, v_per_split,
        FUSED=fused, HAS_BIAS=bias is not None, BLOCK_N=blocks.block_n, BLOCK_V=blocks.block_v,
        BLOCK_D=blocks.block_d, PRECISION=_dot_precision(x.dtype), UPCAST=_upcast_dots(x.dtype),
        num_warps=blocks.num_warps, num_stages=blocks.num_stages,
    )
    return merge_splits(*partial)


def merge_splits(m, s, e, z_target):
    """Combine per-slice (max, sum, entropy sum, target logit) [splits, N] into per-token
    (target logit - lse, entropy, lse), each [N] fp32."""
    peak = m.max(0).values
    scale = torch.exp(m - peak)
    total = (s * scale).sum(0)
    e_total = (scale * (e + s * (m - peak))).sum(0)
    log_total = torch.log(total)
    lse = peak + log_total
    entropy = log_total - e_total / total
    return z_target.sum(0) - lse, entropy, lse
