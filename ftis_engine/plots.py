"""`ftis-engine plot RUN_DIR`: each member's validation curve and the loss stats over steps, as PNG."""

from __future__ import annotations

import pathlib

from .metrics import read_metrics

TRAIN_LABELS = {  # the train.png panels, key: (title, y label)
    "reward_mean": ("reward of its own rollouts", "mean reward"),
    "loss": ("F-TIS loss", "loss"),
    "is_weight_mean": ("truncated IS weight", "mean min(exp(l - g), C)"),
    "is_truncated_frac": ("tokens truncated at C", "fraction of tokens"),
    "filtered_frac": ("sequences dropped by the KL filter", "fraction of sequences"),
    "kl_mean": ("KL(generator || trainer)", "mean per sequence (nats)"),
    "clip_frac": ("PPO-clipped", "fraction"),
    "entropy_mean": ("entropy", "mean per token (nats)"),
}
TRAIN_KEYS = tuple(TRAIN_LABELS)


class NothingToPlot(ValueError):
    """metrics.jsonl holds no records."""


def running_mean(values, window: int) -> list[float]:
    """The mean of each value and the window - 1 before it (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def make_plots(run_dir: pathlib.Path) -> list[pathlib.Path]:
    """Write plots/eval.png and plots/train.png from run_dir/metrics.jsonl; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir / "metrics.jsonl")
    if not records:
        raise NothingToPlot("metrics.jsonl holds no records yet (the run has not finished a step)")
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
        window = max(1, len({r["step"] for r in train}) // 20)  # about 20 windows over the run
        for ax, key in zip(axes.flat, TRAIN_KEYS):
            for i, member in enumerate(members):
                points = sorted((r["step"], r[key]) for r in train if r["member"] == member and r.get(key) is not None)
                if not points:
                    continue
                steps, values = zip(*points)
                if window > 1:  # the raw steps faint under their running mean
                    ax.plot(steps, values, color=f"C{i}", alpha=0.25, linewidth=0.8)
                ax.plot(steps, running_mean(values, window), color=f"C{i}", label=member)
            ax.set(title=TRAIN_LABELS[key][0], xlabel="step", ylabel=TRAIN_LABELS[key][1])
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        smooth = f" (running mean over {window} steps, raw values faint)" if window > 1 else ""
        fig.suptitle(f"{run_dir.name}: training{smooth}")
        fig.tight_layout()
        written.append(out_dir / "train.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written
