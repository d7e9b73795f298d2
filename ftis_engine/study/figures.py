"""A study's figures: the eval curves of each figure's groups (a column per member, a row per eval set, a line per
group with its 95% band over seeds, on the seeds the groups share) and the distance figures (each method's paired
difference from alone at each member set, the member sets in order of their measured peer KL). Beside each curves
figure whose collaborating groups logged them, `<name>-train.png`: per step, the share of the peers' sequences the
KL filter dropped and the share of importance weights the cap truncated (mean over seeds, 95% band)."""

from __future__ import annotations

import pathlib
import textwrap

from ..core.safefile import save_figure
from .aggregate import ACCURACY_BOUNDS, STEP_STATS, interval
from .config import FigureSettings, StudyConfig
from .tables import against, seed_list, set_distances


def curve_lines(chosen: list[dict], member: str, dataset: str) -> tuple[list[tuple[dict, dict, list[int]]], str]:
    """The lines of one panel: [(group, curve (steps, mean, low, high), its seeds)] and a note for the title. Groups
    that ran the same seeds are drawn as they are. Groups that ran different seeds are drawn on the seeds they all
    share where the summary keeps each seed's curve (a line over seeds 0-5 beside one over 0-2 would compare seeds
    as well as groups); a summary from before that keeps only means: every line on its own seeds, said in its label
    and the note. Bands are set within [0, 1]."""
    present = [(g, g["by_member"].get(member, {}).get("curve", {}).get(dataset)) for g in chosen]
    present = [(g, c) for g, c in present if c]
    seed_sets = {tuple(c.get("seeds", g["seeds"])) for g, c in present}
    shared = set.intersection(*(set(s) for s in seed_sets)) if seed_sets else set()
    lines, note = [], ""
    if len(seed_sets) > 1 and shared and all("values" in c for _, c in present):
        for g, c in present:
            keep = [i for i, s in enumerate(c["seeds"]) if s in shared]
            points = [interval([v[i] for i in keep], bounds=ACCURACY_BOUNDS) for v in c["values"]]
            lines.append((g, {"steps": c["steps"], "mean": [p["mean"] for p in points],
                              "low": [p["low"] for p in points], "high": [p["high"] for p in points]},
                          sorted(shared)))
        note = f"on seeds {seed_list(sorted(shared))}, which every group here has"
    else:
        for g, c in present:
            lines.append((g, {**c, "low": [max(0.0, v) for v in c["low"]], "high": [min(1.0, v) for v in c["high"]]},
                          list(c.get("seeds", g["seeds"]))))
        if len(seed_sets) > 1:
            note = "lines on different seeds: compare only lines with the same seeds"
    return lines, note


