"""A study's plan: every run (group x seed) with its validated config, and the check that a run directory already
there holds this very run. Nothing here writes."""

from __future__ import annotations

import copy
import itertools
import pathlib
import string
from dataclasses import dataclass, field
from typing import Any

import yaml

from ..config import ConfigError, RunConfig, apply_value, config_differences, validate_config
from ..config.load import MAX_CONFIG_BYTES
from ..core.safefile import read_bytes
from ..run.rundir import holds_run
from .config import GroupSettings, StudyConfig, StudyError


@dataclass
class Run:
    group: str
    seed: int
    config: RunConfig
    config_path: pathlib.Path
    log_path: pathlib.Path
    records: str = "gzip"  # StudyConfig.records: how a finished run's records are kept

    @property
    def run_dir(self) -> pathlib.Path:
        return pathlib.Path(self.config.output_dir) / self.config.run_name

    @property
    def finished(self) -> bool:
        return (self.run_dir / "final_eval.json").is_file()

    @property
    def record_path(self) -> pathlib.Path:
        """records/<group>/seed-<s>.metrics.jsonl.gz in the study's directory: the finished run's metrics.jsonl,
        compressed, beside summary.json (runs/ holds checkpoints and is not committed): what --aggregate-only
        recomputes the study's tables from. records: folders: <group>/seed-<s>/metrics.jsonl as it is, beside the
        run's resolved config.yaml and final_eval.json."""
        if self.records == "folders":
            return self.config_path.parents[2] / self.group / f"seed-{self.seed}" / "metrics.jsonl"
        return self.config_path.parents[2] / "records" / self.group / f"seed-{self.seed}.metrics.jsonl.gz"

    @property
    def kept(self) -> bool:
        """Its records are kept in the study's directory (committed, where the study commits them): the run is done
        even on a machine that never held its run directory."""
        return self.record_path.is_file()

    @property
    def metrics_source(self) -> pathlib.Path | None:
        """Where the finished run's records are read from: its run directory, else its kept record; None when it
        has neither (not finished)."""
        if self.finished:
            return self.run_dir / "metrics.jsonl"
        return self.record_path if self.record_path.is_file() else None

    @property
    def code_path(self) -> pathlib.Path:
        """configs/<group>/seed-<s>.code.jsonl: the code version of each launch of the run, a JSON line each."""
        return self.config_path.with_name(f"{self.config_path.stem}.code.jsonl")


@dataclass
class Group:
    name: str
    member_set: str
    config: RunConfig  # the first seed's: what the group's runs share
    runs: list[Run]
    baseline: str | None = None  # the group it is paired with (GroupSettings.baseline, filled)
    alone: str | None = None  # its alone baseline when not its member set's (GroupSettings.alone)
    also_alone: list[str] = field(default_factory=list)  # further alone groups it is paired with


def _label(key: str) -> str:
    return key.split(".")[-1]


def fill(template: str, combo: dict[str, Any]) -> str:
    """A group-name template filled with a grid combination's values: plain {field}s only (named by the last part
    of a grid key). A format spec, a conversion or an attribute ({g:99999999999}, {g!r}, {g.x}) is refused as a
    ValueError: it could build a string of any size."""
    values = {_label(k): v for k, v in combo.items()}
    for _, field, spec, conversion in string.Formatter().parse(template):
        if field is None:
            continue
        if spec or conversion or not field.isidentifier():
            raise ValueError(f"only plain {{field}}s may be filled, not {{{field}{'!' + conversion if conversion else ''}"
                             f"{':' + spec if spec else ''}}}")
        if field not in values:
            raise KeyError(field)
    return template.format(**values)


def baseline_name(group: GroupSettings, combo: dict[str, Any]) -> str | None:
    if group.baseline is None:
        return None
    return fill(group.baseline, combo)


def expand_groups(study: StudyConfig, quick: bool) -> list[tuple[int, str, GroupSettings, dict[str, Any]]]:
    """(index in groups, name, group, its overrides) for every group after grid expansion, in order; --quick keeps
    quick.groups. Names are unique."""
    out: list[tuple[int, str, GroupSettings, dict[str, Any]]] = []
    for i, group in enumerate(study.groups):
        keys = list(group.grid)
        for values in itertools.product(*(group.grid[k] for k in keys)):
            combo = dict(zip(keys, values))
            try:
                name = fill(group.name, combo)
            except (KeyError, IndexError, ValueError) as exc:
                # from None: a one-line error for the user; the cause adds nothing to it
                raise StudyError(f"groups.{i}.name: {group.name!r} cannot be filled from the grid ({exc})") from None
            try:
                baseline_name(group, combo)
            except (KeyError, IndexError, ValueError) as exc:
                # from None: a one-line error for the user; the cause adds nothing to it
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


