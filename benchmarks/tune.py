"""Tile and strategy sweep of the fused-linear passes on a GPU: each forward tiling, each backward tiling and
strategy (atomic: gradient tiles multiplied into fp32 dH/dW with atomics; chunked: gradient tiles stored per
vocabulary chunk and multiplied out by cuBLAS), timed alone, plus the cuBLAS reference points they compete with.

    python benchmarks/tune.py [--tokens 16384 --dim 1536 --output tune.json]

The fastest configurations are what `_TILES` in kernels/ftis_kernels/logprobs.py should hold; the JSON keeps every timing.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.kernel_bench import make_inputs  # noqa: E402
from ftis_kernels.backward import _add_product, _launch, chunk_columns, triton_backward  # noqa: E402
from ftis_kernels.logprobs import Blocks, default_blocks, triton_forward  # noqa: E402

FORWARD = [
    Blocks(block_n=128, block_v=128, block_d=32, num_warps=8, num_stages=3),
    Blocks(block_n=128, block_v=128, block_d=64, num_warps=8, num_stages=3),
    Blocks(block_n=128, block_v=128, block_d=64, num_warps=8, num_stages=4),
    Blocks(block_n=128, block_v=256, block_d=64, num_warps=8, num_stages=3),
    Blocks(block_n=128, block_v=256, block_d=32, num_warps=8, num_stages=4),
    Blocks(block_n=64, block_v=256, block_d=64, num_warps=4, num_stages=4),
    Blocks(block_n=128, block_v=128, block_d=64, num_warps=4, num_stages=4),
    Blocks(block_n=256, block_v=128, block_d=64, num_warps=8, num_stages=3),
    Blocks(block_n=128, block_v=256, block_d=64, num_warps=8, num_stages=4),
    Blocks(block_n=256, block_v=128, block_d=64, num_warps=8, num_stages=4),
    Blocks(block_n=128, block_v=256, block_d=128, num_warps=8, num_stages=2),
    Blocks(block_n=256, block_v=256, block_d=32, num_warps=8, num_stages=3),
]
BACKWARD = [
    Blocks(block_n=128, block_v=128, block_d=16, num_warps=8, num_stages=3, strategy="atomic"),
    Blocks(block_n=128, block_v=128, block_d=32, num_warps=8, num_stages=3, strategy="atomic"),
    Blocks(block_n=128, block_v=128, block_d=64, num_warps=8, num_stages=3, strategy="chunked"),
    Blocks(block_n=128, block_v=128, block_d=64, num_warps=8, num_stages=4, strategy="chunked"),
    Blocks(block_n=128, block_v=256, block_d=64, num_warps=8, num_stages=3, strategy="chunked"),
    Blocks(block_n=128, block_v=128, block_d=32, num_warps=8, num_stages=3, strategy="chunked"),
    Blocks(block_n=64, block_v=128, block_d=64, num_warps=4, num_stages=4, strategy="chunked"),
    Blocks(block_n=128, block_v=128, block_d=64, num_warps=8, num_stages=3, strategy="chunked", group_n=16),
    Blocks(block_n=128, block_v=128, block_d=64, num_warps=8, num_stages=3, strategy="chunked",
           chunk_elements=1 << 29),
    Blocks(block_n=128, block_v=128, block_d=64, num_warps=8, num_stages=3, strategy="chunked",
           chunk_elements=1 << 27),
    Blocks(block_n=128, block_v=256, block_d=64, num_warps=8, num_stages=4, strategy="chunked"),
    Blocks(block_n=256, block_v=128, block_d=64, num_warps=8, num_stages=3, strategy="chunked"),
    Blocks(block_n=128, block_v=256, block_d=64, num_warps=8, num_stages=3, strategy="chunked", group_n=16),
    Blocks(block_n=128, block_v=256, block_d=64, num_warps=8, num_stages=3, strategy="chunked",
           chunk_elements=1 << 27),
]


def bench(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median"))


def cublas_products(h: torch.Tensor, w: torch.Tensor) -> dict:
    """The two products of a backward on a full [N, V] bf16 gradient: dH = G W and dW = G^T H."""
    grad = torch.randn(h.shape[0], w.shape[0], device=h.device, dtype=torch.bfloat16)
    return {"cublas_dh_ms": bench(lambda: grad @ w), "cublas_dw_ms": bench(lambda: grad.t() @ h)}


def describe(b: Blocks) -> dict:
    return {k: v for k, v in vars(b).items() if k != "splits"}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--output", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    x = make_inputs(args.tokens, args.vocab, args.dim, torch.device("cuda"), torch.bfloat16)
    h, w, t = x["hidden"].detach(), x["weight"].detach(), x["targets"]
    n, v, d = h.shape[0], w.shape[0], h.shape[1]
    flop = 2.0 * n * v * d
    out = {"device": torch.cuda.get_device_name(), "tokens": n, "dim": d, "vocab": v, "forward": [], "backward": []}

    # reference points: the one matmul the forward must do, and the three of the chunked backward
    out["cublas_logits_bf16_ms"] = bench(lambda: h @ w.t())
    out["matmul_tflops"] = flop / out["cublas_logits_bf16_ms"] / 1e9
    try:
        out["cublas_logits_fp32_out_ms"] = bench(lambda: torch.mm(h, w.t(), out_dtype=torch.float32))
    except (RuntimeError, TypeError) as exc:
        out["cublas_logits_fp32_out_ms"] = f"unavailable: {exc}"
    out.update(cublas_products(h, w))
    torch.cuda.empty_cache()
    print(json.dumps(out), flush=True)

    lse = None
    for b in FORWARD:
        try:
            triton_forward(h, w, None, t, 1.0, b)
            ms = bench(lambda: triton_forward(h, w, None, t, 1.0, b))
            row = {**describe(b), "ms": ms, "tflops": flop / ms / 1e9}
        except Exception as exc:  # a tiling that does not compile or run is reported, not fatal
            row = {**describe(b), "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
        out["forward"].append(row)
        print("forward", json.dumps(row), flush=True)
    _, _, lse = triton_forward(h, w, None, t, 1.0, default_blocks("forward", "fused", torch.bfloat16))
    coef = (torch.randn(n, device=h.device) / n).float()

    for b in BACKWARD:
        try:
            triton_backward(h, w, None, t, lse, coef, 1.0, (True, True, False), b)
            ms = bench(lambda: triton_backward(h, w, None, t, lse, coef, 1.0, (True, True, False), b))
            row = {**describe(b), "ms": ms, "tflops_6nvd": 3 * flop / ms / 1e9}
            if b.strategy == "chunked":  # split: the Triton gradient tiles alone, then the cuBLAS products alone
                cols = chunk_columns(n, v, b)
                scratch = torch.empty((n, cols), device=h.device, dtype=h.dtype)

                def tiles():
                    for v0 in range(0, v, cols):
                        v1 = min(v0 + cols, v)
                        _launch(h, w[v0:v1], None, t, lse, coef, scratch[:, : v1 - v0], None, None, v1 - v0, d,
                                1.0, b, (False, False, False), v_offset=v0, store_grad=True)

                dx = torch.zeros((n, d), device=h.device)
                dw = torch.empty_like(w)

                def products():
                    for v0 in range(0, v, cols):
                        v1 = min(v0 + cols, v)
                        _add_product(dx, scratch[:, : v1 - v0], w[v0:v1])
                        torch.mm(scratch[:, : v1 - v0].t(), h, out=dw[v0:v1])

                row["tiles_ms"] = bench(tiles)
                row["products_ms"] = bench(products)
                row["chunk_columns"] = cols
                del scratch, dx, dw
        except Exception as exc:
            row = {**describe(b), "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
        torch.cuda.empty_cache()
        out["backward"].append(row)
        print("backward", json.dumps(row), flush=True)

    for key in ("forward", "backward"):
        ok = [r for r in out[key] if "ms" in r]
        out[f"best_{key}"] = min(ok, key=lambda r: r["ms"]) if ok else None
        print(f"best {key}:", json.dumps(out[f"best_{key}"]))
    if args.output:
        args.output.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
