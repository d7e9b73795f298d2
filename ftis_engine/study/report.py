"""A study's outputs: summary.json, report.md and the figures.

What a demanding reader needs beside the numbers, the report says: absolute numbers are compared only on the seeds
the compared groups share (a member set whose groups ran different seeds gets a table on the shared seeds and one
per further seed set); every interval is over seeds on fixed eval sets of a stated size; an interval end past what
an accuracy can be is set on the bound and marked; how many paired intervals it shows, how many exclude 0, and
which survive Holm's correction within their table; the code version the runs were made with.

    python -m ftis_engine.study.rewrite --config configs/study/paper.yaml --dir benchmarks/results/paper_study

rewrites a study's report.md (and figures) from its summary.json, without running anything."""

from __future__ import annotations

import json
import math
import os
import pathlib
import textwrap

from .aggregate import ACCURACY_BOUNDS, DIFFERENCE_BOUNDS, all_equal, clip, holm, interval, t_test_p
from .config import FigureSettings, StudyConfig
from .plan import Group, first_alone_groups, paired_alone, plan

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


def report_markdown(summary: dict, figures: list[pathlib.Path]) -> str:
    cells = _Cells()
    body: list[str] = []
    by_set: dict[str, list[dict]] = {}
    for group in summary["groups"]:
        by_set.setdefault(group["member_set"], []).append(group)
    first_alone = first_alone_groups([(g["group"], g["collaboration"], g["member_set"]) for g in summary["groups"]])
    for member_set, groups in by_set.items():
        datasets = sorted({d for g in groups for m in g["by_member"].values() for d in m["final"]})
        body += [f"## Member set `{member_set}`", ""]
        body += _absolute_tables(summary, groups, datasets)
        own = sorted({g["alone"] for g in groups if g.get("alone")})
        whose = f"the alone group `{'`, `'.join(own)}`" if own else f"`{member_set}`'s alone baseline"
        body += _paired_table(groups, datasets, "vs_alone", f"Paired with {whose}: per seed, this group's number "
                              "minus the alone run's (same seed: same warm start, same data order), mean and 95% "
                              "t-interval over the seeds both have (the last column); peer KL as above.", cells,
                              lambda g: paired_alone(g.get("alone") or None, g["member_set"], first_alone))
        body += _paired_table(groups, datasets, "vs_baseline", "Paired with each group's baseline (Δ = group - "
                              "baseline, per seed, mean and 95% t-interval over the seeds both have):", cells,
                              lambda g: g.get("baseline"))
    body += _distance_tables(summary["groups"], cells)
    if figures:
        body += ["## Figures", ""] + [f"![{p.stem}](figures/{p.name})" for p in figures] + [""]
    lines = [f"# Study `{summary['study']}`{' (--quick)' if summary['quick'] else ''}", ""]
    if summary.get("command"):
        lines += ["Made by:", "", f"    {summary['command']}", ""]
    lines += [_code_line(summary), ""]
    for said in (_launch_line(summary), _verdicts_line(summary)):
        lines += [said, ""] if said else []
    lines += [_reading(summary), ""]
    shown, excluding = cells.counts()
    if shown:
        verb = "excludes" if excluding == 1 else "exclude"
        lines += [f"Multiplicity: this report shows {shown} paired intervals (Δ cells of 2 seeds or more, each "
                  f"counted once whatever tables show it), and {excluding} of them {verb} 0. With 95% intervals about "
                  f"5% of them, {shown / 20:.1f} here, would exclude 0 by chance if no group differed from its "
                  "reference at all, and they are not independent (final, AUC and early of one run move together; "
                  "the groups of a table share their reference's runs). One interval excluding 0 is not a finding "
                  f"by itself; {HOLM_MARK} marks those that hold under Holm's correction over their table (a "
                  "family-wise error of 5% for the table), each interval's p-value being its t-test's.", ""]
    return "\n".join(lines + body)


