"""The fused F-TIS loss against its peers, side by side in one process: fwd+bwd time and peak memory.

    python benchmarks/kernel_bench.py                       # GPU: d in {1536, 2048, 3584}, N in {4096, 16384, 65536}
    python benchmarks/kernel_bench.py --dims 1536 --tokens 16384
    python benchmarks/kernel_bench.py --quick               # CPU, tiny shapes (CI keeps this from rotting)

Peers (each computes a loss from hidden states [N, d] and the lm_head [V, d], then its gradient):
  ours-fused-linear   ftis_kernels.fused_linear_ftis_loss (F-TIS; no N x V tensor)
  ours-fused-linear-tis  the same op with method="tis": no KL filter, so every token has a gradient (with random
                      inputs F-TIS filters most A < 0 sequences and the backward skips their tiles)
  ours-logits         logits = hidden @ W^T, then ftis_kernels.ftis_loss (F-TIS)
  naive-torch         logits + log_softmax + the same F-TIS loss under autograd
  naive-torch-compile the same under torch.compile
  liger-fused-linear  Liger-Kernel's LigerFusedLinearGRPOLoss (GRPO loss, TIS ratio passed as vllm_is_ratio)
  liger-triton        logits, then Liger-Kernel's triton_grpo_loss (TIS ratio passed as vllm_is_ratio)
  cce                 Cut Cross-Entropy's linear_cross_entropy (cross-entropy only: the floor of a fused head)
  torch-linear-ce     torch.nn.functional.linear_cross_entropy when this torch has it (cross-entropy only)
Peers that are not installed are skipped and say so. Time: median of many (triton.testing.do_bench on GPU);
memory: torch.cuda.max_memory_allocated above the inputs. Also the measured bf16 matmul rate and each peer's
achieved TFLOP/s counting 6 N V d. Writes JSON, a markdown table with ratios to ours-fused-linear, and a plot.

Inputs: 1024-token sequences, advantages ~ N(0, 1), and generation log-probs (`--gen-logprobs`) of an unrelated
sampler (`unrelated`, the default and the published runs': KL far above the threshold, so F-TIS's filter drops every
sequence with A <= 0 and the fused backward skips their token blocks) or the trainer's own (`own`: a member's own
rollouts, KL 0, nothing filtered). Every row of a peer that applies the filter records `filtered_frac`, the share of
sequences it dropped on these inputs (the op's own statistic).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import ftis_kernels  # noqa: E402
from ftis_kernels import LossConfig, LossInputs  # noqa: E402
from ftis_kernels.epilogue import ftis_objective  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
VOCAB = 151_936
SEQ_LEN = 1024  # tokens per completion in the benchmark batches
REFERENCE = "ours-fused-linear"


class Skip(Exception):
    """A peer that cannot run here (not installed, or no such API); the reason is reported."""


# ----------------------------------------------------------------------------------------------- inputs


GEN_LOGPROBS = ("unrelated", "own")


def make_inputs(n: int, vocab: int, dim: int, device: torch.device, dtype: torch.dtype, seed: int = 0,
                gen_logprobs: str = "unrelated") -> dict:
    """Packed inputs of n // 1024 sequences (one of n tokens when n < 1024); `gen_logprobs`: see the module's
    docstring."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    seq_len = min(SEQ_LEN, n)
    n = (n // seq_len) * seq_len
    hidden = (torch.randn(n, dim, generator=g) * 0.5).to(device, dtype).requires_grad_()
    weight = (torch.randn(vocab, dim, generator=g) / dim**0.5).to(device, dtype).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=g).to(device)
    gen = (-torch.rand(n, generator=g) * 8 - 1).to(device)  # log-probs of an unrelated generator
    seqs = n // seq_len
    adv = torch.randn(seqs, generator=g).to(device)  # drawn after gen either way: both input kinds share them
    if gen_logprobs == "own":  # the trainer's own log-probs, as on a member's own rollouts
        gen = ftis_kernels.fused_linear_token_logprobs(hidden.detach(), weight.detach(), targets).clamp(max=0.0)
    elif gen_logprobs != "unrelated":
        raise ValueError(f"gen_logprobs: {gen_logprobs!r} is not one of {', '.join(GEN_LOGPROBS)}")
    cu = torch.arange(0, n + 1, seq_len, dtype=torch.int32).to(device)
    return dict(hidden=hidden, weight=weight, targets=targets, gen=gen, adv=adv, cu=cu, seqs=seqs, seq_len=seq_len)


