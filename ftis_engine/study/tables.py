"""A study report's tables: each cell's format (a mean and its 95% interval over seeds, clipped ends marked, a value
every seed shares said as such), the absolute tables of a member set (on the seeds its groups share, then per
further seed set), the paired tables (against alone, against a baseline) and the tables by peer distance, each table
a family for Holm's correction (report.py assembles them into report.md)."""

from __future__ import annotations

from .aggregate import ACCURACY_BOUNDS, DIFFERENCE_BOUNDS, all_equal, clip, holm, interval, t_test_p

HOLM_MARK = "†"
CLIPPED_MARK = "*"


def seed_list(seeds: list[int]) -> str:
    """Seeds as runs of consecutive numbers: [0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for seed in sorted(seeds):
        if runs and seed == runs[-1][-1] + 1:
            runs[-1].append(seed)
        else:
            runs.append([seed])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _fmt(value: dict | None, digits: int = 3, bounds: tuple[float, float] | None = None,
         questions: int | None = None) -> str:
    """A mean and its 95% interval over seeds. bounds: the interval ends are set within them (CLIPPED_MARK where
    one moved; summaries made before aggregate clipped are clipped here). Every seed at the same value: no
    interval of no width but what it is, "0 of 500" (questions: the eval set's size, for a final accuracy that is
    0 or 1 on every seed: seeds x questions) or "0.000 on all 5 seeds"."""
    if not value:
        return "–"
    values = value.get("values") or []
    if value["n"] >= 2 and len(values) == value["n"] and all_equal(values):
        if questions and bounds == ACCURACY_BOUNDS and values[0] in bounds:
            total = questions * value["n"]
            return f"{round(values[0] * total)} of {total}"
        return f"{values[0] + 0.0:.{digits}f} on all {value['n']} seeds"
    if value["n"] < 2:
        return f"{value['mean']:.{digits}f}"
    if bounds is not None:
        value = clip(dict(value), bounds)
    marks = [CLIPPED_MARK if value.get("clipped") and end in bounds else "" for end in (value["low"], value["high"])]
    return (f"{value['mean']:.{digits}f} [{value['low']:.{digits}f}{marks[0]}, "
            f"{value['high']:.{digits}f}{marks[1]}]")


def _fmt_g(value: dict | None) -> str:
    return "–" if not value else f"{value['mean']:.3g}"


def _on_seeds(value: dict | None, seeds: set[int], bounds: tuple[float, float] | None = None) -> dict | None:
    """An interval over its values of `seeds` only (None when it has none of them); an interval that does not say
    whose each value is is returned as it is (summaries from before seeds were kept: every group had all seeds)."""
    if not value or "seeds" not in value:
        return value
    pairs = [(s, v) for s, v in zip(value["seeds"], value["values"]) if s in seeds]
    return interval([v for _, v in pairs], [s for s, _ in pairs], bounds) if pairs else None


def _size(summary: dict, dataset: str) -> int | None:
    """How many questions `dataset` (or an attack success rate on it) has, when the summary says one number."""
    size = (summary.get("eval_questions") or {}).get(dataset)
    return size if isinstance(size, int) else None


class _Cells:
    """The paired intervals a report shows, for its multiplicity statement: each distinct interval once (a group
    against one reference, per member, metric and eval set), whatever tables show it."""

    def __init__(self):
        self.seen: dict[tuple, dict] = {}

    def add(self, key: tuple, value: dict | None) -> None:
        if value and value["n"] >= 2:
            self.seen[key] = value

    def counts(self) -> tuple[int, int]:
        """(intervals with 2 seeds or more, how many of them exclude 0)."""
        return len(self.seen), sum(_excludes_zero(v) for v in self.seen.values())


def _excludes_zero(value: dict) -> bool:
    return value["n"] >= 2 and (value["low"] > 0 or value["high"] < 0)


def _holm_marks(values: list[dict | None]) -> tuple[list[bool], int, int]:
    """Holm over one table's intervals (a family): (survives, per value; intervals tested; how many exclude 0).
    Each interval's p-value is that of the t-test its 95% interval is the inverse of."""
    tested = [i for i, v in enumerate(values) if v and v["n"] >= 2 and len(v.get("values") or []) == v["n"]]
    rejected = holm([t_test_p(values[i]["values"]) for i in tested])
    survives = [False] * len(values)
    for i, r in zip(tested, rejected):
        survives[i] = r
    return survives, len(tested), sum(_excludes_zero(values[i]) for i in tested)