def _code_line(summary: dict) -> str:
    code = summary.get("code")
    if not code:
        return ("Code version: not recorded (this summary was made before studies recorded the commit its runs "
                "were made with).")
    if code["commit"] == "unknown":
        line = "Code: commit unknown (the package did not run from a git checkout)."
    else:
        line = f"Code: commit {code['commit']}" + (" with uncommitted changes (the commit does not pin the code)"
                                                   if code.get("dirty") else "") + "."
    other = summary.get("other_code") or []
    if other:
        runs = "; ".join(f"{o['group']} seed {o['seed']}: {', '.join(o['commits'])}" for o in other)
        line += (f" {len(other)} of its runs were made, in whole or in part, under other code or code not recorded "
                 f"(their numbers mix code versions): {runs}.")
    return line


def _launch_line(summary: dict) -> str:
    """When the runs were launched, and when the pre-registration was last committed: a run launched before that
    commit ran before its hypotheses were fixed, and the line says so."""
    from datetime import datetime

    times = sorted(datetime.fromisoformat(t) for launch in summary.get("launches") or [] for t in launch["started"])
    registered = [r for r in (summary.get("preregistration") or {}).get("registered", []) if r.get("committed")]
    parts = []
    if registered:
        parts.append("Pre-registration: " + "; ".join(f"`{r['file']}` last committed in {r['commit'][:12]} at "
                                                      f"{r['committed']}" for r in registered) + ".")
    if times:
        parts.append(f"Runs launched from {times[0].isoformat()} to {times[-1].isoformat()} (each run's launches: "
                     "`launches` in summary.json).")
        last = max((datetime.fromisoformat(r["committed"]) for r in registered), default=None)
        early = [t for t in times if last is not None and t < last]
        if early:
            parts.append(f"**{len(early)} launch(es) came before the pre-registration's last commit**: those runs "
                         "started before their hypotheses were fixed.")
    return " ".join(parts)


def _verdicts_line(summary: dict) -> str:
    verdicts = summary.get("verdicts")
    if not verdicts:
        return ""
    said = "; ".join(f"{h['id']} {h['verdict']}" for h in verdicts["hypotheses"])
    return (f"Pre-registered hypotheses, judged under Holm's correction within their family in "
            f"[verdicts.md](verdicts.md): {said}.")


def _reading(summary: dict) -> str:
    groups = summary["groups"]
    more = any(g["seeds"] != summary["seeds"] for g in groups if g["seeds"])
    seeds = f"Seeds {seed_list(summary['seeds'])}" + (
        " (groups with other seeds say which in their seeds column; rows are compared only on the same seeds: a "
        "member set whose groups ran different seeds has a table on the seeds they all have, then one per further "
        "seed set, whose rows compare only with each other; a paired difference uses the seeds both groups have)"
        if more else "")
    sizes = summary.get("eval_questions") or {}
    plain = {d: n for d, n in sizes.items() if "-asr-" not in d}
    if plain:
        listed = ", ".join(f"{d} {n if isinstance(n, int) else ' or '.join(map(str, n))} questions"
                           for d, n in plain.items())
        where = " (sizes from the study's config: this summary predates their record)" \
            if summary.get("eval_questions_from") == "config" else ""
        smallest = min(min(n) if isinstance(n, list) else n for n in plain.values())
        questions = (f" on fixed eval sets, the same questions for every seed and group: {listed}{where}. The "
                     "intervals leave out the sampling of the questions: another draw of "
                     f"{smallest} questions alone would move an accuracy of 0.5 by about "
                     f"±{1.96 * math.sqrt(0.25 / smallest):.3f} (binomial 95%), a paired difference on the same "
                     "questions less")
    else:
        questions = " on fixed eval sets (the same questions for every seed and group; their sizes are not recorded " \
                    "in this summary), leaving out the sampling of the questions"
    return (f"{seeds}. Every number is a mean over seeds with its 95% t-interval in brackets, over seeds only,"
            f"{questions}. final: greedy pass@1 at the last step; AUC: mean accuracy over the run (area under the "
            "eval curve / steps); early: mean over the eval points of the run's first half (step 0 excluded). "
            f"{CLIPPED_MARK}: an interval end set on what the quantity can be (0 or 1 for an accuracy or an attack "
            "success rate; the t-interval went past it). \"0 of 500\": every seed's final value was 0 (500 = seeds "
            "x questions); \"on all n seeds\": every seed gave that value. Training stats are means over steps, "
            "then seeds: peer KL is the mean KL_i of the peers' rollouts under the receiver (the configured "
            "estimator and reduction: k3, summed over the sequence by default), peer filtered the share of the "
            "peers' rollouts the filter dropped, IS w the mean truncated weight over all tokens.")


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


