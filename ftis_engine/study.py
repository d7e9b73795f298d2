"""`ftis-engine study`: a grid of train runs (method x collaboration x g x member set x seed), each its own process,
resumable, then aggregated over seeds into summary.json, report.md and figures.

A study config (configs/study/paper.yaml) names a `base` run config, `member_sets`, `seeds` and `groups`; a group
is a member set, a collaboration and dotted overrides, optionally a `grid` of overrides whose product makes one
group per combination. Layout of the output directory:

    runs/<group>/seed-<s>/   a run directory (train's own)     configs/<group>/seed-<s>.yaml   its config
    logs/<group>-seed-<s>.log its output                       summary.json, report.md, figures/*.png

A run is finished when its final_eval.json exists; finished runs are skipped, an interrupted one resumes from its
newest checkpoint (or starts again when it has none). A finished run whose config differs from the study's is an
error, never silently reused.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .config import ConfigError, RunConfig, apply_override, dump_config, format_validation_error, validate_config


class StudyError(ConfigError):
    """A bad study config or output directory; one line naming the field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GroupSettings(_Section):
    name: str = Field(..., min_length=1, description="Group name; with a grid, a template such as 'size-g{kl_threshold}' "
                      "filled with each combination's values (by the last part of each grid key).")
    members: str = Field(..., description="A key of member_sets.")
    collaboration: str = Field("vertical", description="vertical | horizontal | alone.")
    set: dict[str, Any] = Field(default_factory=dict, description="Dotted overrides of the base run config.")
    grid: dict[str, list[Any]] = Field(default_factory=dict, description="Dotted key -> values: one group per "
                                       "combination.")
    baseline: str | None = Field(None, description="The group each of these groups is paired with, seed by seed "
                                 "(a name template filled like `name`, e.g. '{method}-lat0'): `vs_baseline` in "
                                 "summary.json and a table in report.md. The member set's alone group is always "
                                 "paired (`vs_alone`).")

    @field_validator("grid")
    @classmethod
    def _non_empty(cls, grid: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for key, values in grid.items():
            if not values:
                raise ValueError(f"{key}: needs at least one value")
        return grid


class FigureSettings(_Section):
    name: str = Field(..., pattern=r"^[\w.-]+$", description="File name (figures/<name>.png).")
    title: str = Field("", description="Figure title.")
    groups: list[str] = Field(..., min_length=1, description="Groups drawn, one line each (mean, 95% band).")
    members: list[str] | None = Field(None, description="Members drawn, one column each (default: all of theirs).")
    datasets: list[str] | None = Field(None, description="Eval sets drawn, one row each (default: all).")


class QuickSettings(_Section):
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1, description="Seeds of a --quick study.")
    groups: list[str] | None = Field(None, description="Groups of a --quick study (default: all).")
    set: dict[str, Any] = Field(default_factory=dict, description="Dotted overrides of every --quick run.")


class StudyConfig(_Section):
    study: str = Field(..., pattern=r"^[\w.-]+$", description="The study's name.")
    base: dict[str, Any] = Field(..., description="The run config every run starts from (without members).")
    member_sets: dict[str, list[dict[str, Any]]] = Field(..., min_length=1,
                                                         description="Name -> the members list of a run config.")
    seeds: list[int] = Field(..., min_length=1, description="Seeds of every group.")
    groups: list[GroupSettings] = Field(..., min_length=1, description="Run groups.")
    figures: list[FigureSettings] = Field(default_factory=list, description="Figures (default: one per member set).")
    quick: QuickSettings = Field(default_factory=QuickSettings, description="What --quick runs instead.")
    jobs: int = Field(1, ge=1, description="Runs at once (default for --jobs).")

    @field_validator("seeds")
    @classmethod
    def _distinct(cls, seeds: list[int]) -> list[int]:
        if len(set(seeds)) != len(seeds):
            raise ValueError("seeds must be distinct")
        return seeds

    @model_validator(mode="after")
    def _references(self) -> StudyConfig:
        for i, group in enumerate(self.groups):
            if group.members not in self.member_sets:
                raise ValueError(f"groups.{i}.members: unknown member set {group.members!r}")
        return self


@dataclass
class Run:
    group: str
    seed: int
    config: RunConfig
    config_path: pathlib.Path
    log_path: pathlib.Path

    @property
    def run_dir(self) -> pathlib.Path:
        return pathlib.Path(self.config.output_dir) / self.config.run_name

    @property
    def finished(self) -> bool:
        return (self.run_dir / "final_eval.json").is_file()


