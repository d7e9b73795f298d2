"""`ftis-engine plot RUN_DIR`: each member's validation curve and the loss stats over steps, as PNG."""

from __future__ import annotations

import pathlib

from .metrics import read_metrics

TRAIN_KEYS = ("reward_mean", "loss", "is_weight_mean", "is_truncated_frac", "filtered_frac", "kl_mean",
              "clip_frac", "entropy_mean")


def make_plots(run_dir: pathlib.Path) -> list[pathlib.Path]:
    """Write plots/eval.png and plots/train.png from run_dir/metrics.jsonl; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir / "metrics.jsonl")
    if not records:
        raise FileNotFoundError(f"{run_dir / 'metrics.jsonl'}: no metrics to plot")
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    members = sorted({r["member"] for r in records}, key=[r["member"] for r in records].index)

    evals = [r for r in records if r["kind"] == "eval"]
    datasets = sorted({r["dataset"] for r in evals})
    if datasets:
        fig, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 3.6), squeeze=False)
        for ax, dataset in zip(axes[0], datasets):
            for member in members:
                points = sorted((r["step"], r["accuracy"]) for r in evals if r["member"] == member and r["dataset"] == dataset)
                if points:
                    ax.plot(*zip(*points), marker="o", label=member)
            ax.set(title=f"{dataset}: greedy pass@1", xlabel="step", ylabel="accuracy")
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        written.append(out_dir / "eval.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

    train = [r for r in records if r["kind"] == "train"]
    if train:
        fig, axes = plt.subplots(2, 4, figsize=(18, 7))
        for ax, key in zip(axes.flat, TRAIN_KEYS):
            for member in members:
                points = sorted((r["step"], r[key]) for r in train if r["member"] == member and r.get(key) is not None)
                if points:
                    ax.plot(*zip(*points), label=member)
            ax.set(title=key, xlabel="step")
            ax.grid(alpha=0.3)
        axes.flat[0].legend()
        fig.tight_layout()
        written.append(out_dir / "train.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written