VERDICT_RULES = (
    "Each test is one comparison, seed by seed: a group's value minus the group it names (paired on the seeds both "
    "have), minus the same runs' eval at a step, or the group's own value against the one the claim names. "
    "Estimate: mean and 95% t-interval over seeds (intervals of shares set within their bounds, `*`). p: the "
    "two-sided t-test of no difference (p < 0.05 exactly when the interval excludes 0); for a claim of no effect "
    "with a registered margin, the equivalence test against that margin (TOST; one side of it for 'not below' or "
    "'not above'). Holm p: p adjusted by Holm's step-down correction within the test's family (the family-wise error "
    "rate is alpha for the family). A claimed effect **holds** when its Holm p is at most alpha with the sign "
    "claimed, is **contradicted** when it is significant with the other sign, and is otherwise **not detected**. "
    "A claim of no effect holds only against a margin fixed before the runs (else, with a margin, **not shown**); "
    "without one the data can only fail to detect an effect, so it reads **not detected** at best, and a "
    "significant effect in the direction it excludes contradicts it. Counts (every seed's mean over steps 0, or "
    "above 0) are observations without a test, outside the family. A test whose groups are not in the summaries "
    "read has **no data** and counts in its family with p = 1.")

CLAIM_SIGNS = {"above": ">", "below": "<", "equal": "=", "not-below": "≥", "not-above": "≤"}


def _test_label(test: dict) -> str:
    what = test["measure"].removeprefix("train.") if test["measure"].startswith("train.") \
        else f"{test['measure']} {test['dataset']}"
    if test["vs"] is not None:
        return f"{test['group']} - {test['vs']}: {test['member']}, {what}"
    if test["vs_step"] is not None:
        return f"{test['group']}: {test['member']}, {what} - step {test['vs_step']}"
    return f"{test['group']}: {test['member']}, {what}"


def _claim_label(test: dict) -> str:
    if test["claim"] == "all-zero":
        return "0 on every seed (count)"
    if test["claim"] == "all-positive":
        return "> 0 on every seed (count)"
    reference = "0" if test["vs"] is not None or test["vs_step"] is not None else f"{test['value']:g}"
    label = f"{CLAIM_SIGNS[test['claim']]} {reference}"
    if test["claim"] in ("above", "below"):
        return label
    return label + (f" within ±{test['margin']:g}" if test["margin"] is not None else " (no margin registered)")


def _p_text(p: float | None) -> str:
    if p is None:
        return "–"
    return f"{p:.1e}" if p < 0.001 else f"{p:.3f}"