CONFIG = LossConfig(method="f-tis")


# ----------------------------------------------------------------------------------------------- peers


def ours_fused_linear(x, config: LossConfig = CONFIG):
    return ftis_kernels.fused_linear_ftis_loss(x["hidden"], x["weight"], x["targets"], x["gen"], x["adv"], x["cu"],
                                               config=config).loss


ours_fused_linear_tis = functools.partial(ours_fused_linear, config=CONFIG.replace(method="tis"))


def ours_logits(x):
    logits = x["hidden"] @ x["weight"].t()
    return ftis_kernels.ftis_loss(logits, x["targets"], x["gen"], x["adv"], x["cu"], config=CONFIG).loss


def naive_torch(x):
    logits = (x["hidden"] @ x["weight"].t()).float() / CONFIG.temperature
    logp = torch.log_softmax(logits, dim=-1)
    token = logp.gather(1, x["targets"][:, None]).squeeze(1)
    entropy = -(logp.exp() * logp).sum(-1).detach()
    counted = torch.ones_like(x["targets"], dtype=torch.bool)
    inputs = LossInputs(x["targets"], x["gen"], x["adv"], x["cu"])
    loss, _, _ = ftis_objective(token, entropy, counted, inputs, CONFIG)
    return loss


_compiled = {}


def naive_torch_compile(x):
    if "fn" not in _compiled:
        _compiled["fn"] = torch.compile(naive_torch, dynamic=False)
    return _compiled["fn"](x)


def _tis_ratio(x):
    """TIS weight min(exp(lb - g), C) per token [B, T], as Liger takes it (vllm_is_ratio): computed outside."""
    with torch.no_grad():
        lb = ftis_kernels.fused_linear_token_logprobs(x["hidden"].detach(), x["weight"].detach(), x["targets"])
        return torch.clamp(torch.exp(lb - x["gen"]), max=CONFIG.is_cap).view(x["seqs"], x["seq_len"])


def _liger_ratio(x):
    """Skip when Liger-Kernel is absent; else the TIS ratio it takes, computed once per input set."""
    if importlib.util.find_spec("liger_kernel") is None:
        raise Skip("liger-kernel is not installed (pip install liger-kernel)")
    if "liger_ratio" not in _compiled:
        _compiled["liger_ratio"] = _tis_ratio(x)
    return _compiled["liger_ratio"]


def liger_fused_linear(x):
    ratio = _liger_ratio(x)
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    if "liger" not in _compiled:
        _compiled["liger"] = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="grpo",
                                                      epsilon_low=0.2, epsilon_high=0.2, temperature=1.0)
    b, t = x["seqs"], x["seq_len"]
    loss, _ = _compiled["liger"](x["hidden"].view(b, t, -1), x["weight"], x["targets"].view(b, t),
                                 torch.ones(b, t, device=x["hidden"].device), x["adv"], vllm_is_ratio=ratio)
    return loss


def liger_triton(x):
    if x["hidden"].device.type != "cuda":
        raise Skip("triton_grpo_loss needs CUDA")
    ratio = _liger_ratio(x)
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    b, t = x["seqs"], x["seq_len"]
    hidden = x["hidden"].view(b, t, -1)
    # [B, T+1, V]: the last row predicts nothing (Liger's layout); the logits exist in full
    logits = torch.cat([hidden, hidden[:, -1:]], dim=1) @ x["weight"].t()
    loss, _ = triton_grpo_loss(logits, None, None, x["targets"].view(b, t), x["adv"],
                               torch.ones(b, t, device=logits.device, dtype=torch.int32), temperature=1.0, beta=0.0,
                               eps_low=0.2, eps_high=0.2, inplace=True, loss_type="grpo", reduce=True,
                               vllm_is_ratio=ratio)
    return loss