def first_alone_groups(groups: list[tuple[str, str, str]]) -> dict[str, str]:
    """member set -> its first alone group's name, from (name, collaboration, member set) in the study's order: the
    alone group that a group without its own `alone` is paired with (paired_alone)."""
    first: dict[str, str] = {}
    for name, collaboration, member_set in groups:
        if collaboration == "alone":
            first.setdefault(member_set, name)
    return first


def paired_alone(alone: str | None, member_set: str, first: dict[str, str]) -> str | None:
    """The alone group a group is paired with: its own `alone`, else its member set's first alone group."""
    return alone if alone is not None else first.get(member_set)


def with_pairs(study: StudyConfig, names: list[str]) -> set[str]:
    """The groups named (--groups) and every group they are paired with, transitively: baseline, alone (a
    collaborating group without one: its member set's first alone group, as the aggregate pairs it), also_alone.
    Raises StudyError on a name the study does not have."""
    expanded = {name: (group, {k: overrides[k] for k in group.grid})
                for _, name, group, overrides in expand_groups(study, quick=False)}
    first_alone = first_alone_groups([(name, group.collaboration, group.members)
                                      for name, (group, _) in expanded.items()])
    unknown = [name for name in names if name not in expanded]
    if unknown:
        raise StudyError(f"--groups: unknown group {unknown[0]!r} (the study's groups: {', '.join(expanded)})")
    chosen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in chosen or name not in expanded:
            continue  # an unknown pair is named by plan()
        chosen.add(name)
        group, combo = expanded[name]
        alone = group.alone if group.collaboration == "alone" else paired_alone(group.alone, group.members, first_alone)
        todo += [n for n in (baseline_name(group, combo), alone, *group.also_alone) if n is not None]
    return chosen


def plan(study: StudyConfig, output_dir: pathlib.Path, quick: bool, only: list[str] | None = None) -> list[Group]:
    """Every run of the study with its validated config; nothing is written. Raises StudyError naming the field.
    --quick validates the whole study first: a quick run passes only when the full one would start. only
    (--groups): those groups and the groups they are paired with."""
    if quick or only:
        plan(study, output_dir, quick=False)
    chosen = with_pairs(study, only) if only else None
    groups = []
    for i, name, group, overrides in expand_groups(study, quick):
        if chosen is not None and name not in chosen:
            continue
        runs = []
        for seed in study.quick.seeds if quick else group.seeds or study.seeds:
            raw = copy.deepcopy(study.base)
            if "members" in raw:
                raise StudyError("base.members: members come from member_sets")
            raw["members"] = copy.deepcopy(study.member_sets[group.members])
            raw["collaboration"] = group.collaboration
            where = f"groups.{i}"
            try:
                for key, value in overrides.items():
                    apply_value(raw, key, copy.deepcopy(value))
                if quick:
                    where = "quick.set"
                    for key, value in study.quick.set.items():
                        apply_value(raw, key, copy.deepcopy(value))
                where = f"groups.{i} ({name}){' with quick.set' if quick else ''}"
                raw.update(seed=seed, run_name=f"seed-{seed}", output_dir=str(output_dir / "runs" / name))
                config = validate_config(raw)
            except ConfigError as exc:
                # from None: a one-line error for the user; the cause adds nothing to it
                raise StudyError(f"{where}: {str(exc).removeprefix('--set ')}") from None
            runs.append(Run(group=name, seed=seed, config=config,
                            config_path=output_dir / "configs" / name / f"seed-{seed}.yaml",
                            log_path=output_dir / "logs" / f"{name}-seed-{seed}.log", records=study.records))
        combo = {k: overrides[k] for k in group.grid}
        groups.append(Group(name=name, member_set=group.members, config=runs[0].config, runs=runs,
                            baseline=baseline_name(group, combo), alone=group.alone,
                            also_alone=list(group.also_alone)))
    expanded = {name: group for _, name, group, _ in expand_groups(study, quick=False)}
    planned = {g.name for g in groups}
    for group in groups:
        if group.baseline is not None and group.baseline not in expanded:
            raise StudyError(f"groups ({group.name}).baseline: unknown group {group.baseline!r}")
        references = [("alone", group.alone)] if group.alone is not None else []
        references += [("also_alone", name) for name in group.also_alone]
        for field_name, name in references:
            if name not in expanded:
                raise StudyError(f"groups ({group.name}).{field_name}: unknown group {name!r}")
            if expanded[name].collaboration != "alone":
                raise StudyError(f"groups ({group.name}).{field_name}: {name!r} is a {expanded[name].collaboration}"
                                 " group, not an alone one")
            if quick and name not in planned:
                raise StudyError(f"quick.groups: {group.name!r} is paired with {name!r}, which the quick "
                                 "variant leaves out")
    members = {name: [m["name"] for m in study.member_sets[group.members]] for name, group in expanded.items()}
    for f, figure in enumerate(study.figures):
        unknown = [g for g in figure.groups if g not in expanded]
        if unknown:
            raise StudyError(f"figures.{f}.groups: unknown group {unknown[0]!r}")
        drawn = {m for g in figure.groups for m in members[g]}
        if figure.kind == "distance" and len(figure.members or []) != 1:
            raise StudyError(f"figures.{f}.members: a distance figure draws one member (the receiver); name it")
        if figure.alone is not None and figure.alone not in expanded:
            raise StudyError(f"figures.{f}.alone: unknown group {figure.alone!r}")
        unknown = [m for m in figure.members or [] if m not in drawn]
        if unknown:
            raise StudyError(f"figures.{f}.members: {unknown[0]!r} is a member of none of its groups "
                             f"({', '.join(sorted(drawn))})")
    check_hypotheses(study, members)
    return groups