def verdicts_markdown(study: str, verdicts: dict, command: str = "", sources: list[str] | None = None) -> str:
    """verdicts.md: each pre-registered hypothesis as registered (its text), its tests (estimate, p, Holm p,
    verdict) and its overall verdict, under the rules of verdicts.py (VERDICT_RULES)."""
    lines = [f"# Study `{study}`: the pre-registered hypotheses", ""]
    if command:
        lines += ["Made by:", "", f"    {command}", ""]
    if sources:
        lines += ["From: " + ", ".join(f"`{s}`" for s in sources) + ".", ""]
    if verdicts.get("transcribed"):
        lines += [f"Transcribed: {verdicts['transcribed']}", ""]
    families = "; ".join(f"family `{name}`: {f['tests']} tests" + (f" ({f['without_data']} without data)"
                                                                     if f["without_data"] else "")
                         for name, f in verdicts["families"].items())
    lines += [VERDICT_RULES + f" Alpha {verdicts['alpha']:g}; {families}.", ""]
    lines += ["| hypothesis | verdict |", "|---|---|"]
    lines += [f"| [{h['id']}](#{h['id'].lower()}) | {h['verdict']} |" for h in verdicts["hypotheses"]]
    lines.append("")
    for h in verdicts["hypotheses"]:
        lines += [f"## {h['id']}", "", "> " + " ".join(h["text"].split()), ""]
        lines += ["| test | claim | estimate | seeds | p | Holm p | verdict |", "|---|---|---|---|---|---|---|"]
        for test in h["tests"]:
            estimate = test["estimate"]
            bounds = None if estimate is None or test["measure"].startswith("train.") else (
                DIFFERENCE_BOUNDS if test["vs"] is not None or test["vs_step"] is not None else ACCURACY_BOUNDS)
            seeds = seed_list(estimate["seeds"]) if estimate and "seeds" in estimate else "–"
            lines.append(f"| {_test_label(test)} | {_claim_label(test)} | {_fmt(estimate, bounds=bounds)} | {seeds} | "
                         f"{_p_text(test['p'])} | {_p_text(test['p_holm'])} | {test['verdict']} |")
        lines += ["", f"Verdict: **{h['verdict']}**.", ""]
        if h["untested"]:
            lines += ["Not tested:", ""] + [f"- {part}" for part in h["untested"]] + [""]
    return "\n".join(lines)


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
    --quick draws what it has."""
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
    if summary.get("verdicts"):
        (output_dir / "verdicts.md").write_text(verdicts_markdown(summary["study"], summary["verdicts"],
                                                                  command=summary.get("command", ""),
                                                                  sources=["summary.json"]))


def eval_questions_from_config(study: StudyConfig, summary: dict) -> dict[str, int | list[int]]:
    """Eval set -> its number of questions as the study's config makes it (the task's eval sets, cut to
    eval.max_samples), for the groups of `summary`: a summary made before the eval records' sizes were kept."""
    from ..tasks import load_task
    from .aggregate import ATTACK_SUFFIX, eval_questions

    names = {g["group"] for g in summary["groups"]}
    planned = [g for g in plan(study, pathlib.Path("/nonexistent"), summary["quick"], summary.get("only"))
               if g.name in names]
    sizes = []
    for group in planned:
        config = group.config
        task = load_task(config.data, config.seed, config.eval.datasets, with_train=False,
                         eval_reward=config.eval.reward)
        sizes.append({name: len(examples[: config.eval.max_samples] if config.eval.max_samples else examples)
                      for name, examples in task.evals.items()})
    found = eval_questions(sizes)
    for dataset in {d for g in summary["groups"] for m in g["by_member"].values() for d in m["final"]}:
        base = dataset.split(ATTACK_SUFFIX)[0]
        if ATTACK_SUFFIX in dataset and base in found:
            found[dataset] = found[base]
    return dict(sorted(found.items()))


def rewrite_report(study: StudyConfig, output_dir: pathlib.Path, figures: bool = True) -> pathlib.Path:
    """report.md (and, with `figures`, the figures) of a finished study written again from its summary.json with
    this code, nothing run and summary.json left as it is; eval set sizes a summary lacks are taken from the
    study's config (said in the report). Returns report.md's path."""
    summary = json.loads((output_dir / "summary.json").read_text())
    if not summary.get("eval_questions"):
        summary["eval_questions"] = eval_questions_from_config(study, summary)
        summary["eval_questions_from"] = "config"
    if figures:
        drawn = draw_figures(study, summary, output_dir / "figures")
    else:
        drawn = [output_dir / f for f in summary.get("figures", [])]
    path = output_dir / "report.md"
    path.write_text(report_markdown(summary, drawn))
    return path

