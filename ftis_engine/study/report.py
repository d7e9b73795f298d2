"""A study's outputs: summary.json, report.md and verdicts.md (report.md's tables: tables.py; the figures:
figures.py).

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
import pathlib

from ..core.safefile import read_bytes, write_json, write_text
from ..data.tasks import load_task
from .aggregate import ACCURACY_BOUNDS, ATTACK_SUFFIX, DIFFERENCE_BOUNDS, MAX_SUMMARY_BYTES, eval_questions
from .config import StudyConfig
from .figures import curve_lines, distance_points, draw_figures, kl_measure  # noqa: F401 (importable from here)
from .plan import Group, first_alone_groups, paired_alone, plan
from .tables import (
    CLIPPED_MARK,
    HOLM_MARK,
    _absolute_tables,
    _Cells,
    _distance_tables,
    _fmt,
    _paired_table,
    check_table,
    seed_list,
)


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
        body += check_table(groups)
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


def write_outputs(study: StudyConfig, groups: list[Group], summary: dict, output_dir: pathlib.Path) -> None:
    """figures/*.png, summary.json (strict JSON: no NaN), report.md and verdicts.md, each through the one safe
    writer (safefile: whole or not at all, never through a link in the study's directory)."""
    figures = draw_figures(study, summary, output_dir / "figures")
    summary["figures"] = [f"figures/{p.name}" for p in figures]
    write_json(output_dir / "summary.json", summary, indent=1)
    write_text(output_dir / "report.md", report_markdown(summary, figures))
    if summary.get("verdicts"):
        write_text(output_dir / "verdicts.md", verdicts_markdown(summary["study"], summary["verdicts"],
                                                                 command=summary.get("command", ""),
                                                                 sources=["summary.json"]))


def eval_questions_from_config(study: StudyConfig, summary: dict) -> dict[str, int | list[int]]:
    """Eval set -> its number of questions as the study's config makes it (the task's eval sets, cut to
    eval.max_samples), for the groups of `summary`: a summary made before the eval records' sizes were kept."""

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
    summary = json.loads(read_bytes(output_dir / "summary.json", MAX_SUMMARY_BYTES, "a study's summary.json"))
    if not summary.get("eval_questions"):
        summary["eval_questions"] = eval_questions_from_config(study, summary)
        summary["eval_questions_from"] = "config"
    if figures:
        drawn = draw_figures(study, summary, output_dir / "figures")
    else:
        drawn = [output_dir / f for f in summary.get("figures", [])]
    return write_text(output_dir / "report.md", report_markdown(summary, drawn))