def draw_figures(study: StudyConfig, summary: dict, out_dir: pathlib.Path) -> list[pathlib.Path]:
    """One PNG per figure (default: one per member set): a column per member, a row per eval set, a line per
    group with its 95% band over seeds (curve_lines: on the seeds the groups share). A study run with --groups draws
    only the figures whose groups it ran all of (a figure with half its lines would read as the whole comparison);
    --quick draws what it has. Each through the one safe writer (safefile): out_dir a real folder of the study's
    directory (its parent), never a link followed out of it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {g["group"]: g for g in summary["groups"]}
    figures = study.figures or [
        FigureSettings(name=f"set-{s}", title=f"member set {s}", groups=[g["group"] for g in summary["groups"]
                                                                          if g["member_set"] == s])
        for s in dict.fromkeys(g["member_set"] for g in summary["groups"])]
    written = []
    for figure in figures:
        chosen = [groups[name] for name in figure.groups if name in groups]
        if not chosen or (summary.get("only") and len(chosen) < len(figure.groups)):
            continue
        members = figure.members or list(dict.fromkeys(m for g in chosen for m in g["by_member"]))
        datasets = figure.datasets or sorted({d for g in chosen for m in g["by_member"].values() for d in m["curve"]})
        if not members or not datasets:
            continue
        if figure.kind == "distance":
            written.append(_distance_figure(plt, figure, chosen, members[0], datasets, out_dir))
            continue
        fig, axes = plt.subplots(len(datasets), len(members), figsize=(5.2 * len(members), 3.6 * len(datasets)),
                                 squeeze=False, layout="constrained")
        notes = []
        for row, dataset in enumerate(datasets):
            for col, member in enumerate(members):
                ax = axes[row][col]
                lines, note = curve_lines(chosen, member, dataset)
                notes.append(note)
                for g, curve, seeds in lines:
                    k = chosen.index(g)
                    label = f"{g['group']} (seeds {seed_list(seeds)})"
                    ax.plot(curve["steps"], curve["mean"], marker="o", markersize=3, color=f"C{k % 10}", label=label)
                    ax.fill_between(curve["steps"], curve["low"], curve["high"], color=f"C{k % 10}", alpha=0.15)
                ax.set(title=f"{member}: {dataset}", xlabel="step",
                       ylabel="attack success rate" if "-asr-" in dataset else "greedy pass@1")
                ax.grid(alpha=0.3)
                if lines:
                    ax.legend(fontsize=7)
        said = "; ".join(dict.fromkeys(n for n in notes if n))
        title = f"{figure.title or figure.name} (mean over seeds, 95% band{'; ' + said if said else ''})"
        fig.suptitle(textwrap.fill(title, width=int(11 * 5.2 * len(members))))  # about 11 characters an inch
        written.append(save_figure(fig, out_dir / f"{figure.name}.png", out_dir.parent, dpi=100))
        plt.close(fig)
        if any(g["collaboration"] != "alone" and g["by_member"].get(m, {}).get("train_curve")
               for g in chosen for m in members):
            written.append(_train_figure(plt, figure, chosen, members, out_dir))
    return written


STEP_LABELS = {"peer_filtered_frac": "peers' sequences the KL filter dropped",
               "is_truncated_frac": "tokens whose IS weight passed C\n(truncated; under NoIS measured, not applied)"}


def _train_figure(plt, figure: FigureSettings, groups: list[dict], members: list[str],
                  out_dir: pathlib.Path) -> pathlib.Path:
    """A row per STEP_STATS stat, a column per member, a line per collaborating group: its value at each training
    step (mean over the seeds that logged it, 95% band within [0, 1]). Alone groups have no peers: left out."""
    stats = STEP_STATS
    fig, axes = plt.subplots(len(stats), len(members), figsize=(5.2 * len(members), 3.2 * len(stats)),
                             squeeze=False, layout="constrained")
    for row, stat in enumerate(stats):
        for col, member in enumerate(members):
            ax = axes[row][col]
            for k, g in enumerate(groups):
                curve = g["by_member"].get(member, {}).get("train_curve", {}).get(stat)
                if g["collaboration"] == "alone" or not curve:
                    continue
                ax.plot(curve["steps"], curve["mean"], color=f"C{k % 10}",
                        label=f"{g['group']} (seeds {seed_list(curve['seeds'])})")
                ax.fill_between(curve["steps"], curve["low"], curve["high"], color=f"C{k % 10}", alpha=0.15)
            ax.set(title=f"{member}: {STEP_LABELS[stat]}", xlabel="step", ylabel="share")
            ax.set_ylim(bottom=0.0, top=max(0.05, ax.get_ylim()[1]))  # shares of a few percent stay readable
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
    title = f"{figure.title or figure.name}: training, per step (mean over seeds, 95% band)"
    fig.suptitle(textwrap.fill(title, width=int(11 * 5.2 * len(members))), fontsize=10)
    path = save_figure(fig, out_dir / f"{figure.name}-train.png", out_dir.parent, dpi=100)
    plt.close(fig)
    return path


def distance_points(groups: list[dict], member: str, metric: str, dataset: str,
                    alone: str | None = None) -> dict[str, list[tuple]]:
    """Method -> [(peer KL of the member set, paired difference from alone, member set)] of `member` in the
    collaborating groups, by increasing peer KL: the points of a distance figure. A group without both numbers is
    left out."""
    distances = set_distances(groups, member)
    lines: dict[str, list[tuple]] = {}
    for g in groups:
        diff = against(g, member, alone).get(metric, {}).get(dataset)
        if g["collaboration"] != "alone" and g["member_set"] in distances and diff:
            lines.setdefault(g["method"], []).append((distances[g["member_set"]], diff, g["member_set"]))
    return {method: sorted(points, key=lambda p: p[0]) for method, points in lines.items()}


KL_REDUCTIONS = {"sum": "summed over a completion", "mean": "mean over a completion's tokens",
                 "padded_mean": "summed over a completion / kl_max_len"}


def kl_measure(groups: list[dict]) -> str:
    """How the groups' peer KL is measured, from their configs: "k3, summed over a completion"; the several ways
    joined where they differ."""
    ways = dict.fromkeys((g.get("kl_estimator", "k3"), g.get("kl_reduction", "sum")) for g in groups
                         if g["collaboration"] != "alone")
    return " / ".join(f"{estimator}, {KL_REDUCTIONS.get(reduction, reduction)}" for estimator, reduction in ways)


def _distance_figure(plt, figure: FigureSettings, groups: list[dict], member: str, datasets: list[str],
                     out_dir: pathlib.Path) -> pathlib.Path:
    """A row per eval set, a column per metric (final, AUC): each method's paired difference from alone (mean and
    95% interval over seeds) at each member set (dial point), the member sets in order of their measured peer KL
    (its value under each name), a line per method, set a little apart so that the intervals do not hide each
    other."""
    metrics = (("final", "final accuracy"), ("auc", "AUC (mean accuracy over the run)"))
    distances = set_distances(groups, member)
    order = sorted(distances, key=distances.get)
    fig, axes = plt.subplots(len(datasets), len(metrics), figsize=(6.4 * len(metrics), 4.2 * len(datasets)),
                             squeeze=False)
    for row, dataset in enumerate(datasets):
        for col, (metric, label) in enumerate(metrics):
            ax = axes[row][col]
            lines = distance_points(groups, member, metric, dataset, figure.alone)
            for k, (method, points) in enumerate(lines.items()):
                shift = (k - (len(lines) - 1) / 2) * 0.08
                xs = [order.index(p[2]) + shift for p in points]
                ys = [p[1]["mean"] for p in points]
                err = [[p[1]["mean"] - p[1]["low"] for p in points], [p[1]["high"] - p[1]["mean"] for p in points]]
                n = min(p[1]["n"] for p in points)
                ax.errorbar(xs, ys, yerr=err, marker="o", markersize=4, capsize=3, color=f"C{k % 10}",
                            label=f"{method} (n={n})")
            ax.axhline(0.0, color="black", linewidth=0.8, linestyle="--")
            ax.set_xticks(range(len(order)), [f"{s}\nKL {distances[s]:.2g}" for s in order], fontsize=8)
            ax.set(title=f"{member}: {dataset}, {label}", xlabel=f"peer, by the peer KL measured in its runs "
                   f"({kl_measure(groups)})", ylabel="paired difference from alone")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    zero = f"`{figure.alone}`" if figure.alone else "alone"
    fig.suptitle(f"{figure.title or figure.name} (mean over seeds, 95% interval; 0 = {zero})")
    fig.tight_layout()
    path = save_figure(fig, out_dir / f"{figure.name}.png", out_dir.parent, dpi=100)
    plt.close(fig)
    return path
