"""`ftis-engine plot RUN_DIR`: each member's validation curve and the loss stats over steps, as PNG; with several
run directories, one figure overlaying their validation curves."""

from __future__ import annotations

import math
import pathlib

from ..core.safefile import read_bytes, save_figure
from .metrics import read_metrics

TRAIN_LABELS = {  # the train.png panels, key: (title, y label); the loss panel is named for the run's method
    "reward_mean": ("reward of its own rollouts", "mean reward"),
    "loss": ("loss", "loss"),
    "is_weight_mean": ("truncated IS weight", "mean min(exp(l - g), C)"),
    "is_truncated_frac": ("tokens truncated at C", "fraction of tokens"),
    "filtered_frac": ("sequences dropped by the KL filter", "fraction of sequences"),
    "kl_mean": ("KL(generator || trainer)", "mean per sequence (nats)"),
    "clip_frac": ("PPO-clipped", "fraction"),
    "entropy_mean": ("entropy", "mean per token (nats)"),
}
TRAIN_KEYS = tuple(TRAIN_LABELS)
METHOD_NAMES = {"nois": "NoIS", "vis": "VIS", "tis": "TIS", "f-nois": "F-NoIS", "f-vis": "F-VIS", "f-tis": "F-TIS",
                "gepo": "GEPO"}  # algorithm.method as the paper writes it


MAX_CONFIG_BYTES = 16 << 20  # a run's config.yaml is kilobytes (config.load's bound; not imported: plot stays light)


def run_method(run_dir: pathlib.Path) -> str | None:
    """The run's algorithm.method from its config.yaml (None when it has none or it cannot be read)."""
    import yaml

    try:
        raw = read_bytes(run_dir / "config.yaml", MAX_CONFIG_BYTES, "a run's config.yaml")  # bounded
        config = yaml.safe_load(raw.decode("utf-8"))
        method = config["algorithm"]["method"]
    except (OSError, UnicodeDecodeError, yaml.YAMLError, KeyError, TypeError):
        return None
    return method if isinstance(method, str) else None


def train_labels(method: str | None) -> dict[str, tuple[str, str]]:
    """TRAIN_LABELS with the loss panel named for `method` ("GEPO loss"; "loss" when unknown)."""
    name = METHOD_NAMES.get(method, method) if method else None
    return {**TRAIN_LABELS, "loss": (f"{name} loss" if name else "loss", "loss")}


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


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def eval_records(records: list[dict]) -> list[dict]:
    """The eval records that can be drawn: a step of the run (>= 0), a text dataset and an accuracy in [0, 1] (a
    hand-edited line may lack them, or hold a step -1 or an accuracy of 2.5)."""
    return [r for r in records if r["kind"] == "eval" and r["step"] >= 0 and isinstance(r.get("dataset"), str)
            and _number(r.get("accuracy")) and 0 <= r["accuracy"] <= 1]


def train_records(records: list[dict]) -> list[dict]:
    """The train records that can be drawn: a step of the run (>= 0) and a finite number under a TRAIN_KEYS key."""
    return [r for r in records
            if r["kind"] == "train" and r["step"] >= 0 and any(_number(r.get(k)) for k in TRAIN_KEYS)]


FIGURE_SUFFIXES = (".png", ".pdf", ".svg")


def make_plots(run_dir: pathlib.Path) -> list[pathlib.Path]:
    """Write plots/eval.png and plots/train.png from run_dir/metrics.jsonl; returns the files written. Each through
    the one safe writer (safefile): plots/ a real folder of the run directory, never a link followed out of it
    (safefile.LinkRefused), each figure whole or not at all."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir / "metrics.jsonl")
    if not records:
        raise NothingToPlot("metrics.jsonl holds no records yet (the run has not finished a step)")
    evals, train = eval_records(records), train_records(records)
    if not evals and not train:  # nothing would be drawn: said, not an exit 0 that wrote nothing
        raise NothingToPlot(f"metrics.jsonl holds {len(records)} record(s), none that can be drawn: an eval record "
                            "needs a step >= 0, a dataset and an accuracy in [0, 1], a train record a step >= 0 and a "
                            f"number under one of {', '.join(TRAIN_KEYS)}")
    out_dir = run_dir / "plots"
    written = []
    members = sorted({r["member"] for r in records}, key=[r["member"] for r in records].index)

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
        written.append(save_figure(fig, out_dir / "eval.png", run_dir, dpi=110))
        plt.close(fig)

    if train:
        labels = train_labels(run_method(run_dir))
        fig, axes = plt.subplots(2, 4, figsize=(18, 7))
        window = max(1, len({r["step"] for r in train}) // 20)  # about 20 windows over the run
        for ax, key in zip(axes.flat, TRAIN_KEYS):
            for i, member in enumerate(members):
                points = sorted((r["step"], r[key]) for r in train if r["member"] == member
                                and isinstance(r.get(key), (int, float)))
                if not points:
                    continue
                steps, values = zip(*points)
                if window > 1:  # the raw steps faint under their running mean
                    ax.plot(steps, values, color=f"C{i}", alpha=0.25, linewidth=0.8)
                ax.plot(steps, running_mean(values, window), color=f"C{i}", label=member)
            ax.set(title=labels[key][0], xlabel="step", ylabel=labels[key][1])
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        smooth = f" (running mean over {window} steps, raw values faint)" if window > 1 else ""
        fig.suptitle(f"{run_dir.name}: training{smooth}")
        fig.tight_layout()
        written.append(save_figure(fig, out_dir / "train.png", run_dir, dpi=110))
        plt.close(fig)
    return written


def run_label(run_dir: pathlib.Path, run_dirs: list[pathlib.Path]) -> str:
    """The shortest tail of the path that tells the runs apart (a study's runs are all named seed-<s>)."""
    parts = run_dir.resolve().parts
    for depth in range(1, len(parts) + 1):
        label = "/".join(parts[-depth:])
        if sum("/".join(p.resolve().parts[-depth:]) == label for p in run_dirs) == 1:
            return label
    return str(run_dir)


def overlay_plots(run_dirs: list[pathlib.Path], out: pathlib.Path) -> pathlib.Path:
    """One PNG: a panel per (member, eval set), a line per run, the runs' validation curves overlaid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict[tuple[str, str], list[tuple[str, list[tuple[int, float]]]]] = {}
    for run_dir in run_dirs:
        label = run_label(run_dir, run_dirs)
        evals = eval_records(read_metrics(run_dir / "metrics.jsonl"))
        for key in dict.fromkeys((r["member"], r["dataset"]) for r in evals):
            points = sorted((r["step"], r["accuracy"]) for r in evals if (r["member"], r["dataset"]) == key)
            curves.setdefault(key, []).append((label, points))
    if not curves:
        raise NothingToPlot("no eval records in any of the runs")
    panels = list(curves)
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
    for ax, (member, dataset) in zip(axes.flat, panels):
        for label, points in curves[(member, dataset)]:
            ax.plot(*zip(*points), marker="o", markersize=3, label=label)
        ax.set(title=f"{member}: {dataset}", xlabel="step", ylabel="greedy pass@1")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)  # the folder the user named: its own (a link at `out` is replaced)
    save_figure(fig, out, dpi=100)
    plt.close(fig)
    return out