def _family_line(tested: int, excluding: int, surviving: int) -> str:
    if not tested:
        return ""
    return (f"{tested} intervals in this table, {excluding} {'excludes' if excluding == 1 else 'exclude'} 0 (with "
            f"no difference anywhere about {tested / 20:.1f} would by chance); {surviving} "
            f"{'holds' if surviving == 1 else 'hold'} under Holm's correction over this table at a family-wise 5% "
            f"({HOLM_MARK}).")


def _paired_cell(value: dict | None, survives: bool) -> str:
    return _fmt(value, bounds=DIFFERENCE_BOUNDS) + (HOLM_MARK if survives else "")


def _absolute_tables(summary: dict, groups: list[dict], datasets: list[str]) -> list[str]:
    """The member set's absolute numbers: one table when its groups ran the same seeds; else a table of every group
    on the seeds they all have, then one per further seed set (the groups that ran exactly it, on all of it)."""
    seed_sets = list(dict.fromkeys(tuple(g["seeds"]) for g in groups if g["seeds"]))
    if len(seed_sets) <= 1:
        return _absolute_table(summary, groups, datasets, None) + [""]
    shared = set.intersection(*(set(s) for s in seed_sets))
    lines = []
    if shared:
        lines += [f"On seeds {seed_list(sorted(shared))}, which every group of this set has: the rows compare with "
                  "each other.", ""]
        lines += _absolute_table(summary, groups, datasets, shared) + [""]
    for seeds in seed_sets:
        if set(seeds) == shared:
            continue
        chosen = [g for g in groups if tuple(g["seeds"]) == seeds]
        lines += [f"The groups that ran seeds {seed_list(list(seeds))}, on all of them: these rows compare with each "
                  "other only, not with the rows of another seed set" + (" above" if shared else "") + ".", ""]
        lines += _absolute_table(summary, chosen, datasets, set(seeds)) + [""]
    return lines


def _absolute_table(summary: dict, groups: list[dict], datasets: list[str], seeds: set[int] | None) -> list[str]:
    head = ["group", "member", "method", "collab", "g", "seeds"]
    head += [f"final {d}" for d in datasets] + [f"AUC {d}" for d in datasets] + [f"early {d}" for d in datasets[:1]]
    head += ["peer KL", "peer filtered", "IS w", "truncated", "reward"]
    asynchronous = any(g.get("swarm_mode") == "async" for g in groups)
    head += ["staleness"] if asynchronous else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def on(value, bounds=None):
        return value if seeds is None else _on_seeds(value, seeds, bounds)

    for g in groups:
        for member, r in g["by_member"].items():
            t = r["train"]
            shown = [s for s in g["seeds"] if seeds is None or s in seeds]
            row = [g["group"], member, g["method"] if g["collaboration"] != "alone" else "–", g["collaboration"],
                   f"{g['g']:g}" if g["method"].startswith("f-") and g["collaboration"] != "alone" else "–",
                   seed_list(shown)]
            row += [_fmt(on(r["final"].get(d), ACCURACY_BOUNDS), bounds=ACCURACY_BOUNDS, questions=_size(summary, d))
                    for d in datasets]
            row += [_fmt(on(r["auc"].get(d), ACCURACY_BOUNDS), bounds=ACCURACY_BOUNDS) for d in datasets]
            row += [_fmt(on(r["early"].get(d), ACCURACY_BOUNDS), bounds=ACCURACY_BOUNDS) for d in datasets[:1]]
            row += [_fmt_g(on(t.get(key))) for key in ("peer_kl_mean", "peer_filtered_frac", "is_weight_mean",
                                                          "is_truncated_frac", "reward_mean")]
            row += [_fmt_g(on(t.get("staleness_mean")))] if asynchronous else []
            lines.append("| " + " | ".join(row) + " |")
    return lines


