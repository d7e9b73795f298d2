"""A study's numbers: per group and member, eval curves, final accuracy, AUC and early accuracy with 95% intervals
over seeds, the training stats, and paired differences seed by seed.

Every interval is over seeds only, on eval sets that are fixed (the same questions for every seed and group): it
says how much the numbers move from seed to seed, not how much another sample of questions would move them."""

from __future__ import annotations

import logging
import math
import pathlib
from collections.abc import Collection
from typing import Any

from ..report.metrics import MetricsError, read_lines
from .config import StudyConfig, StudyError
from .plan import Group, first_alone_groups, paired_alone

log = logging.getLogger("ftis_engine")

# two-sided 95% quantiles of Student's t by degrees of freedom (1..30); 1.96 beyond
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]

TRAIN_STATS = ("reward_mean", "kl_mean", "filtered_frac", "is_weight_mean", "is_truncated_frac", "clip_frac",
               "entropy_mean", "completion_len_mean", "staleness_mean", "stale_dropped", "train_seconds",
               "screen_seconds", "peer_sequences", "rejected_batches", "likelihood_dropped", "quarantined",
               "length_dropped", "share_capped", "forged_sent")
# an eval record's attack success rate per payload (eval.payloads, or a text adversary in the run) is read as one
# more eval set of its own, "<dataset>-asr-<kind>", so it gets the same curves, final values, intervals and paired
# differences as accuracy
ATTACK_SUFFIX = "-asr-"
# Over the peers' rollouts only. A member's own rollouts come from its current policy (KL 0 up to rounding, never
# filtered), so the step's mean over all sequences, times sequences / peer sequences, is the mean over the peers':
# peer_kl_mean is the KL between the members, as the receiver's estimator measures it.
PEER_STATS = {"peer_kl_mean": "kl_mean", "peer_filtered_frac": "filtered_frac"}
# the training stats also kept step by step (mean and 95% band over seeds at each step: the training figure): what
# the filter dropped of the peers' sequences and what share of the importance weights the cap truncated
STEP_STATS = ("peer_filtered_frac", "is_truncated_frac")
# what rules out a bug in a run (`checks`): the weights reaching the engine (own_ratio_mean: exp(trained - generated
# log-prob) over the member's own rollouts, 1 when the engine generated with the weights trained) and the peers'
# sequences counted, each step; the extremes over every step of every seed
CHECK_STATS = ("own_ratio_mean", "peer_sequences")
TRAIN_STEPS = "train_steps"  # a run's trace of the steps it logged a train record at (the checks' count)


# what an accuracy or an attack success rate can be (a share of the eval questions), and a difference of two
ACCURACY_BOUNDS = (0.0, 1.0)
DIFFERENCE_BOUNDS = (-1.0, 1.0)
# The largest magnitude a number the aggregate computes with may have (record_problem): no count, second, mean or KL
# of a run comes near it, and the sums over steps and seeds stay finite (1e308 overflowed the standard deviation).
MAX_SUMMARY_BYTES = 256 << 20  # summary.json, read whole by verdicts and a rewrite: its seeds' numbers, MBs
MAX_MAGNITUDE = 1e15
# the train keys read_run computes with: each a number within MAX_MAGNITUDE where present
NUMBERS = (*TRAIN_STATS, *PEER_STATS.values(), "sequences", "own_sequences")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _share(value: object) -> bool:
    """A share of questions: a number in [0, 1] (a NaN is in no range)."""
    return _number(value) and 0.0 <= value <= 1.0