@dataclass
class Group:
    name: str
    member_set: str
    config: RunConfig  # the first seed's: what the group's runs share
    runs: list[Run]
    baseline: str | None = None  # the group it is paired with (GroupSettings.baseline, filled)


# ----------------------------------------------------------------------------------------------- loading


def load_study(path: pathlib.Path) -> StudyConfig:
    if not path.is_file():
        raise StudyError(f"--config {path}: no such file")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        raise StudyError(f"--config {path}: is not valid YAML") from None
    if not isinstance(raw, dict):
        raise StudyError(f"--config {path}: expected a mapping of sections at the top level")
    try:
        return StudyConfig.model_validate(raw)
    except ValidationError as exc:
        message = format_validation_error(exc)
        if ": " in message and message.split(": ", 1)[1].startswith("groups."):  # a cross-reference check
            message = message.split(": ", 1)[1]
        raise StudyError(message) from None


def _label(key: str) -> str:
    return key.split(".")[-1]


def baseline_name(group: GroupSettings, combo: dict[str, Any]) -> str | None:
    if group.baseline is None:
        return None
    return group.baseline.format(**{_label(k): v for k, v in combo.items()})


def expand_groups(study: StudyConfig, quick: bool) -> list[tuple[int, str, GroupSettings, dict[str, Any]]]:
    """(index in groups, name, group, its overrides) for every group after grid expansion, in order; --quick keeps
    quick.groups. Names are unique."""
    out: list[tuple[int, str, GroupSettings, dict[str, Any]]] = []
    for i, group in enumerate(study.groups):
        keys = list(group.grid)
        for values in itertools.product(*(group.grid[k] for k in keys)):
            combo = dict(zip(keys, values))
            try:
                name = group.name.format(**{_label(k): v for k, v in combo.items()})
            except (KeyError, IndexError, ValueError) as exc:
                raise StudyError(f"groups.{i}.name: {group.name!r} cannot be filled from the grid ({exc})") from None
            try:
                baseline_name(group, combo)
            except (KeyError, IndexError, ValueError) as exc:
                raise StudyError(f"groups.{i}.baseline: {group.baseline!r} cannot be filled from the grid "
                                 f"({exc})") from None
            if keys and name == group.name:
                name = group.name + "-" + "-".join(f"{_label(k)}{v}" for k, v in combo.items())
            out.append((i, name, group, {**group.set, **combo}))
    names = [name for _, name, _, _ in out]
    for i, name, _, _ in out:
        if names.count(name) > 1:
            raise StudyError(f"groups.{i}.name: {name!r} names two groups")
        if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise StudyError(f"groups.{i}.name: {name!r} is not a plain file name (letters, digits, - _ .)")
    if quick and study.quick.groups is not None:
        unknown = [g for g in study.quick.groups if g not in names]
        if unknown:
            raise StudyError(f"quick.groups: unknown group {unknown[0]!r}")
        out = [entry for entry in out if entry[1] in study.quick.groups]
    return out


def plan(study: StudyConfig, output_dir: pathlib.Path, quick: bool) -> list[Group]:
    """Every run of the study with its validated config; nothing is written. Raises StudyError naming the field."""
    seeds = study.quick.seeds if quick else study.seeds
    groups = []
    for i, name, group, overrides in expand_groups(study, quick):
        runs = []
        for seed in seeds:
            raw = copy.deepcopy(study.base)
            if "members" in raw:
                raise StudyError("base.members: members come from member_sets")
            raw["members"] = copy.deepcopy(study.member_sets[group.members])
            raw["collaboration"] = group.collaboration
            where = f"groups.{i}"
            try:
                for key, value in overrides.items():
                    apply_override(raw, f"{key}={json.dumps(value)}")
                if quick:
                    where = "quick.set"
                    for key, value in study.quick.set.items():
                        apply_override(raw, f"{key}={json.dumps(value)}")
                where = f"groups.{i} ({name}){' with quick.set' if quick else ''}"
                raw.update(seed=seed, run_name=f"seed-{seed}", output_dir=str(output_dir / "runs" / name))
                config = validate_config(raw)
            except ConfigError as exc:
                raise StudyError(f"{where}: {str(exc).removeprefix('--set ')}") from None
            runs.append(Run(group=name, seed=seed, config=config,
                            config_path=output_dir / "configs" / name / f"seed-{seed}.yaml",
                            log_path=output_dir / "logs" / f"{name}-seed-{seed}.log"))
        combo = {k: overrides[k] for k in group.grid}
        groups.append(Group(name=name, member_set=group.members, config=runs[0].config, runs=runs,
                            baseline=baseline_name(group, combo)))
    names = {name for _, name, _, _ in expand_groups(study, quick=False)}
    for group in groups:
        if group.baseline is not None and group.baseline not in names:
            raise StudyError(f"groups ({group.name}).baseline: unknown group {group.baseline!r}")
    for f, figure in enumerate(study.figures):
        unknown = [g for g in figure.groups if g not in names]
        if unknown:
            raise StudyError(f"figures.{f}.groups: unknown group {unknown[0]!r}")
    return groups


