"""The adversary study's table and figure (configs/study/adversary.yaml, issue 45), from its summary.json: per group,
the receiver's final greedy accuracy and its paired difference from the honest swarm (the same seeds), the final
attack success rate of each payload, what its peers' sequences went through (filtered, dropped by each defense,
taken), and what the defenses cost in seconds. Writes table.md, table.json and attack_success.png beside it.

    python benchmarks/adversary_summary.py benchmarks/results/adversary_study
"""

from __future__ import annotations

import json
import pathlib
import sys

from ftis_engine.study.aggregate import ACCURACY_BOUNDS, clip, interval

RECEIVER = "receiver"
DATASET = "arith"
PAYLOADS = ("inject", "in-context")


def _ci(value: dict | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    if value["n"] < 2:
        return f"{value['mean']:.{digits}f}"
    mark = "*" if value.get("clipped") else ""  # an end set on the quantity's bound (a share: 0 or 1)
    return f"{value['mean']:.{digits}f} [{value['low']:.{digits}f}, {value['high']:.{digits}f}]{mark}"


def _share(value: dict | None) -> dict | None:
    """A share of questions' interval (accuracy, attack success) within [0, 1], marked where clipped."""
    return value if value is None or value["n"] < 2 else clip(dict(value), ACCURACY_BOUNDS)


def _paired(groups: dict[str, dict], group: dict, base: str, dataset: str) -> dict | None:
    """The receiver's paired difference (group - base) on `dataset`'s final value, seed by seed."""
    other = groups.get(base)
    if other is None or other is group:
        return None
    a = group["by_member"].get(RECEIVER, {}).get("final", {}).get(dataset)
    b = other["by_member"].get(RECEIVER, {}).get("final", {}).get(dataset)
    if a is None or b is None:
        return None
    by_seed = dict(zip(b["seeds"], b["values"]))
    diffs = [va - by_seed[s] for s, va in zip(a["seeds"], a["values"]) if s in by_seed]
    return interval(diffs) if diffs else None


def rows(summary: dict) -> list[dict]:
    groups = {g["group"]: g for g in summary["groups"]}
    out = []
    for name, g in groups.items():
        r = g["by_member"].get(RECEIVER)
        if r is None:
            continue
        t = r.get("train", {})
        row = {"group": name, "method": g["method"], "seeds": len(g["seeds"]),
               "accuracy": _share(r["final"].get(DATASET)), "accuracy_ood": _share(r["final"].get(f"{DATASET}-ood")),
               "vs_honest": _paired(groups, g, "honest", DATASET),
               "vs_honest_ood": _paired(groups, g, "honest", f"{DATASET}-ood")}
        for kind in PAYLOADS:
            row[f"asr_{kind}"] = _share(r["final"].get(f"{DATASET}-asr-{kind}"))
            row[f"asr_auc_{kind}"] = r["auc"].get(f"{DATASET}-asr-{kind}")
        for key in ("peer_filtered_frac", "peer_sequences", "likelihood_dropped", "quarantined", "length_dropped",
                    "share_capped", "rejected_batches", "is_weight_mean", "screen_seconds", "train_seconds"):
            row[key] = t.get(key)
        out.append(row)
    return out


def table(out: list[dict]) -> str:
    head = ["group", "method", "seeds", "receiver arith (final)", "vs honest (paired)", "vs honest, ood",
            "ASR inject", "ASR in-context", "peer filtered", "peer seq/step", "dropped: likelihood",
            "quarantined", "length", "screen s/step", "train s/step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in out:
        cells = [r["group"], r["method"], str(r["seeds"]), _ci(r["accuracy"]), _ci(r["vs_honest"]),
                 _ci(r["vs_honest_ood"]), _ci(r["asr_inject"]), _ci(r["asr_in-context"]),
                 _ci(r["peer_filtered_frac"], 2), _ci(r["peer_sequences"], 1), _ci(r["likelihood_dropped"], 1),
                 _ci(r["quarantined"], 1), _ci(r["length_dropped"], 1), _ci(r["screen_seconds"], 2),
                 _ci(r["train_seconds"], 2)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(out: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    names = [r["group"] for r in out]
    for ax, (key, title) in zip(axes, (("asr", "attack success rate (final, 95% CI)"),
                                       ("vs_honest", "receiver accuracy - honest swarm's (paired, final)"))):
        if key == "asr":
            for k, kind in enumerate(PAYLOADS):
                values = [r[f"asr_{kind}"] for r in out]
                xs = [i + (k - 0.5) * 0.38 for i in range(len(out))]
                ax.bar(xs, [v["mean"] if v else 0 for v in values], 0.38, label=kind,
                       yerr=[[v["mean"] - v["low"] if v else 0 for v in values],
                             [v["high"] - v["mean"] if v else 0 for v in values]], capsize=2)
            ax.legend()
        else:
            values = [r["vs_honest"] for r in out]
            ax.bar(range(len(out)), [v["mean"] if v else 0 for v in values], 0.6, color="tab:gray",
                   yerr=[[v["mean"] - v["low"] if v else 0 for v in values],
                         [v["high"] - v["mean"] if v else 0 for v in values]], capsize=2)
            ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(range(len(out)), names, rotation=60, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(folder: pathlib.Path) -> str:
    summary = json.loads((folder / "summary.json").read_text())
    out = rows(summary)
    text = table(out)
    (folder / "table.md").write_text(text + "\n")
    (folder / "table.json").write_text(json.dumps(out, indent=1) + "\n")
    figure(out, folder / "attack_success.png")
    return text


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python benchmarks/adversary_summary.py STUDY_DIR (holding summary.json)")
    print(main(pathlib.Path(sys.argv[1])))