def record_problem(record: dict, numbers: Collection[str] = NUMBERS) -> str | None:
    """Why a record (metrics.is_record) is out of the range the engine writes, in a few words naming the key; None
    when it is in range. A step below 0; an eval without a dataset, with an accuracy that is not a share in [0, 1]
    (1e308, NaN), samples that are not a count of at least 1, attack success rates that are not shares; under a key
    of `numbers`, present and not null (the writer logs a non-finite value as null), a value that is not a number
    within +-MAX_MAGNITUDE."""
    if record["step"] < 0:
        return f"step {record['step']}: below 0"
    for key in numbers:
        value = record.get(key)
        if value is not None and not (_number(value) and abs(value) <= MAX_MAGNITUDE):
            return f"{key}: {value!r} is not a number within +-{MAX_MAGNITUDE:g}"
    if record["kind"] != "eval":
        return None
    if not isinstance(record.get("dataset"), str) or not record["dataset"]:
        return f"dataset: {record.get('dataset')!r} is not an eval set's name"
    if not _share(record.get("accuracy")):
        return f"accuracy: {record.get('accuracy')!r} is not a share of the questions in [0, 1]"
    samples = record.get("samples")
    if samples is not None and not (isinstance(samples, int) and not isinstance(samples, bool) and samples >= 1):
        return f"samples: {samples!r} is not a count of questions (a whole number, at least 1)"
    rates = record.get("attack_success_by")
    if rates is not None and not (isinstance(rates, dict) and all(_share(v) for v in rates.values())):
        return "attack_success_by: not a share in [0, 1] for each payload"
    return None


def checked_records(path: pathlib.Path) -> list[tuple[dict, int]]:
    """(record, line number) of each record of a finished run's metrics.jsonl (or its kept .gz), read bounded
    (metrics.read_lines), each in range (record_problem) and no eval twice (a member's eval set at one step):
    MetricsError naming the file and the line otherwise. A line that is no record is left out with a warning that
    names the file, a last line torn by a crash silently (as metrics.read_metrics does)."""
    lines = read_lines(path)
    skipped = [n for n, _ in lines.bad if n < lines.count or not lines.open_end]
    if skipped:
        log.warning("%s: line(s) %s are not records (a JSON object with a kind, a member and a whole-number step); "
                    "left out of the study's numbers", path, ", ".join(map(str, skipped[:5])))
    evals: dict[tuple, int] = {}
    for record, number in zip(lines.records, lines.numbers, strict=True):
        problem = record_problem(record)
        key = (record["member"], record.get("dataset"), record["step"]) if record["kind"] == "eval" else None
        if problem is None and key in evals:
            problem = f"a second eval of {key[0]} on {key[1]} at step {key[2]} (line {evals[key]})"
        if problem is not None:
            raise MetricsError(f"{path} line {number}: {problem}")
        if key is not None:
            evals[key] = number
    return list(zip(lines.records, lines.numbers))


def interval(values: list[float], seeds: list[int] | None = None,
             bounds: tuple[float, float] | None = None) -> dict[str, Any]:
    """Mean and 95% t-interval over seeds (low = high = mean for one seed); `seeds`, when given, says whose each
    value is (paired differences match values by seed, never by position). `bounds`: the values the quantity can
    take (ACCURACY_BOUNDS for a share of questions); an interval end past one is set on it and the interval marked
    `clipped` (a t-interval of 0.010 over five seeds can reach below 0, which no accuracy can)."""
    n = len(values)
    mean = sum(values) / n
    out = {"mean": mean, "low": mean, "high": mean, "n": n, "values": values}
    if seeds is not None:
        if len(seeds) != n:
            raise ValueError(f"{n} values for {len(seeds)} seeds")
        out["seeds"] = list(seeds)
    if n >= 2:
        sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
        half = (_T95[n - 2] if n - 1 <= len(_T95) else 1.96) * sd / math.sqrt(n)
        out.update(low=mean - half, high=mean + half)
    if bounds is not None:
        clip(out, bounds)
    return out


def clip(value: dict[str, Any], bounds: tuple[float, float]) -> dict[str, Any]:
    """`value` (an interval) with its ends set within `bounds`, marked `clipped` when one moved; in place."""
    low, high = max(value["low"], bounds[0]), min(value["high"], bounds[1])
    if (low, high) != (value["low"], value["high"]):
        value.update(low=low, high=high, clipped=True)
    return value


def all_equal(values: list[float]) -> bool:
    """Every value the same up to rounding (0.015 - 0.010 and 0.010 - 0.005 are both 0.005 here)."""
    return all(math.isclose(v, values[0], rel_tol=1e-9, abs_tol=1e-12) for v in values)