def check_hypotheses(study: StudyConfig, members: dict[str, list[str]]) -> None:
    """Every group and member a pre-registered test names is one of the study's (members: group -> its members)."""
    if study.preregistration is None:
        return
    for h, hypothesis in enumerate(study.preregistration.hypotheses):
        for t, test in enumerate(hypothesis.tests):
            where = f"preregistration.hypotheses.{h}.tests.{t}"
            for field_name, name in (("group", test.group), ("vs", test.vs)):
                if name is not None and name not in members:
                    raise StudyError(f"{where}.{field_name}: unknown group {name!r}")
                if name is not None and test.member not in members[name]:
                    raise StudyError(f"{where}.member: {test.member!r} is not a member of {name!r} "
                                     f"({', '.join(members[name])})")


def check_reuse(run: Run) -> None:
    """A run directory already there must hold this very run: the same config in everything but where it lives.
    One that holds nothing to continue (no complete checkpoint, not finished) starts over whatever it says."""
    saved = run.run_dir / "config.yaml"
    if not saved.is_file() or not holds_run(run.run_dir):
        return
    try:
        old = validate_config(yaml.safe_load(read_bytes(saved, MAX_CONFIG_BYTES, "a run's config.yaml").decode()))
    except (ConfigError, yaml.YAMLError, UnicodeDecodeError, OSError, RecursionError):
        # from None: a one-line error for the user; the cause adds nothing to it
        raise StudyError(f"--output-dir: {saved} is not a run config; choose another --output-dir") from None
    # where the study lives is no part of the run: a study directory moved or copied elsewhere is still itself
    changed = [c for c in config_differences(old, run.config) if c[0] != "output_dir"]
    if changed:
        field, before, after = changed[0]
        raise StudyError(f"--output-dir: {run.run_dir} was run with {field}={before!r}, the study now says "
                         f"{after!r}; choose another --output-dir (or delete that run to redo it)")


NOT_RECORDED = "not recorded"
MAX_CODE_RECORD_BYTES = 16 << 20  # a run's code record: a line per launch


def launched_under(run: Run) -> list[str]:
    """The commits the run was launched under, in order (a resumed run has several launches), from its code record;
    [NOT_RECORDED] when it has none (a run launched before studies recorded it) or the record cannot be read."""
    import json

    try:
        lines = read_bytes(run.code_path, MAX_CODE_RECORD_BYTES, "a code record").decode().splitlines()
        commits = [str(json.loads(line)["commit"]) for line in lines if line.strip()]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return [NOT_RECORDED]
    return list(dict.fromkeys(commits)) or [NOT_RECORDED]


def launch_times(run: Run) -> list[str]:
    """When each launch of the run started (UTC, ISO 8601), from its code record; [] when none was recorded (runs
    launched before studies recorded it)."""
    import json

    try:
        lines = read_bytes(run.code_path, MAX_CODE_RECORD_BYTES, "a code record").decode().splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
    except (OSError, UnicodeDecodeError, ValueError):
        return []
    return [str(r["started"]) for r in records if isinstance(r, dict) and r.get("started")]


def runs_under_other_code(runs: list[Run], commit: str, kept: bool = False) -> list[dict[str, Any]]:
    """The runs a study reuses or resumes (a run directory that holds one; with `kept`, --aggregate-only, also a
    run kept only in records/) that were launched, in whole or in part, under another commit than `commit` or under
    one not recorded: [{group, seed, commits}]. check_reuse compares configs only; code is not in a config."""
    other = []
    for run in runs:
        if not holds_run(run.run_dir) and not (kept and run.metrics_source is not None):
            continue
        commits = launched_under(run)
        if any(c != commit for c in commits):
            other.append({"group": run.group, "seed": run.seed, "commits": commits})
    return other