def check_reuse(run: Run) -> None:
    """A run directory already there must hold this very run (same config but for how long it ran)."""
    from .session import config_differences

    saved = run.run_dir / "config.yaml"
    if not saved.is_file():
        return
    try:
        old = validate_config(yaml.safe_load(saved.read_text()))
    except (ConfigError, yaml.YAMLError):
        raise StudyError(f"--output-dir: {saved} is not a run config; choose another --output-dir") from None
    changed = [c for c in config_differences(old, run.config)]
    if changed:
        field, before, after = changed[0]
        raise StudyError(f"--output-dir: {run.run_dir} was run with {field}={before!r}, the study now says "
                         f"{after!r}; choose another --output-dir (or delete that run to redo it)")


# ----------------------------------------------------------------------------------------------- running


def launch(run: Run, env: dict[str, str]) -> int:
    """Run one train process to completion (resuming from its newest checkpoint when it has one); its output goes
    to the run's log. Returns its exit code."""
    from .checkpoint import latest_checkpoint

    run.config_path.parent.mkdir(parents=True, exist_ok=True)
    run.log_path.parent.mkdir(parents=True, exist_ok=True)
    run.config_path.write_text(dump_config(run.config))
    command = [sys.executable, "-m", "ftis_engine", "train", "--config", str(run.config_path)]
    if latest_checkpoint(run.run_dir) is not None:
        command.append("--resume")
    elif run.run_dir.exists():  # interrupted before its first checkpoint: start it again
        shutil.rmtree(run.run_dir)
    with run.log_path.open("a") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env).returncode


def run_study(study: StudyConfig, output_dir: pathlib.Path, *, quick: bool = False, jobs: int | None = None,
              command: str = "", progress: bool = True) -> dict:
    """Plan, run what is not finished (`jobs` at once), aggregate; returns the summary. Raises StudyError on a bad
    config and RuntimeError naming the failed runs' logs (after the others have finished)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    groups = plan(study, output_dir, quick)
    runs = [run for group in groups for run in group.runs]
    for run in runs:
        check_reuse(run)
    todo = [run for run in runs if not run.finished]
    env = dict(os.environ)
    failed: list[Run] = []
    started = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=not progress) as bar:
        task = bar.add_task(f"study {study.study}: runs", total=len(runs), completed=len(runs) - len(todo))
        with ThreadPoolExecutor(max_workers=jobs or study.jobs) as pool:
            futures = {pool.submit(launch, run, env): run for run in todo}
            for future in as_completed(futures):
                run, code = futures[future], future.result()
                if code != 0 or not run.finished:
                    failed.append(run)
                    bar.console.print(f"[red]failed[/red] {run.group} seed {run.seed} (exit {code}): {run.log_path}")
                bar.advance(task)
    summary = aggregate(study, groups, quick=quick, command=command)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    write_outputs(study, groups, summary, output_dir)
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(runs)} runs failed; see {failed[0].log_path}")
    return summary


# ----------------------------------------------------------------------------------------------- aggregation

# two-sided 95% quantiles of Student's t by degrees of freedom (1..30); 1.96 beyond
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]

TRAIN_STATS = ("reward_mean", "kl_mean", "filtered_frac", "is_weight_mean", "is_truncated_frac", "clip_frac",
               "entropy_mean", "completion_len_mean", "staleness_mean", "stale_dropped")
# Over the peers' rollouts only. A member's own rollouts come from its current policy (KL 0 up to rounding, never
# filtered), so the step's mean over all sequences, times sequences / peer sequences, is the mean over the peers':
# peer_kl_mean is the KL between the members, as the receiver's estimator measures it.
PEER_STATS = {"peer_kl_mean": "kl_mean", "peer_filtered_frac": "filtered_frac"}


def interval(values: list[float]) -> dict[str, Any]:
    """Mean and 95% t-interval over seeds (low = high = mean for one seed)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return {"mean": mean, "low": mean, "high": mean, "n": n, "values": values}
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = (_T95[n - 2] if n - 1 <= len(_T95) else 1.96) * sd / math.sqrt(n)
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": n, "values": values}