def cce(x):
    if importlib.util.find_spec("cut_cross_entropy") is None:
        raise Skip("cut-cross-entropy is not installed (pip install cut-cross-entropy)")
    if x["hidden"].device.type != "cuda":
        raise Skip("Cut Cross-Entropy needs CUDA")
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(x["hidden"], x["weight"], x["targets"])


def torch_linear_ce(x):
    fn = getattr(torch.nn.functional, "linear_cross_entropy", None)
    if fn is None:
        raise Skip(f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy")
    return fn(x["hidden"], x["weight"], x["targets"])


PEERS = {
    "ours-fused-linear": ours_fused_linear,
    "ours-fused-linear-tis": ours_fused_linear_tis,
    "ours-logits": ours_logits,
    "naive-torch": naive_torch,
    "naive-torch-compile": naive_torch_compile,
    "liger-fused-linear": liger_fused_linear,
    "liger-triton": liger_triton,
    "cce": cce,
    "torch-linear-ce": torch_linear_ce,
}


# ----------------------------------------------------------------------------------------------- measuring

# Peers that apply F-TIS's KL filter (the others weigh every token: TIS, Liger's GRPO losses, cross-entropy)
FILTERING = ("ours-fused-linear", "ours-logits", "naive-torch", "naive-torch-compile")


def filtered_frac(x) -> float:
    """The share of the inputs' sequences that F-TIS's KL filter drops (A <= 0 and KL >= kl_threshold): the op's
    own `filtered_frac`, from one forward without gradient."""
    with torch.no_grad():
        out = ftis_kernels.fused_linear_ftis_loss(x["hidden"].detach(), x["weight"].detach(), x["targets"], x["gen"],
                                                  x["adv"], x["cu"], config=CONFIG)
    return float(out.stats["filtered_frac"])



def _step(fn, x):
    def run():
        x["hidden"].grad = None
        x["weight"].grad = None
        fn(x).backward()
    return run


def time_ms(run, device: torch.device, quick: bool) -> float:
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median"))
    run()  # warm-up
    times = []
    for _ in range(3 if quick else 10):
        start = time.perf_counter()
        run()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def peak_bytes(run, device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def matmul_tflops(n: int, vocab: int, dim: int, device: torch.device, dtype: torch.dtype) -> float | None:
    """Measured rate of one [N, d] @ [d, V] matmul in this dtype: the practical ceiling for the fused head."""
    if device.type != "cuda":
        return None
    import triton.testing

    a = torch.randn(n, dim, device=device, dtype=dtype)
    b = torch.randn(dim, vocab, device=device, dtype=dtype)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    return 2 * n * vocab * dim / (ms * 1e-3) / 1e12


def count_filtered(n: int, vocab: int, dim: int, dtype: torch.dtype = torch.bfloat16, prefix: int = 16) -> dict:
    """How many of make_inputs' sequences F-TIS filters, on a CPU in seconds where the op's forward at a real vocabulary
    takes the GPU: each sequence's KL (a sum of non-negative k3 terms) is bounded below by its first `prefix` tokens'
    terms, from the inputs rounded to `dtype` as the GPU run holds them. The count is exact ("exact": True) when the
    bound clears kl_threshold for every sequence with A <= 0: then those are the filtered ones."""
    x = make_inputs(n, vocab, dim, torch.device("cpu"), torch.float32)
    rows = torch.cat([torch.arange(s * x["seq_len"], s * x["seq_len"] + min(prefix, x["seq_len"]))
                      for s in range(x["seqs"])])
    with torch.no_grad():
        hidden = x["hidden"][rows].to(dtype).float()
        logits = hidden @ x["weight"].detach().to(dtype).float().t()
        lb = torch.log_softmax(logits, -1).gather(1, x["targets"][rows, None]).squeeze(1)
    gap = (x["gen"][rows] - lb).clamp(-20.0, 20.0)  # x = g - l, bounded as the op bounds it
    kl_bound = (gap.exp() - gap - 1).view(x["seqs"], -1).sum(1)
    negative = x["adv"] <= 0
    filtered = negative & (kl_bound >= CONFIG.kl_threshold)
    return {"tokens": n, "dim": dim, "vocab": vocab, "sequences": x["seqs"], "negative": int(negative.sum()),
            "filtered": int(filtered.sum()), "filtered_frac": float(filtered.float().mean()),
            "exact": bool(torch.equal(filtered, negative)), "kl_bound_min": float(kl_bound.min())}


def measure(name: str, fn, n: int, vocab: int, dim: int, device, dtype, quick: bool,
            gen_logprobs: str = "unrelated") -> dict:
    row = {"peer": name, "tokens": n, "vocab": vocab, "dim": dim, "gen_logprobs": gen_logprobs}
    _compiled.pop("liger_ratio", None)
    _compiled.pop("liger", None)
    try:
        x = make_inputs(n, vocab, dim, device, dtype, gen_logprobs=gen_logprobs)
        if name in FILTERING:
            row["filtered_frac"] = filtered_frac(x)
        run = _step(fn, x)
        row["peak_bytes"] = peak_bytes(run, device)
        row["ms"] = time_ms(run, device, quick)
        row["tflops"] = 6 * x["hidden"].shape[0] * vocab * dim / (row["ms"] * 1e-3) / 1e12
    except Skip as reason:
        row["skipped"] = str(reason)
    except torch.OutOfMemoryError:
        row["skipped"] = "out of memory"
    except Exception as exc:  # a peer's own failure must not stop the others
        row["skipped"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def add_ratios(rows: list[dict]) -> None:
    """time_ratio = peer time / ours (>1: ours is faster); mem_ratio = ours peak / peer peak (<1: ours is leaner)."""
    for row in rows:
        ref = next((r for r in rows if r["peer"] == REFERENCE and r["tokens"] == row["tokens"]
                    and r["dim"] == row["dim"] and "ms" in r), None)
        if ref is None or "ms" not in row:
            continue
        row["time_ratio"] = row["ms"] / ref["ms"]
        if row.get("peak_bytes") and ref.get("peak_bytes"):
            row["mem_ratio"] = ref["peak_bytes"] / row["peak_bytes"]


# Ours recompute the logits in the backward: their floor is 8 N V d FLOPs (2 forward, 2 recompute, 4 for the two
# gradient products) at the measured matmul rate, against the 6 N V d a head that keeps its logits needs.
RECOMPUTING = ("ours-fused-linear", "ours-fused-linear-tis")


def add_floor(rows: list[dict], matmul: dict) -> None:
    """floor_frac = (8 N V d at the measured matmul rate) / measured time, for the peers in RECOMPUTING."""
    for r in rows:
        rate = matmul.get(f"{r['dim']}x{r['tokens']}")
        if r["peer"] in RECOMPUTING and "ms" in r and rate:
            r["floor_frac"] = 8 * r["tokens"] * r["vocab"] * r["dim"] / (rate * 1e12) / (r["ms"] * 1e-3)


def markdown(rows: list[dict], matmul: dict) -> str:
    lines = [("| d | N | peer | sequences filtered | fwd+bwd ms | peak MiB | TFLOP/s (6NVd) | of matmul rate | "
              "of its floor (8NVd) | time vs ours | ours mem / peer |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        filtered = f"{100 * r['filtered_frac']:.0f}%" if "filtered_frac" in r else "- (no filter)"
        if "skipped" in r:
            lines.append(f"| {r['dim']} | {r['tokens']} | {r['peer']} | {filtered} | skipped: {r['skipped']} "
                         "| | | | | | |")
            continue
        peak = f"{r['peak_bytes'] / 2**20:,.0f}" if r.get("peak_bytes") is not None else "n/a"
        rate = matmul.get(f"{r['dim']}x{r['tokens']}")
        frac = f"{100 * r['tflops'] / rate:.0f}%" if rate else "n/a"
        floor = f"{100 * r['floor_frac']:.0f}%" if "floor_frac" in r else "n/a"
        mem = f"{r['mem_ratio']:.3f}" if "mem_ratio" in r else "n/a"
        lines.append(f"| {r['dim']} | {r['tokens']} | {r['peer']} | {filtered} | {r['ms']:.2f} | {peak} | "
                     f"{r['tflops']:.1f} | {frac} | {floor} | {r.get('time_ratio', float('nan')):.2f}x | {mem} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(r["dim"], r["tokens"]) for r in rows})
    peers = [p for p in PEERS if any(r["peer"] == p and "ms" in r for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    width = 0.8 / max(1, len(peers))
    for i, peer in enumerate(peers):
        xs, ms, mem = [], [], []
        for j, shape in enumerate(shapes):
            r = next((r for r in rows if r["peer"] == peer and (r["dim"], r["tokens"]) == shape and "ms" in r), None)
            if r:
                xs.append(j + i * width)
                ms.append(r["ms"])
                mem.append((r.get("peak_bytes") or 0) / 2**30)
        axes[0].bar(xs, ms, width, label=peer)
        axes[1].bar(xs, mem, width, label=peer)
    axes[0].set_yscale("log")  # peers differ by 100x
    for ax, title in zip(axes, ("fwd+bwd time (ms, log scale)", "peak memory above inputs (GiB)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], [f"d={d}\nN={n}" for d, n in shapes])
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CPU, tiny shapes, a few repeats")
    parser.add_argument("--dims", type=int, nargs="*", default=[1536, 2048, 3584])
    parser.add_argument("--tokens", type=int, nargs="*", default=[4096, 16384, 65536])
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--peers", nargs="*", default=list(PEERS), choices=list(PEERS))
    parser.add_argument("--gen-logprobs", default="unrelated", choices=GEN_LOGPROBS,
                        help="the inputs' generation log-probs: an unrelated sampler's (F-TIS filters every A <= 0 "
                             "sequence) or the trainer's own (a member's own rollouts: nothing filtered)")
    parser.add_argument("--count-filtered", action="store_true",
                        help="time nothing: count the sequences F-TIS filters on each shape's inputs (on the CPU, "
                             "count_filtered) and write <output>.json")
    parser.add_argument("--output", type=pathlib.Path, default=RESULTS / "kernels")
    args = parser.parse_args(argv)
    if args.count_filtered:
        counts = [count_filtered(n, args.vocab, dim) for dim in args.dims for n in args.tokens]
        args.output.parent.mkdir(parents=True, exist_ok=True)
        command = "python benchmarks/kernel_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
        args.output.with_suffix(".json").write_text(json.dumps({"command": command, "counts": counts}, indent=2) + "\n")
        for c in counts:
            print(json.dumps(c))
        return counts
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.quick:
        args.dims, args.tokens, args.vocab = [32], [256], 1000
        args.peers = [p for p in args.peers if p != "naive-torch-compile"]
    matmul = {}
    rows = []
    for dim in args.dims:
        for n in args.tokens:
            rate = matmul_tflops(n, args.vocab, dim, device, dtype)
            if rate:
                matmul[f"{dim}x{n}"] = rate
            for peer in args.peers:
                rows.append(measure(peer, PEERS[peer], n, args.vocab, dim, device, dtype, args.quick,
                                    args.gen_logprobs))
                print(json.dumps(rows[-1]), flush=True)
    add_ratios(rows)
    add_floor(rows, matmul)
    table = markdown(rows, matmul)
    print(table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python benchmarks/kernel_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "dtype": str(dtype), "cpus": os.cpu_count(),
            "matmul_tflops": matmul}
    args.output.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    args.output.with_suffix(".md").write_text(f"`{meta['command']}` on {meta['device']}\n\n{table}\n")
    plot(rows, args.output.with_suffix(".png"))
    return rows


if __name__ == "__main__":
    main()