def against(group: dict, member: str, alone: str | None) -> dict:
    """`member`'s paired differences in `group` from the alone group `alone` (None: the group's own alone)."""
    result = group["by_member"].get(member, {})
    if alone is None or alone == group.get("alone"):
        return result.get("vs_alone", {})
    return result.get("vs_alones", {}).get(alone, {})


def _alones(group: dict) -> tuple[str, ...]:
    """The alone groups a group is paired with by name: its `alone`, then its `also_alone`."""
    return (group["alone"], *group.get("also_alone", []))


def _distance_tables(groups: list[dict], cells: _Cells) -> list[str]:
    """Where groups of several member sets share one alone group (a distance study): for each alone group they are
    paired with and each of its members, per metric and eval set, a row per member set (by increasing mean peer
    KL) and a column per method. Each table is a family for Holm's correction."""
    shared = [g for g in groups if g.get("alone")]
    if len({g["member_set"] for g in shared}) < 2:
        return []
    by_name = {g["group"]: g for g in groups}
    lines = ["## By peer distance", "",
             "Each member set's groups against an alone group they share: Δ = group - alone, per seed, mean and 95% "
             "t-interval over the seeds both have; rows by the mean peer KL measured in the member set's runs.", ""]
    for alone in dict.fromkeys(a for g in shared for a in _alones(g)):
        paired = [g for g in shared if alone in _alones(g)]
        for member in by_name[alone]["by_member"] if alone in by_name else []:
            rows: dict[str, dict[str, tuple[str, dict]]] = {}
            for g in paired:
                if member in g["by_member"]:
                    rows.setdefault(g["member_set"], {})[g["method"]] = (g["group"], against(g, member, alone))
            methods = list(dict.fromkeys(m for row in rows.values() for m in row))
            distances = set_distances(paired, member)
            order = sorted(rows, key=lambda s: distances.get(s, float("inf")))
            datasets = sorted({d for row in rows.values() for _, r in row.values() for d in r.get("final", {})})
            for metric, label in (("final", "final"), ("auc", "AUC")):
                for dataset in datasets:
                    values = {(name, m): rows[name][m][1].get(metric, {}).get(dataset)
                              for name in order for m in methods if m in rows[name]}
                    for (name, m), value in values.items():
                        cells.add((rows[name][m][0], member, alone, metric, dataset), value)
                    survives, tested, excluding = _holm_marks(list(values.values()))
                    marks = dict(zip(values, survives))
                    seed_sets = {tuple(v["seeds"]) for v in values.values() if v and "seeds" in v}
                    on = f", on seeds {seed_list(list(next(iter(seed_sets))))}" if len(seed_sets) == 1 else ""
                    lines += [f"`{member}` against `{alone}`, Δ {label} {dataset}{on}:", "",
                              "| member set | peer KL | " + " | ".join(methods) + " |",
                              "|" + "---|" * (2 + len(methods))]
                    for name in order:
                        row = []
                        for m in methods:
                            if (name, m) not in values:
                                row.append("–")
                                continue
                            value = values[(name, m)]
                            cell = _paired_cell(value, marks[(name, m)])
                            if value and len(seed_sets) > 1 and "seeds" in value:
                                cell += f" (seeds {seed_list(value['seeds'])})"
                            row.append(cell)
                        kl = distances.get(name, float("nan"))
                        lines.append(f"| {name} | {kl:.3g} | " + " | ".join(row) + " |")
                    lines += ["", _family_line(tested, excluding, sum(survives)), ""] if tested else [""]
    return lines


