"""Correctness of the Triton kernels at real shapes on a GPU, before anything is timed.

Qwen2.5 heads (V=151936; d=1536 for 1.5B, 2048 for 3B, 3584 for 7B), N=16384 tokens in 1024-token completions,
bf16 inputs. For each method (f-tis, tis, gepo at d=1536; f-tis at the other widths) and each entry point
(fused-linear: hidden + lm_head; logits), the Triton backend (each fused backward strategy) is compared with the
chunked torch backend, which runs the same bf16 inputs in fp32: loss, log-probs, the seven stats and every
gradient, as max |a - b| / max |b|. A NaN anywhere fails.

    python benchmarks/check_gpu.py [--tokens 16384 --dims 1536 2048 3584 --output check.json]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import ftis_kernels  # noqa: E402
from benchmarks.kernel_bench import make_inputs  # noqa: E402
from ftis_kernels.logprobs import ATOMIC_HALF_BLOCKS, default_blocks  # noqa: E402

# bf16 inputs, fp32 accumulation on both sides: the log-probs differ only by summation order; the gradients by
# the bf16 rounding of the gradient tile before its matmuls (2^-8 relative) summed over many tokens.
BOUNDS = {"loss": 1e-3, "logprobs": 1e-3, "stats": 1e-3, "grad": 3e-2}


def rel(a: torch.Tensor, b: torch.Tensor, rows: int = 2048) -> float:
    """max |a - b| / max |b| in float64, a block of rows at a time (a logits gradient is N x V)."""
    a, b = (t.reshape(t.shape[0], -1) if t.dim() else t.reshape(1, 1) for t in (a, b))
    diff, scale = 0.0, 0.0
    for i in range(0, a.shape[0], rows):
        ai, bi = a[i:i + rows].double(), b[i:i + rows].double()
        if not bool(torch.isfinite(ai).all()):
            return math.inf
        diff = max(diff, float((ai - bi).abs().max()))
        scale = max(scale, float(bi.abs().max()))
    return diff / max(scale, 1e-12)


def run(x: dict, entry: str, method: str, backend: str, strategy: str | None) -> dict:
    from ftis_kernels import backward as bwd

    h = x["hidden"].detach().clone().requires_grad_()
    w = x["weight"].detach().clone().requires_grad_(entry == "fused")
    original = bwd.default_blocks
    if strategy is not None:  # force the fused backward strategy under test (the atomic one with its own tiles)
        forced = ATOMIC_HALF_BLOCKS if strategy == "atomic" else None
        bwd.default_blocks = lambda kernel, mode, dtype: forced or original(kernel, mode, dtype)
    try:
        if entry == "fused":
            out = ftis_kernels.fused_linear_ftis_loss(h, w, x["targets"], x["gen"], x["adv"], x["cu"],
                                                      method=method, backend=backend)
            out.loss.backward()
            grads = {"hidden": h.grad, "weight": w.grad}
        else:
            logits = (h @ w.t()).detach().requires_grad_()
            out = ftis_kernels.ftis_loss(logits, x["targets"], x["gen"], x["adv"], x["cu"], method=method,
                                         backend=backend)
            out.loss.backward()
            grads = {"logits": logits.grad}
        torch.cuda.synchronize()
    finally:
        bwd.default_blocks = original
    return {"loss": out.loss.detach(), "logprobs": out.logprobs, "stats": out.stats, "grads": grads}


def compare(ours: dict, ref: dict) -> dict:
    row = {"loss": rel(ours["loss"], ref["loss"]), "logprobs": rel(ours["logprobs"], ref["logprobs"])}
    row["stats"] = max(abs(float(ours["stats"][k]) - float(ref["stats"][k])) / max(abs(float(ref["stats"][k])), 1e-6)
                       for k in ref["stats"])
    row["grad"] = max(rel(ours["grads"][k], ref["grads"][k]) for k in ref["grads"])
    row["pass"] = all(row[k] <= BOUNDS[k] for k in BOUNDS)
    return row


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--dims", type=int, nargs="*", default=[1536, 2048, 3584])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--output", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("check_gpu.py needs a CUDA GPU")
    results = {"tokens": args.tokens, "vocab": args.vocab, "device": torch.cuda.get_device_name(),
               "capability": list(torch.cuda.get_device_capability()), "bounds": BOUNDS, "rows": []}
    default_strategy = default_blocks("backward", "fused", torch.bfloat16).strategy
    for dim in args.dims:
        x = make_inputs(args.tokens, args.vocab, dim, torch.device("cuda"), torch.bfloat16, seed=dim)
        methods = ("f-tis", "tis", "gepo") if dim == args.dims[0] else ("f-tis",)
        for method in methods:
            for entry in ("fused", "logits"):
                start = time.perf_counter()
                ref = run(x, entry, method, "torch", None)
                strategies = ("atomic", "chunked") if entry == "fused" else (None,)
                for strategy in strategies:
                    row = {"dim": dim, "method": method, "entry": entry,
                           "strategy": strategy or "-", **compare(run(x, entry, method, "triton", strategy), ref)}
                    row["default"] = strategy in (None, default_strategy)
                    results["rows"].append(row)
                    print(json.dumps(row), f"({time.perf_counter() - start:.1f} s)", flush=True)
                del ref
                torch.cuda.empty_cache()
    results["pass"] = all(r["pass"] for r in results["rows"])
    lines = ["| d | method | entry | backward | loss | log-probs | stats | gradients | pass |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        lines.append(f"| {r['dim']} | {r['method']} | {r['entry']} | {r['strategy']} | {r['loss']:.1e} | "
                     f"{r['logprobs']:.1e} | {r['stats']:.1e} | {r['grad']:.1e} | {'yes' if r['pass'] else 'NO'} |")
    print("\n".join(lines))
    print("ALL PASS" if results["pass"] else "SOME CHECKS FAILED")
    if args.output:
        args.output.write_text(json.dumps(results, indent=2))
        args.output.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return results


if __name__ == "__main__":
    main()