def t_test_p(values: list[float]) -> float:
    """Two-sided p-value of Student's one-sample t-test of mean 0 over `values` (n >= 2; the paired differences of
    one cell): the test whose 95% interval is `interval`'s (p < 0.05 exactly when the interval excludes 0); exact
    for integer degrees of freedom (Abramowitz & Stegun 26.7.3-4). All values equal (all_equal) leave the t-test
    undefined: the two-sided sign test's 2 / 2^n then (1 when they are all 0), not the t-statistic's infinity."""
    n = len(values)
    if n < 2:
        raise ValueError(f"a t-test needs 2 values or more, got {n}")
    mean = sum(values) / n
    if all_equal(values):
        return 1.0 if math.isclose(mean, 0.0, abs_tol=1e-12) else min(1.0, 2.0 / 2**n)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return _t_two_sided(abs(mean) / (sd / math.sqrt(n)), n - 1)


def _t_two_sided(t: float, df: int) -> float:
    """P(|T| >= t) for Student's T with `df` degrees of freedom, t >= 0 (Abramowitz & Stegun 26.7.3-4)."""
    theta = math.atan(t / math.sqrt(df))
    cos2 = math.cos(theta) ** 2
    if df % 2:  # odd: 2/pi (theta + sin(theta) cos(theta) (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...))
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= cos2 * (2 * k) / (2 * k + 1)
            total += term
        inside = 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
    else:  # even: sin(theta) (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)
        term, total = 1.0, 1.0
        for k in range(1, df // 2):
            term *= cos2 * (2 * k - 1) / (2 * k)
            total += term
        inside = math.sin(theta) * total
    return min(1.0, max(0.0, 1.0 - inside))


def t_upper_p(t: float, df: int) -> float:
    """P(T >= t), one-sided, for Student's T with `df` degrees of freedom."""
    return _t_two_sided(t, df) / 2 if t >= 0 else 1.0 - _t_two_sided(-t, df) / 2


def margin_p(values: list[float], margin: float, side: str) -> float:
    """p-value that the mean of `values` (n >= 2; paired differences) lies within `margin` of 0: side "above": H0
    mean <= -margin against mean > -margin (one-sided t-test); "below": H0 mean >= margin against mean < margin;
    "both": the two one-sided tests together (TOST: the larger of the two p-values; rejecting at alpha is the
    (1 - 2 alpha) interval lying inside (-margin, margin)). All values equal: the one-sided sign test's 1 / 2^n for
    each side the values are on (1 for a side they are not)."""
    n = len(values)
    if n < 2:
        raise ValueError(f"a t-test needs 2 values or more, got {n}")
    if side not in ("above", "below", "both"):
        raise ValueError(f"side: 'above', 'below' or 'both', not {side!r}")
    mean = sum(values) / n
    if all_equal(values):
        low, high = (1.0 / 2**n if mean > -margin else 1.0), (1.0 / 2**n if mean < margin else 1.0)
    else:
        se = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) / math.sqrt(n)
        low, high = t_upper_p((mean + margin) / se, n - 1), t_upper_p((margin - mean) / se, n - 1)
    return {"above": low, "below": high, "both": max(low, high)}[side]


def holm(p_values: list[float], alpha: float = 0.05) -> list[bool]:
    """Holm's step-down correction: which of a family's hypotheses are rejected at family-wise error `alpha` (the
    k-th smallest p-value against alpha / (m - k + 1), stopping at the first that fails). Valid under any dependence
    between the tests."""
    return [p <= alpha for p in holm_adjusted(p_values)]