def _curve_area(points: list[tuple[int, float]]) -> float:
    """Mean accuracy over the run: the trapezoid area under the eval curve divided by its span of steps."""
    if len(points) == 1:
        return points[0][1]
    area = sum((s1 - s0) * (a0 + a1) / 2 for (s0, a0), (s1, a1) in zip(points, points[1:]))
    return area / (points[-1][0] - points[0][0])


def read_run(run_dir: pathlib.Path) -> tuple[dict, dict]:
    """({(member, dataset): [(step, accuracy)]}, {member: {stat: [values by step]}}) of a finished run."""
    from .metrics import read_metrics

    evals: dict[tuple[str, str], list[tuple[int, float]]] = {}
    train: dict[str, dict[str, list[float]]] = {}
    for record in read_metrics(run_dir / "metrics.jsonl"):
        if record["kind"] == "eval":
            evals.setdefault((record["member"], record["dataset"]), []).append((record["step"], record["accuracy"]))
        elif record["kind"] == "train":
            stats = train.setdefault(record["member"], {})
            for key in TRAIN_STATS:
                if isinstance(record.get(key), (int, float)):
                    stats.setdefault(key, []).append(float(record[key]))
            peers = record.get("sequences", 0) - record.get("own_sequences", 0)
            for key, source in PEER_STATS.items():
                if peers > 0 and isinstance(record.get(source), (int, float)):
                    stats.setdefault(key, []).append(float(record[source]) * record["sequences"] / peers)
    return {k: sorted(v) for k, v in evals.items()}, train


def aggregate(study: StudyConfig, groups: list[Group], quick: bool, command: str) -> dict:
    """Per group and member: eval curves (mean and 95% interval per eval step over seeds), final accuracy, the
    area under the curve (mean accuracy over the run), accuracy early in the run (mean over the eval points of its
    first half, step 0 excluded), and the training stats averaged over steps (then over seeds)."""
    out_groups = []
    for group in groups:
        finished = [run for run in group.runs if run.finished]
        config = group.config
        entry: dict[str, Any] = {
            "group": group.name, "member_set": group.member_set, "members": [m.name for m in config.members],
            "method": config.algorithm.method, "collaboration": config.collaboration,
            "g": config.algorithm.kl_threshold, "is_cap": config.algorithm.is_cap,
            "kl_estimator": config.algorithm.kl_estimator, "kl_reduction": config.algorithm.kl_reduction,
            "steps": config.train.steps, "seeds": [run.seed for run in finished],
            "runs": [str(run.run_dir) for run in finished], "by_member": {}, "baseline": group.baseline,
            "swarm_mode": config.swarm.mode, "latency": config.swarm.latency.model_dump(),
        }
        per_run = [read_run(run.run_dir) for run in finished]
        for member in entry["members"]:
            result: dict[str, Any] = {"final": {}, "auc": {}, "early": {}, "curve": {}, "train": {}}
            datasets = sorted({d for evals, _ in per_run for (m, d) in evals if m == member})
            for dataset in datasets:
                curves = [evals.get((member, dataset), []) for evals, _ in per_run]
                curves = [c for c in curves if c]
                if not curves:
                    continue
                steps = sorted(set.intersection(*(set(s for s, _ in c) for c in curves)))
                by_step = [dict(c) for c in curves]
                result["final"][dataset] = interval([c[-1][1] for c in curves])
                result["auc"][dataset] = interval([_curve_area(c) for c in curves])
                half = steps[-1] / 2 if steps else 0
                early_steps = [s for s in steps if 0 < s <= half] or steps[:1]
                result["early"][dataset] = interval([sum(b[s] for s in early_steps) / len(early_steps)
                                                     for b in by_step])
                points = [interval([b[s] for b in by_step]) for s in steps]
                result["curve"][dataset] = {"steps": steps, "mean": [p["mean"] for p in points],
                                            "low": [p["low"] for p in points], "high": [p["high"] for p in points]}
            for key in (*TRAIN_STATS, *PEER_STATS):
                values = [sum(t[member][key]) / len(t[member][key]) for _, t in per_run
                          if member in t and t[member].get(key)]
                if values:
                    result["train"][key] = interval(values)
            entry["by_member"][member] = result
        out_groups.append(entry)
    add_paired_differences(out_groups)
    return {"study": study.study, "quick": quick, "command": command,
            "seeds": study.quick.seeds if quick else study.seeds, "groups": out_groups}


METRICS = ("final", "auc", "early")


