"""Summary of benchmarks/run_real_gpu.sh's runs (issue 41 item 7): held-out accuracy with 95% Wilson intervals,
training reward by phase (with the share of completions cut at the token limit), seconds per step, importance
weights, and the share of weights that changed; the plot learn.png. Reads and writes one results folder:

    python benchmarks/real_gpu_summary.py benchmarks/results/smollm2_bf16_h100
"""

from __future__ import annotations

import json
import math
import pathlib
import statistics
import sys


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    p, d = k / n, 1 + z * z / n
    centre, half = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return centre - half, centre + half


def records(path: pathlib.Path, kind: str) -> list[dict]:
    from ftis_engine.report.metrics import read_metrics

    return read_metrics(path, kinds=kind, strict=True)


def main(folder: pathlib.Path) -> str:
    train, evals = records(folder / "learn.metrics.jsonl", "train"), records(folder / "learn.metrics.jsonl", "eval")
    lines = ["| step | greedy accuracy (held-out) | 95% Wilson |", "|---|---|---|"]
    for r in evals:
        lo, hi = wilson(round(r["accuracy"] * r["samples"]), r["samples"])
        lines.append(f"| {r['step']} | {r['accuracy']:.4f} ({round(r['accuracy'] * r['samples'])}/{r['samples']}) "
                     f"| {lo:.3f}-{hi:.3f} |")
    lines += ["", ("| steps | mean training reward | completions cut at the token limit | reward over the completions "
                   "that stopped, at most |"), "|---|---|---|---|"]
    last = train[-1]["step"]
    for a, b in [(1, 10), (11, 25), (26, 50), (51, 75), (76, last)]:
        kept = [r for r in train if a <= r["step"] <= b]
        if kept:
            reward, cut = (statistics.mean(r[k] for r in kept) for k in ("reward_mean", "truncated_frac"))
            lines.append(f"| {a}-{b} | {reward:.3f} | {100 * cut:.0f}% | {reward / (1 - cut):.3f} |")
    lines += ["", ("What the records hold of the completions' form: the share of the sampled completions (temperature "
                   "1) that ran to max_new_tokens (truncated_frac), and the mean reward over the share that stopped: "
                   "an upper bound of the accuracy among the completions that stopped (equal to it if no cut "
                   "completion scored). The eval records hold the held-out greedy accuracy alone, so its gain cannot "
                   "be split into form and answer from them.")]
    med = {k: statistics.median(r[k] for r in train) for k in ("step_seconds", "gen_seconds", "train_seconds")}
    w = [r["is_weight_mean"] for r in train]
    lines += ["", f"Seconds a step (median): {med['step_seconds']:.2f} ({med['gen_seconds']:.2f} generation, "
              f"{med['train_seconds']:.2f} update); own rollouts' is_weight_mean {min(w):.4f}-{max(w):.4f}; "
              f"peak GPU memory {max(r.get('gpu_peak_gib') or 0 for r in train):.1f} GiB."]
    weights = json.loads((folder / "weights.json").read_text())
    lines += ["", "| checkpoints compared | weights that differ | relative change (L2) | saved as |", "|---|---|---|---|"]
    for name, v in weights.items():
        lines.append(f"| {name} | {100 * v['changed']:.2f}% | {v['rel_change']:.2e} | {v['dtype']} |")
    text = "\n".join(lines) + "\n"
    (folder / "summary.md").write_text(text)
    _plot(folder, train, evals)
    return text


def _plot(folder: pathlib.Path, train: list[dict], evals: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, reward = [r["step"] for r in train], [r["reward_mean"] for r in train]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    ax[0].plot(steps, reward, lw=1, label="reward of own rollouts")
    w = 10
    ax[0].plot(steps[w - 1:], [statistics.mean(reward[i - w + 1:i + 1]) for i in range(w - 1, len(reward))], lw=2,
               label="10-step mean")
    ax[0].set(xlabel="step", ylabel="reward", title="training reward")
    ax[0].legend(fontsize=8)
    xs, ys = [r["step"] for r in evals], [r["accuracy"] for r in evals]
    ci = [wilson(round(r["accuracy"] * r["samples"]), r["samples"]) for r in evals]
    ax[1].errorbar(xs, ys, yerr=[[y - c[0] for y, c in zip(ys, ci)], [c[1] - y for y, c in zip(ys, ci)]], marker="o",
                   capsize=3)
    ax[1].set(xlabel="step", ylabel="greedy accuracy (95% Wilson)", title="held-out gsm8k-calc")
    fig.suptitle("SmolLM2-135M-Instruct, full fine-tune, lr 1e-6, float32 masters + bf16 autocast", fontsize=10)
    fig.tight_layout()
    fig.savefig(folder / "learn.png", dpi=110)


if __name__ == "__main__":
    print(main(pathlib.Path(sys.argv[1])))
