"""Correctness of the Triton kernels at real shapes on a GPU (Qwen2.5-1.5B head: d=1536, V=151936; N=16384, bf16):
loss, log-probs and gradients against the chunked torch backend run in float32 on the same bf16 inputs.

    python benchmarks/check_gpu.py [--tokens 16384 --dim 1536]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import ftis_kernels  # noqa: E402
from benchmarks.kernels import make_inputs  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--output", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("check_gpu.py needs a CUDA GPU")
    x = make_inputs(args.tokens, args.vocab, args.dim, torch.device("cuda"), torch.bfloat16)
    results = {"tokens": args.tokens, "dim": args.dim, "vocab": args.vocab,
               "device": torch.cuda.get_device_name(), "capability": torch.cuda.get_device_capability()}
    outs = {}
    for backend in ("triton", "torch"):
        h = x["hidden"].detach().clone().requires_grad_()
        w = x["weight"].detach().clone().requires_grad_()
        out = ftis_kernels.fused_linear_ftis_loss(h, w, x["targets"], x["gen"], x["adv"], x["cu"], backend=backend)
        out.loss.backward()
        outs[backend] = (out, h.grad, w.grad)
    (t, th, tw), (r, rh, rw) = outs["triton"], outs["torch"]
    results.update(loss_rel=rel(t.loss, r.loss), logprobs_rel=rel(t.logprobs, r.logprobs),
                   grad_hidden_rel=rel(th, rh), grad_weight_rel=rel(tw, rw),
                   stats={k: [float(t.stats[k]), float(r.stats[k])] for k in t.stats})
    results["pass"] = results["loss_rel"] < 1e-3 and results["logprobs_rel"] < 1e-3 and \
        results["grad_hidden_rel"] < 3e-2 and results["grad_weight_rel"] < 3e-2
    print(json.dumps(results, indent=2))
    if args.output:
        args.output.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