def holm_adjusted(p_values: list[float]) -> list[float]:
    """Holm's adjusted p-values: the k-th smallest of m becomes max over j <= k of min(1, (m - j + 1) p_(j)); a
    hypothesis is rejected at family-wise error alpha exactly when its adjusted p-value is at most alpha (holm)."""
    m = len(p_values)
    order = sorted(range(m), key=p_values.__getitem__)
    adjusted = [1.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def _curve_area(points: list[tuple[int, float]]) -> float:
    """Mean accuracy over the run: the trapezoid area under the eval curve divided by its span of steps."""
    if len(points) == 1:
        return points[0][1]
    area = sum((s1 - s0) * (a0 + a1) / 2 for (s0, a0), (s1, a1) in zip(points, points[1:]))
    return area / (points[-1][0] - points[0][0])


def read_run(source: pathlib.Path) -> tuple[dict, dict, dict, dict]:
    """({(member, dataset): [(step, accuracy)]}, {member: {stat: [values by step]}}, {dataset: {eval set sizes}},
    {member: {stat: {step: value}}} of the STEP_STATS) of a finished run, from its directory or a metrics file (its
    metrics.jsonl, or the .jsonl.gz a study keeps in records/); an attack success rate's set is its eval set's
    size. MetricsError naming the file (and the line) for one that cannot be read, or holds a record out of range
    (checked_records)."""
    evals: dict[tuple[str, str], list[tuple[int, float]]] = {}
    train: dict[str, dict[str, list[float]]] = {}
    sizes: dict[str, set[int]] = {}
    traces: dict[str, dict[str, dict[int, float]]] = {}
    for record, _ in checked_records(source / "metrics.jsonl" if source.is_dir() else source):
        if record["kind"] == "eval":
            evals.setdefault((record["member"], record["dataset"]), []).append((record["step"], record["accuracy"]))
            if isinstance(record.get("samples"), int):
                sizes.setdefault(record["dataset"], set()).add(record["samples"])
            for kind, rate in (record.get("attack_success_by") or {}).items():
                if isinstance(rate, (int, float)):
                    evals.setdefault((record["member"], record["dataset"] + ATTACK_SUFFIX + kind), []).append(
                        (record["step"], rate))
                    if isinstance(record.get("samples"), int):
                        sizes.setdefault(record["dataset"] + ATTACK_SUFFIX + kind, set()).add(record["samples"])
        elif record["kind"] == "train":
            stats = train.setdefault(record["member"], {})
            taken = {key: float(record[key]) for key in TRAIN_STATS if isinstance(record.get(key), (int, float))}
            peers = (record.get("sequences") or 0) - (record.get("own_sequences") or 0)  # null: not logged
            taken.update({key: float(record[source]) * record["sequences"] / peers for key, source in PEER_STATS.items()
                          if peers > 0 and isinstance(record.get(source), (int, float))})
            for key, value in taken.items():
                stats.setdefault(key, []).append(value)
            taken.update({key: float(record[key]) for key in CHECK_STATS  # NaN (no own rollouts), inf: none
                          if _number(record.get(key)) and -MAX_MAGNITUDE <= record[key] <= MAX_MAGNITUDE})
            if isinstance(record.get("step"), int):
                trace = traces.setdefault(record["member"], {})
                trace.setdefault(TRAIN_STEPS, {})[record["step"]] = 1.0
                for key in (*STEP_STATS, *CHECK_STATS):
                    if key in taken:
                        trace.setdefault(key, {})[record["step"]] = taken[key]
    return {k: sorted(v) for k, v in evals.items()}, train, sizes, traces


def aggregate(study: StudyConfig, groups: list[Group], quick: bool, command: str) -> dict:
    """Per group and member: eval curves (mean and 95% interval per eval step over seeds), final accuracy, the
    area under the curve (mean accuracy over the run), accuracy early in the run (mean over the eval points of its
    first half, step 0 excluded), and the training stats averaged over steps (then over seeds)."""
    out_groups = []
    for group in groups:
        finished = [run for run in group.runs if run.metrics_source is not None]  # its directory or its record
        config = group.config
        entry: dict[str, Any] = {
            "group": group.name, "member_set": group.member_set, "members": [m.name for m in config.members],
            "method": config.algorithm.method, "collaboration": config.collaboration,
            "g": config.algorithm.kl_threshold, "is_cap": config.algorithm.is_cap,
            "kl_estimator": config.algorithm.kl_estimator, "kl_reduction": config.algorithm.kl_reduction,
            "steps": config.train.steps, "seeds": [run.seed for run in finished],
            "runs": [str(run.run_dir) for run in finished], "by_member": {}, "baseline": group.baseline,
            "alone": group.alone, "also_alone": group.also_alone,
            "swarm_mode": config.swarm.mode, "latency": config.swarm.latency.model_dump(),
        }
        unfinished = [run.seed for run in group.runs if run.metrics_source is None]
        if unfinished:
            log.warning("group %s: seed(s) %s have no finished run and no kept records: left out of its numbers",
                        group.name, ", ".join(map(str, unfinished)))
        read = {}
        for run in finished:
            try:
                read[run.seed] = read_run(run.metrics_source)
            except MetricsError as exc:
                # from None: a one-line error for the user; the cause adds nothing to it
                raise StudyError(f"{exc} (group {group.name}, seed {run.seed}); restore the file, or delete it (and "
                                 "the run's directory) to run that seed again") from None
        per_run = {seed: (evals, train) for seed, (evals, train, _, _) in read.items()}
        entry["eval_questions"] = eval_questions([sizes for _, _, sizes, _ in read.values()])
        for member in entry["members"]:
            traces = {seed: trace.get(member, {}) for seed, (_, _, _, trace) in read.items()}
            result: dict[str, Any] = {"final": {}, "auc": {}, "early": {}, "curve": {}, "train": {},
                                      "train_curve": _step_curves(traces), "checks": _checks(traces)}
            datasets = sorted({d for evals, _ in per_run.values() for (m, d) in evals if m == member})
            for dataset in datasets:
                # a run without this curve (no eval of it) is left out, and every value keeps its own seed
                curves = {seed: evals[(member, dataset)] for seed, (evals, _) in per_run.items()
                          if evals.get((member, dataset))}
                seeds = list(curves)
                if len(seeds) < len(per_run):  # never a seed dropped without a word
                    log.warning("group %s: seed(s) %s have no eval of %s on %s: left out of its numbers", group.name,
                                ", ".join(str(s) for s in per_run if s not in curves), member, dataset)
                steps = sorted(set.intersection(*(set(s for s, _ in c) for c in curves.values())))
                by_step = [dict(c) for c in curves.values()]
                result["final"][dataset] = interval([c[-1][1] for c in curves.values()], seeds, ACCURACY_BOUNDS)
                result["auc"][dataset] = interval([_curve_area(c) for c in curves.values()], seeds, ACCURACY_BOUNDS)
                half = steps[-1] / 2 if steps else 0
                early_steps = [s for s in steps if 0 < s <= half] or steps[:1]
                if early_steps:
                    result["early"][dataset] = interval([sum(b[s] for s in early_steps) / len(early_steps)
                                                         for b in by_step], seeds, ACCURACY_BOUNDS)
                # each step's value per seed too: a figure of groups with other seeds draws the seeds they share
                result["curve"][dataset] = _band_curve(steps, [[b[s] for b in by_step] for s in steps], seeds)
            for key in (*TRAIN_STATS, *PEER_STATS):
                stats = {seed: sum(t[member][key]) / len(t[member][key]) for seed, (_, t) in per_run.items()
                         if member in t and t[member].get(key)}
                if stats:
                    result["train"][key] = interval(list(stats.values()), list(stats))
            entry["by_member"][member] = result
        out_groups.append(entry)
    add_paired_differences(out_groups)
    return {"study": study.study, "quick": quick, "command": command,
            "seeds": study.quick.seeds if quick else study.seeds, "groups": out_groups,
            "eval_questions": eval_questions([g["eval_questions"] for g in out_groups])}


def _step_curves(traces: dict[int, dict[str, dict[int, float]]]) -> dict[str, dict]:
    """Stat -> {steps, mean, low, high, n, seeds, values} of each STEP_STATS at every step a seed logged it, over
    the seeds that logged it there (`n` of them; an asynchronous run's peers arrive at different steps in different
    seeds); each a share: its band within [0, 1]."""
    out = {}
    for key in STEP_STATS:
        by_seed = {seed: trace[key] for seed, trace in traces.items() if trace.get(key)}
        steps = sorted(set().union(*by_seed.values()))
        if not steps:
            continue
        values = [[t[s] for t in by_seed.values() if s in t] for s in steps]
        out[key] = _band_curve(steps, values, list(by_seed), n=[len(v) for v in values])
    return out


def _band_curve(steps: list[int], values: list[list[float]], seeds: list[int], **extra) -> dict[str, Any]:
    """A curve of shares: at each step the mean and 95% interval (within [0, 1]) of that step's values, and the
    values themselves with the seeds they come from."""
    points = [interval(v, bounds=ACCURACY_BOUNDS) for v in values]
    return {"steps": steps, "mean": [p["mean"] for p in points], "low": [p["low"] for p in points],
            "high": [p["high"] for p in points], **extra, "seeds": seeds, "values": values}


def _checks(traces: dict[int, dict[str, dict[int, float]]]) -> dict[str, Any]:
    """Over every step of every seed: the range of own_ratio_mean and of the peers' sequences a step, the largest
    share of them the filter dropped and how many steps it dropped all of them (None where nothing was logged)."""
    def values(key: str) -> list[float]:
        return [v for trace in traces.values() for v in trace.get(key, {}).values()]

    own, peers, filtered = values("own_ratio_mean"), values("peer_sequences"), values("peer_filtered_frac")
    return {"steps": sum(len(t.get(TRAIN_STEPS, {})) for t in traces.values()),
            "own_ratio": [min(own), max(own)] if own else None,
            "peer_sequences": [min(peers), max(peers)] if peers else None,
            "peer_filtered_max": max(filtered) if filtered else None,
            "all_filtered_steps": sum(v >= 1.0 - 1e-9 for v in filtered)}


def eval_questions(sizes: list[dict]) -> dict[str, int | list[int]]:
    """Eval set -> how many questions it has (the `samples` of its eval records), from the runs' or groups' sizes
    ({dataset: size, a list of sizes or a set of them}); a list of the sizes seen where runs evaluated it on
    different numbers of questions (eval.max_samples set in some groups)."""
    seen: dict[str, set[int]] = {}
    for by_dataset in sizes:
        for dataset, size in by_dataset.items():
            seen.setdefault(dataset, set()).update(size if isinstance(size, (set, list)) else {size})
    return {d: next(iter(v)) if len(v) == 1 else sorted(v) for d, v in sorted(seen.items())}


METRICS = ("final", "auc", "early")


def paired_difference(a: dict, b: dict, bounds: tuple[float, float] | None = None) -> dict[str, Any] | None:
    """Interval of the per-seed differences a - b over the seeds both have (each interval's `seeds` says whose
    each value is): runs with the same seed share the warm start and the data order, so the paired difference is
    far less noisy than two separate intervals. bounds: as interval's (DIFFERENCE_BOUNDS for two accuracies)."""
    by_seed_b = dict(zip(b["seeds"], b["values"], strict=True))
    pairs = [(s, va - by_seed_b[s]) for s, va in zip(a["seeds"], a["values"], strict=True) if s in by_seed_b]
    return interval([d for _, d in pairs], [s for s, _ in pairs], bounds) if pairs else None


def add_paired_differences(groups: list[dict]) -> None:
    """Each collaborating group's members get `vs_alone`: per metric and dataset, the paired difference with the
    same member in its alone group (its `alone`, else its member set's first alone group)."""
    by_name = {g["group"]: g for g in groups}
    first = first_alone_groups([(g["group"], g["collaboration"], g["member_set"]) for g in groups])
    for g in groups:
        own_alone = by_name.get(paired_alone(g.get("alone") or None, g["member_set"], first))
        for key, base in (("vs_alone", own_alone), ("vs_baseline", by_name.get(g.get("baseline")))):
            for member, diffs in _member_differences(g, base).items():
                g["by_member"][member][key] = diffs
        if g.get("also_alone") and own_alone is not None:  # every alone group by name (its own too): vs_alones
            for base in (by_name.get(name) for name in g["also_alone"]):
                for member, diffs in _member_differences(g, base).items():
                    result = g["by_member"][member]
                    result.setdefault("vs_alones", {own_alone["group"]: result["vs_alone"]})[base["group"]] = diffs


def _member_differences(group: dict, base: dict | None) -> dict[str, dict]:
    """Member -> per metric and dataset, the paired difference of `group`'s member with the same member in `base`
    (none where base is missing, is the group itself, or lacks the member)."""
    if base is None or base is group:
        return {}
    out = {}
    for member, result in group["by_member"].items():
        ref = base["by_member"].get(member)
        if ref is not None:
            out[member] = {metric: {d: diff for d, v in result[metric].items() if d in ref[metric]
                                    if (diff := paired_difference(v, ref[metric][d], DIFFERENCE_BOUNDS)) is not None}
                           for metric in METRICS}
    return out