def _paired_table(groups: list[dict], datasets: list[str], key: str, intro: str, cells: _Cells,
                  reference) -> list[str]:
    """A table of the paired differences `key` (vs_alone, vs_baseline) of every group and member that has them,
    with the seeds each row is paired on; the table is a family for Holm's correction. reference(group): the name
    of the group its differences are taken from (for the report's count of distinct intervals)."""
    paired = [(g, member, r[key]) for g in groups for member, r in g["by_member"].items() if key in r]
    if not paired:
        return []
    head = ["group", "member"] + (["baseline"] if key == "vs_baseline" else ["peer KL"])
    head += [f"Δ final {d}" for d in datasets] + [f"Δ AUC {d}" for d in datasets] + [f"Δ early {d}" for d in datasets[:1]]
    head += ["seeds"]
    columns = [("final", d) for d in datasets] + [("auc", d) for d in datasets] + [("early", d) for d in datasets[:1]]
    values = [vs[metric].get(d) for _, _, vs in paired for metric, d in columns]
    for (g, member, vs) in paired:
        for metric, d in columns:
            cells.add((g["group"], member, reference(g), metric, d), vs[metric].get(d))
    survives, tested, excluding = _holm_marks(values)
    lines = [intro, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k, (g, member, vs) in enumerate(paired):
        row = [g["group"], member]
        row += [g["baseline"]] if key == "vs_baseline" else [
            _fmt_g(g["by_member"][member].get("train", {}).get("peer_kl_mean"))]
        at = k * len(columns)
        row += [_paired_cell(values[at + j], survives[at + j]) for j in range(len(columns))]
        seeds = {tuple(v["seeds"]) for v in values[at:at + len(columns)] if v and "seeds" in v}
        row += [" / ".join(seed_list(list(s)) for s in sorted(seeds)) if seeds else
                str(max((v["n"] for v in values[at:at + len(columns)] if v), default=0))]
        lines.append("| " + " | ".join(row) + " |")
    return lines + ["", _family_line(tested, excluding, sum(survives)), ""] if tested else lines + [""]


def set_distances(groups: list[dict], member: str) -> dict[str, float]:
    """Member set -> how far `member`'s peer is there: the peer KL measured in its collaborating groups (mean over
    them; an estimate a rounding below 0 counts as 0)."""
    kls: dict[str, list[float]] = {}
    for g in groups:
        kl = g["by_member"].get(member, {}).get("train", {}).get("peer_kl_mean")
        if g["collaboration"] != "alone" and kl:
            kls.setdefault(g["member_set"], []).append(kl["mean"])
    return {s: max(0.0, sum(v) / len(v)) for s, v in kls.items()}


def check_table(groups: list[dict]) -> list[str]:
    """What rules out a bug in the runs themselves, per group and member, over every step of every seed (aggregate
    `checks`): the range of own_ratio_mean, the peers' sequences a step, the largest share of them the filter
    dropped and the steps it dropped all of them. [] for a summary made before these were kept."""
    rows = [(g, member, r["checks"]) for g in groups for member, r in g["by_member"].items() if r.get("checks")]
    if not rows:
        return []
    lines = ["What rules out a bug in the runs themselves, over every step of every seed: **own ratio** is the mean "
             "of exp(trained - generated log-prob) over a member's own rollouts (1 when its engine generated with "
             "the weights it trains: each push reached the engine); **peer sequences** the peers' sequences it "
             "trained on a step (received and counted); **filtered** the largest share of them the KL filter "
             "dropped in a step, and in how many steps it dropped all of them.", "",
             "| group | member | steps | own ratio (min, max) | peer sequences a step (min, max) | filtered (max) | "
             "steps all filtered |", "|---|---|---|---|---|---|---|"]
    for g, member, c in rows:
        own = "–" if c["own_ratio"] is None else f"{c['own_ratio'][0]:.4f}, {c['own_ratio'][1]:.4f}"
        peers = "–" if c["peer_sequences"] is None else f"{c['peer_sequences'][0]:g}, {c['peer_sequences'][1]:g}"
        filtered = "–" if c["peer_filtered_max"] is None else f"{c['peer_filtered_max']:.3f}"
        lines.append(f"| {g['group']} | {member} | {c['steps']} | {own} | {peers} | {filtered} | "
                     f"{c['all_filtered_steps'] if c['peer_filtered_max'] is not None else '–'} |")
    return lines + [""]
