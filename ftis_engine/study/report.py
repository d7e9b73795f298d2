"""A study's outputs: summary.json, report.md and the figures."""

from __future__ import annotations

import json
import os
import pathlib
import textwrap

from .config import FigureSettings, StudyConfig
from .plan import Group


def _fmt(value: dict | None, digits: int = 3) -> str:
    if not value:
        return "–"
    if value["n"] < 2:
        return f"{value['mean']:.{digits}f}"
    return f"{value['mean']:.{digits}f} [{value['low']:.{digits}f}, {value['high']:.{digits}f}]"


def _fmt_g(value: dict | None) -> str:
    return "–" if not value else f"{value['mean']:.3g}"


def report_markdown(summary: dict, figures: list[pathlib.Path]) -> str:
    lines = [f"# Study `{summary['study']}`{' (--quick)' if summary['quick'] else ''}", ""]
    if summary.get("command"):
        lines += ["Made by:", "", f"    {summary['command']}", ""]
    more = any(g["seeds"] != summary["seeds"] for g in summary["groups"] if g["seeds"])
    seeds = f"Seeds {summary['seeds']}" + (" (a group with other seeds says how many in its seeds column; a paired "
                                             "difference uses the seeds both groups have)" if more else "")
    lines += [f"{seeds}; every number is a mean over seeds with its 95% t-interval in brackets. "
              "final: greedy pass@1 at the last step; AUC: mean accuracy over the run (area under the eval curve / "
              "steps); early: mean over the eval points of the run's first half (step 0 excluded). Training stats "
              "are means over steps, then seeds: peer KL is the mean KL_i of the peers' rollouts under the receiver (the "
              "configured estimator and reduction: k3, summed over the sequence by default), peer filtered the share "
              "of the peers' rollouts the filter dropped, IS w the mean truncated weight over all tokens.", ""]
    by_set: dict[str, list[dict]] = {}
    for group in summary["groups"]:
        by_set.setdefault(group["member_set"], []).append(group)
    for member_set, groups in by_set.items():
        datasets = sorted({d for g in groups for m in g["by_member"].values() for d in m["final"]})
        lines += [f"## Member set `{member_set}`", ""]
        head = ["group", "member", "method", "collab", "g", "seeds"]
        head += [f"final {d}" for d in datasets] + [f"AUC {d}" for d in datasets] + [f"early {d}" for d in datasets[:1]]
        head += ["peer KL", "peer filtered", "IS w", "truncated", "reward"]
        asynchronous = any(g.get("swarm_mode") == "async" for g in groups)
        head += ["staleness"] if asynchronous else []
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for g in groups:
            for member, r in g["by_member"].items():
                t = r["train"]
                row = [g["group"], member, g["method"] if g["collaboration"] != "alone" else "–", g["collaboration"],
                       f"{g['g']:g}" if g["method"].startswith("f-") and g["collaboration"] != "alone" else "–",
                       str(len(g["seeds"]))]
                row += [_fmt(r["final"].get(d)) for d in datasets] + [_fmt(r["auc"].get(d)) for d in datasets]
                row += [_fmt(r["early"].get(d)) for d in datasets[:1]]
                row += [_fmt_g(t.get("peer_kl_mean")), _fmt_g(t.get("peer_filtered_frac")), _fmt_g(t.get("is_weight_mean")),
                        _fmt_g(t.get("is_truncated_frac")), _fmt_g(t.get("reward_mean"))]
                row += [_fmt_g(t.get("staleness_mean"))] if asynchronous else []
                lines.append("| " + " | ".join(row) + " |")
        lines.append("")
        own = sorted({g["alone"] for g in groups if g.get("alone")})
        whose = f"the alone group `{'`, `'.join(own)}`" if own else f"`{member_set}`'s alone baseline"
        lines += _paired_table(groups, datasets, "vs_alone", f"Paired with {whose}: per seed, this group's number "
                               "minus the alone run's (same seed: same warm start, same data order), mean and 95% "
                               "t-interval over seeds; peer KL as above.")
        lines += _paired_table(groups, datasets, "vs_baseline", "Paired with each group's baseline (Δ = group - "
                               "baseline, per seed, mean and 95% t-interval over seeds):")
    lines += _distance_tables(summary["groups"])
    if figures:
        lines += ["## Figures", ""] + [f"![{p.stem}](figures/{p.name})" for p in figures] + [""]
    return "\n".join(lines)


def against(group: dict, member: str, alone: str | None) -> dict:
    """`member`'s paired differences in `group` from the alone group `alone` (None: the group's own alone)."""
    result = group["by_member"].get(member, {})
    if alone is None or alone == group.get("alone"):
        return result.get("vs_alone", {})
    return result.get("vs_alones", {}).get(alone, {})


def _alones(group: dict) -> tuple[str, ...]:
    """The alone groups a group is paired with by name: its `alone`, then its `also_alone`."""
    return (group["alone"], *group.get("also_alone", []))