def paired_difference(a: dict, b: dict, seeds_a: list[int], seeds_b: list[int]) -> dict[str, Any] | None:
    """Interval of the per-seed differences a - b over the seeds both have: runs with the same seed share the
    warm start and the data order, so the paired difference is far less noisy than two separate intervals."""
    by_seed_b = dict(zip(seeds_b, b["values"]))
    diffs = [va - by_seed_b[s] for s, va in zip(seeds_a, a["values"]) if s in by_seed_b]
    return interval(diffs) if diffs else None


def add_paired_differences(groups: list[dict]) -> None:
    """Each collaborating group's members get `vs_alone`: per metric and dataset, the paired difference with the
    same member in its member set's alone group (the first one)."""
    alone, by_name = {}, {g["group"]: g for g in groups}
    for g in groups:
        if g["collaboration"] == "alone":
            alone.setdefault(g["member_set"], g)
    for g in groups:
        for key, base in (("vs_alone", alone.get(g["member_set"])), ("vs_baseline", by_name.get(g.get("baseline")))):
            if base is None or base is g:
                continue
            for member, result in g["by_member"].items():
                ref = base["by_member"].get(member)
                if ref is None:
                    continue
                result[key] = {
                    metric: {d: diff for d, v in result[metric].items() if d in ref[metric]
                             if (diff := paired_difference(v, ref[metric][d], g["seeds"], base["seeds"])) is not None}
                    for metric in METRICS}


# ----------------------------------------------------------------------------------------------- outputs


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
    lines += [f"Seeds {summary['seeds']}; every number is a mean over seeds with its 95% t-interval in brackets. "
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
        lines += _paired_table(groups, datasets, "vs_alone", f"Paired with `{member_set}`'s alone baseline: per seed, "
                               "this group's number minus the alone run's (same seed: same warm start, same data "
                               "order), mean and 95% t-interval over seeds.")
        lines += _paired_table(groups, datasets, "vs_baseline", "Paired with each group's baseline (Δ = group - "
                               "baseline, per seed, mean and 95% t-interval over seeds):")
    if figures:
        lines += ["## Figures", ""] + [f"![{p.stem}](figures/{p.name})" for p in figures] + [""]
    return "\n".join(lines)


def _paired_table(groups: list[dict], datasets: list[str], key: str, intro: str) -> list[str]:
    """A table of the paired differences `key` (vs_alone, vs_baseline) of every group and member that has them."""
    paired = [(g, member, r[key]) for g in groups for member, r in g["by_member"].items() if key in r]
    if not paired:
        return []
    head = ["group", "member"] + (["baseline"] if key == "vs_baseline" else [])
    head += [f"Δ final {d}" for d in datasets] + [f"Δ AUC {d}" for d in datasets] + [f"Δ early {d}" for d in datasets[:1]]
    lines = [intro, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g, member, vs in paired:
        row = [g["group"], member] + ([g["baseline"]] if key == "vs_baseline" else [])
        row += [_fmt(vs["final"].get(d)) for d in datasets] + [_fmt(vs["auc"].get(d)) for d in datasets]
        row += [_fmt(vs["early"].get(d)) for d in datasets[:1]]
        lines.append("| " + " | ".join(row) + " |")
    return lines + [""]


def draw_figures(study: StudyConfig, summary: dict, out_dir: pathlib.Path) -> list[pathlib.Path]:
    """One PNG per figure (default: one per member set): a column per member, a row per eval set, a line per
    group with its 95% band over seeds."""
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
        if not chosen:
            continue
        members = figure.members or list(dict.fromkeys(m for g in chosen for m in g["by_member"]))
        datasets = figure.datasets or sorted({d for g in chosen for m in g["by_member"].values() for d in m["curve"]})
        if not members or not datasets:
            continue
        fig, axes = plt.subplots(len(datasets), len(members), figsize=(5.2 * len(members), 3.6 * len(datasets)),
                                 squeeze=False)
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
                ax.set(title=f"{member}: {dataset}", xlabel="step", ylabel="greedy pass@1")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=7)
        fig.suptitle(f"{figure.title or figure.name} (mean over seeds, 95% band)")
        fig.tight_layout()
        path = out_dir / f"{figure.name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def write_outputs(study: StudyConfig, groups: list[Group], summary: dict, output_dir: pathlib.Path) -> None:
    figures = draw_figures(study, summary, output_dir / "figures")
    summary["figures"] = [f"figures/{p.name}" for p in figures]
    partial = output_dir / "summary.json.tmp"
    partial.write_text(json.dumps(summary, indent=1))
    os.replace(partial, output_dir / "summary.json")
    (output_dir / "report.md").write_text(report_markdown(summary, figures))
