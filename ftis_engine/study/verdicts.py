"""A study's pre-registered hypotheses judged on its summaries: each test's estimate (mean and 95% t-interval over
seeds), its p-value, Holm's adjustment within its family, and the verdict the registration allows.

The rules, so that a verdict says no more than the registration and the data do:
- one family per `family` the registration names; where it names none, all of the study's tests are one family;
  a test without data (its group not in the summaries read) counts in its family with p = 1;
- an effect (above, below): the two-sided t-test of 0 (p < 0.05 exactly when the 95% interval shown excludes 0);
  it holds when its Holm-adjusted p is at most alpha and the estimate has the sign claimed, is contradicted when it
  is significant with the other sign, and is otherwise "not detected";
- no effect (equal, not-below, not-above) with a margin fixed in the registration: the equivalence test (TOST, or
  its one side) against the margin; it holds when that test is significant under Holm, else "not shown";
- no effect without a margin (only in a registration transcribed after the fact: a new one is refused): the data
  can fail to find an effect but never show there is none, so the best it reads is "not detected" (the two-sided
  test, under Holm, not significant); a significant effect in the direction the claim excludes contradicts it,
  one in the direction it allows (a gain under "not below") satisfies it;
- counts (all-zero, all-positive): what every seed's mean over steps was, an observation with no test, outside
  the family.

    python -m ftis_engine.study.verdicts --config configs/study/real-models.yaml --dir benchmarks/results/real_models

writes verdicts.md into the first --dir from the summary.json of every --dir given (a study run in parts, each into
a directory of its own, is judged from all of them together) and prints its path.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

from ..core.safefile import read_bytes, write_text
from .aggregate import (
    ACCURACY_BOUNDS,
    DIFFERENCE_BOUNDS,
    MAX_SUMMARY_BYTES,
    holm_adjusted,
    interval,
    margin_p,
    t_test_p,
)
from .config import COUNT_CLAIMS, EFFECT_CLAIMS, HypothesisTest, Preregistration, StudyError, load_study
from .report import verdicts_markdown

HOLDS, CONTRADICTED, NOT_DETECTED, NOT_SHOWN, NO_DATA = "holds", "contradicted", "not detected", "not shown", "no data"
ONE_FAMILY = "all"


def _by_seed(value: dict | None, seeds: list[int]) -> dict[int, float] | None:
    """seed -> value of an interval of summary.json (its own `seeds`, else the group's when their counts agree)."""
    if not value or not value.get("values"):
        return None
    whose = value.get("seeds") or (seeds if len(seeds) == len(value["values"]) else None)
    return dict(zip(whose, value["values"], strict=True)) if whose is not None else None


def measured(group: dict, test: HypothesisTest) -> dict[int, float] | None:
    """seed -> the value `test` measures in `group` (final, auc, early of its dataset, or a training stat's mean
    over steps); None when the summary does not hold it."""
    result = group["by_member"].get(test.member)
    if result is None:
        return None
    if test.measure.startswith("train."):
        return _by_seed(result.get("train", {}).get(test.measure.removeprefix("train.")), group["seeds"])
    return _by_seed(result.get(test.measure, {}).get(test.dataset), group["seeds"])


def at_step(group: dict, test: HypothesisTest) -> dict[int, float] | None:
    """seed -> the eval of `test.dataset` at step `test.vs_step` in `group`'s runs: from each seed's curve, or, in a
    summary that kept only the curve's mean and interval, the mean where the interval has no width (every seed had
    that value: a pretrained model's step-0 greedy eval)."""
    curve = group["by_member"].get(test.member, {}).get("curve", {}).get(test.dataset)
    if not curve or test.vs_step not in curve["steps"]:
        return None
    k = curve["steps"].index(test.vs_step)
    if "values" in curve:
        return dict(zip(curve["seeds"], curve["values"][k], strict=True))
    if curve["low"][k] == curve["high"][k] == curve["mean"][k]:
        return {seed: curve["mean"][k] for seed in group["seeds"]}
    return None


def quantity(groups: dict[str, dict], test: HypothesisTest) -> tuple[list[int], list[float]] | None:
    """(seeds, values) of the quantity `test` is about: the group's value minus `vs`'s (paired by seed, on the seeds
    both have), minus its own eval at `vs_step`, or its own value (compared with `test.value`). None when a group
    or a value is not in the summaries."""
    group = groups.get(test.group)
    own = measured(group, test) if group is not None else None
    if own is None:
        return None
    if test.vs is not None:
        base = measured(groups[test.vs], test) if test.vs in groups else None
    elif test.vs_step is not None:
        base = at_step(group, test)
    else:
        return list(own), list(own.values())
    if base is None:
        return None
    pairs = [(seed, value - base[seed]) for seed, value in own.items() if seed in base]
    return ([s for s, _ in pairs], [d for _, d in pairs]) if pairs else None


def _p_value(test: HypothesisTest, shifted: list[float]) -> float:
    """The p-value of `test` on its values minus `test.value` (or its paired differences); 1 with one seed."""
    if len(shifted) < 2:
        return 1.0
    if test.claim in EFFECT_CLAIMS or test.margin is None:
        return t_test_p(shifted)
    return margin_p(shifted, test.margin, {"equal": "both", "not-below": "above", "not-above": "below"}[test.claim])


def _verdict(test: HypothesisTest, shifted: list[float], significant: bool) -> str:
    if test.claim in COUNT_CLAIMS:
        return HOLDS if all((v == 0) if test.claim == "all-zero" else (v > 0) for v in shifted) else CONTRADICTED
    mean = sum(shifted) / len(shifted)
    if test.claim in EFFECT_CLAIMS:
        if not significant:
            return NOT_DETECTED
        return HOLDS if (mean > 0) == (test.claim == "above") else CONTRADICTED
    if test.margin is not None:
        return HOLDS if significant else NOT_SHOWN
    if not significant:
        return NOT_DETECTED
    allowed = {"equal": False, "not-below": mean > 0, "not-above": mean < 0}[test.claim]
    return HOLDS if allowed else CONTRADICTED


def _tally(verdicts: list[str]) -> str:
    counts = [(verdicts.count(v), v) for v in (HOLDS, CONTRADICTED, NOT_DETECTED, NOT_SHOWN, NO_DATA) if v in verdicts]
    said = ", ".join(f"{k} {'hold' if v == HOLDS and k > 1 else v}" for k, v in counts)
    return f"{len(verdicts)} test{'s' if len(verdicts) != 1 else ''}: {said}"


def overall(verdicts: list[str], untested: bool) -> str:
    """A hypothesis's verdict from its tests': holds (every test), contradicted (any test), the one verdict they
    all have, else "in part" with how many of each."""
    if all(v == NO_DATA for v in verdicts):
        return NO_DATA
    if CONTRADICTED in verdicts:
        return f"contradicted ({_tally(verdicts)})"
    if all(v == HOLDS for v in verdicts):
        return HOLDS + (" where tested (a part is not testable: below)" if untested else "")
    if len(set(verdicts)) == 1:
        return verdicts[0]
    return f"in part ({_tally(verdicts)})"


def judge(preregistration: Preregistration, summaries: list[dict]) -> dict[str, Any]:
    """Every hypothesis of `preregistration` judged on the groups of `summaries` (a group in several is taken from
    the first): its tests' estimates, p-values, Holm-adjusted p-values within their family and verdicts, and its
    overall verdict. JSON-ready."""
    groups: dict[str, dict] = {}
    for summary in summaries:
        for group in summary["groups"]:
            groups.setdefault(group["group"], group)
    alpha = preregistration.alpha
    judged: list[tuple[str, HypothesisTest, dict, list[float] | None]] = []  # (family, test, its row, its values)
    out = []
    for hypothesis in preregistration.hypotheses:
        family = hypothesis.family or ONE_FAMILY
        tests = []
        for test in hypothesis.tests:
            row: dict[str, Any] = {**test.model_dump(), "estimate": None, "p": None, "p_holm": None, "verdict": NO_DATA}
            data = quantity(groups, test)
            shifted = None
            if data is not None:
                seeds, values = data
                paired = test.vs is not None or test.vs_step is not None
                bounds = None if test.measure.startswith("train.") else DIFFERENCE_BOUNDS if paired else ACCURACY_BOUNDS
                row["estimate"] = interval(values, seeds, bounds)
                shifted = values if paired else [v - test.value for v in values]
                if test.claim not in COUNT_CLAIMS:
                    row["p"] = _p_value(test, shifted)
            judged.append((family, test, row, shifted))
            tests.append(row)
        out.append({"id": hypothesis.id, "text": hypothesis.text, "family": family, "untested": hypothesis.untested,
                    "tests": tests})
    families: dict[str, dict[str, Any]] = {}
    for family in dict.fromkeys(f for f, test, _, _ in judged if test.claim not in COUNT_CLAIMS):
        rows = [row for f, test, row, _ in judged if f == family and test.claim not in COUNT_CLAIMS]
        for row, adjusted in zip(rows, holm_adjusted([1.0 if r["p"] is None else r["p"] for r in rows])):
            row["p_holm"] = adjusted
        families[family] = {"tests": len(rows), "without_data": sum(r["p"] is None for r in rows)}
    for _, test, row, shifted in judged:
        if shifted is not None:
            row["verdict"] = _verdict(test, shifted, row["p_holm"] is not None and row["p_holm"] <= alpha)
    for hypothesis in out:
        hypothesis["verdict"] = overall([row["verdict"] for row in hypothesis["tests"]], bool(hypothesis["untested"]))
    return {"alpha": alpha, "transcribed": preregistration.transcribed, "families": families, "hypotheses": out}


def write_verdicts(study_config: pathlib.Path, dirs: list[pathlib.Path], command: str = "") -> pathlib.Path:
    """verdicts.md in dirs[0], the study's hypotheses judged on the summary.json of every dir. Returns its path."""
    study = load_study(study_config)
    if study.preregistration is None:
        raise StudyError(f"--config {study_config}: the study carries no preregistration")
    summaries = []
    for folder in dirs:
        try:
            raw = read_bytes(folder / "summary.json", MAX_SUMMARY_BYTES, "a study's summary.json")  # bounded
            summaries.append(json.loads(raw))
        except (OSError, ValueError) as exc:
            # from None: a one-line error for the user; the cause adds nothing to it
            raise StudyError(f"--dir {folder}: no readable summary.json ({exc})") from None
    verdicts = judge(study.preregistration, summaries)
    sources = [str(d / "summary.json") for d in dirs]
    return write_text(dirs[0] / "verdicts.md", verdicts_markdown(study.study, verdicts, command=command,
                                                                 sources=sources))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ftis_engine.study.verdicts",
                                     description="Write a study's verdicts.md from its summaries.")
    parser.add_argument("--config", type=pathlib.Path, required=True, help="the study's config (with its "
                        "preregistration)")
    parser.add_argument("--dir", type=pathlib.Path, action="append", required=True, help="a directory holding the "
                        "study's summary.json; several for a study run in parts (verdicts.md goes into the first)")
    args = parser.parse_args(argv)
    command = " ".join(["python -m ftis_engine.study.verdicts --config", str(args.config)]
                       + [f"--dir {d}" for d in args.dir])
    try:
        print(write_verdicts(args.config, args.dir, command))
    except StudyError as exc:  # a config or folder that cannot be judged: one line, exit 2, no traceback
        parser.exit(2, f"error: {exc}\n")


if __name__ == "__main__":
    main()