def _distance_tables(groups: list[dict]) -> list[str]:
    """Where groups of several member sets share one alone group (a distance study): for each alone group they are
    paired with and each of its members, per metric and eval set, a row per member set (by increasing mean peer
    KL) and a column per method."""
    shared = [g for g in groups if g.get("alone")]
    if len({g["member_set"] for g in shared}) < 2:
        return []
    by_name = {g["group"]: g for g in groups}
    lines = ["## By peer distance", "",
             "Each member set's groups against an alone group they share: Δ = group - alone, per seed, mean and 95% "
             "t-interval; rows by the mean peer KL measured in the member set's runs.", ""]
    for alone in dict.fromkeys(a for g in shared for a in _alones(g)):
        paired = [g for g in shared if alone in _alones(g)]
        for member in by_name[alone]["by_member"] if alone in by_name else []:
            rows: dict[str, dict[str, dict]] = {}
            for g in paired:
                if member in g["by_member"]:
                    rows.setdefault(g["member_set"], {})[g["method"]] = against(g, member, alone)
            methods = list(dict.fromkeys(m for row in rows.values() for m in row))
            distances = set_distances(paired, member)
            order = sorted(rows, key=lambda s: distances.get(s, float("inf")))
            datasets = sorted({d for row in rows.values() for r in row.values() for d in r.get("final", {})})
            for metric, label in (("final", "final"), ("auc", "AUC")):
                for dataset in datasets:
                    lines += [f"`{member}` against `{alone}`, Δ {label} {dataset}:", "",
                              "| member set | peer KL | " + " | ".join(methods) + " |",
                              "|" + "---|" * (2 + len(methods))]
                    for name in order:
                        cells = [_fmt(rows[name][m].get(metric, {}).get(dataset)) if m in rows[name] else "–"
                                 for m in methods]
                        kl = distances.get(name, float("nan"))
                        lines.append(f"| {name} | {kl:.3g} | " + " | ".join(cells) + " |")
                    lines.append("")
    return lines


def _paired_table(groups: list[dict], datasets: list[str], key: str, intro: str) -> list[str]:
    """A table of the paired differences `key` (vs_alone, vs_baseline) of every group and member that has them."""
    paired = [(g, member, r[key]) for g in groups for member, r in g["by_member"].items() if key in r]
    if not paired:
        return []
    head = ["group", "member"] + (["baseline"] if key == "vs_baseline" else ["peer KL"])
    head += [f"Δ final {d}" for d in datasets] + [f"Δ AUC {d}" for d in datasets] + [f"Δ early {d}" for d in datasets[:1]]
    lines = [intro, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g, member, vs in paired:
        row = [g["group"], member]
        row += [g["baseline"]] if key == "vs_baseline" else [
            _fmt_g(g["by_member"][member].get("train", {}).get("peer_kl_mean"))]
        row += [_fmt(vs["final"].get(d)) for d in datasets] + [_fmt(vs["auc"].get(d)) for d in datasets]
        row += [_fmt(vs["early"].get(d)) for d in datasets[:1]]
        lines.append("| " + " | ".join(row) + " |")
    return lines + [""]


def draw_figures(study: StudyConfig, summary: dict, out_dir: pathlib.Path) -> list[pathlib.Path]:
    """One PNG per figure (default: one per member set): a column per member, a row per eval set, a line per
    group with its 95% band over seeds. A study run with --groups draws only the figures whose groups it ran all
    of (a figure with half its lines would read as the whole comparison); --quick draws what it has."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {g["group"]: g for g in summary["groups"]}
    figures = study.figures or [
        FigureSettings(name=f"set-{s}", title=f"member set {s}", groups=[g["group"] for g in summary["groups"]
                                                                          if g["member_set"] == s])
        for s in dict.fromkeys(g["member_set"] for g in summary["groups"])]
    out_dir.mkdir(parents=True, exist_ok=True)
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
        for row, dataset in enumerate(datasets):
            for col, member in enumerate(members):
                ax = axes[row][col]
                for k, g in enumerate(chosen):
                    curve = g["by_member"].get(member, {}).get("curve", {}).get(dataset)
                    if not curve:
                        continue
                    label = f"{g['group']} (n={len(g['seeds'])})"
                    ax.plot(curve["steps"], curve["mean"], marker="o", markersize=3, color=f"C{k % 10}", label=label)
                    ax.fill_between(curve["steps"], curve["low"], curve["high"], color=f"C{k % 10}", alpha=0.15)
                ax.set(title=f"{member}: {dataset}", xlabel="step",
                       ylabel="attack success rate" if "-asr-" in dataset else "greedy pass@1")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=7)
        title = f"{figure.title or figure.name} (mean over seeds, 95% band)"
        fig.suptitle(textwrap.fill(title, width=int(11 * 5.2 * len(members))))  # about 11 characters an inch
        path = out_dir / f"{figure.name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def set_distances(groups: list[dict], member: str) -> dict[str, float]:
    """Member set -> how far `member`'s peer is there: the peer KL measured in its collaborating groups (mean over
    them; an estimate a rounding below 0 counts as 0)."""
    kls: dict[str, list[float]] = {}
    for g in groups:
        kl = g["by_member"].get(member, {}).get("train", {}).get("peer_kl_mean")
        if g["collaboration"] != "alone" and kl:
            kls.setdefault(g["member_set"], []).append(kl["mean"])
    return {s: max(0.0, sum(v) / len(v)) for s, v in kls.items()}


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
            ax.set(title=f"{member}: {dataset}, {label}", xlabel="peer, by the peer KL measured in its runs (k3, "
                   "summed over a completion)", ylabel="paired difference from alone")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    zero = f"`{figure.alone}`" if figure.alone else "alone"
    fig.suptitle(f"{figure.title or figure.name} (mean over seeds, 95% interval; 0 = {zero})")
    fig.tight_layout()
    path = out_dir / f"{figure.name}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_outputs(study: StudyConfig, groups: list[Group], summary: dict, output_dir: pathlib.Path) -> None:
    figures = draw_figures(study, summary, output_dir / "figures")
    summary["figures"] = [f"figures/{p.name}" for p in figures]
    partial = output_dir / "summary.json.tmp"
    partial.write_text(json.dumps(summary, indent=1))
    os.replace(partial, output_dir / "summary.json")
    (output_dir / "report.md").write_text(report_markdown(summary, figures))
