"""A study's config: the schema of configs/study/*.yaml (one pydantic tree, every field described) and its loading."""

from __future__ import annotations

import pathlib
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from ..config import ConfigError, format_validation_error, read_yaml_mapping


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
    alone: str | None = Field(None, description="The alone group whose members this group's members are paired with "
                              "(`vs_alone`), by member name; default: the member set's first alone group. Lets groups "
                              "of several member sets share one baseline (configs/study/distance.yaml).")
    also_alone: list[str] = Field(default_factory=list, description="Further alone groups this group's members "
                                  "are paired with (`vs_alones` in summary.json, one distance table each), e.g. one "
                                  "trained with another budget.")
    seeds: list[int] | None = Field(None, min_length=1, description="This group's seeds (default: the study's "
                                    "`seeds`); --quick uses quick.seeds for every group.")

    @field_validator("seeds")
    @classmethod
    def _distinct_seeds(cls, seeds: list[int] | None) -> list[int] | None:
        if seeds is not None and len(set(seeds)) != len(seeds):
            raise ValueError("seeds must be distinct")
        return seeds

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
    kind: Literal["curves", "distance"] = Field(
        "curves", description="curves: eval accuracy over steps, a line per group (mean, 95% band). distance: each "
        "collaborating group's paired difference from its alone baseline (final and AUC, mean and 95% interval) "
        "against the peer KL measured in it, a line per method; one member (`members`, the receiver).")
    groups: list[str] = Field(..., min_length=1, description="Groups drawn, one line each (mean, 95% band).")
    alone: str | None = Field(None, description="distance: the alone group the differences are taken from (one of "
                              "the groups' `alone` or `also_alone`; default: each group's `alone`).")
    members: list[str] | None = Field(None, description="Members drawn, one column each (default: all of theirs).")
    datasets: list[str] | None = Field(None, description="Eval sets drawn, one row each (default: all).")


class QuickSettings(_Section):
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1, description="Seeds of a --quick study.")
    groups: list[str] | None = Field(None, description="Groups of a --quick study (default: all).")
    set: dict[str, Any] = Field(default_factory=dict, description="Dotted overrides of every --quick run.")


# A hypothesis test's claims: an effect of a sign; no effect (or none in one direction) within a margin; a count
EFFECT_CLAIMS = ("above", "below")
NO_EFFECT_CLAIMS = ("equal", "not-below", "not-above")
COUNT_CLAIMS = ("all-zero", "all-positive")


class HypothesisTest(_Section):
    group: str = Field(..., description="The group measured (its name after grid expansion).")
    member: str = Field(..., description="The member measured.")
    measure: str = Field(..., pattern=r"^(final|auc|early|train\.\w+)$", description="final | auc | early: the "
                         "eval value of `dataset` at the last step, over the run, over its first half (as in "
                         "summary.json); train.<stat>: a training stat's mean over steps (e.g. train.quarantined).")
    dataset: str | None = Field(None, description="The eval set of final, auc and early; an attack success rate "
                                "is '<set>-asr-<kind>' (e.g. arith-asr-inject).")
    vs: str | None = Field(None, description="The group this one is paired with, seed by seed: the quantity tested "
                           "is this group's value minus that group's.")
    vs_step: int | None = Field(None, ge=0, description="Instead of `vs`: the same runs' eval of `dataset` at this "
                                "step is subtracted (0: the gain over the start).")
    value: float = Field(0.0, description="With neither `vs` nor `vs_step`: the value the group's own is compared "
                         "with.")
    claim: Literal["above", "below", "equal", "not-below", "not-above", "all-zero", "all-positive"] = Field(
        ..., description="above | below: an effect of that sign (the quantity minus `value`, or the paired "
        "difference, is > 0 | < 0). equal | not-below | not-above: no effect, none downwards, none upwards, each "
        "within `margin` (an equivalence or non-inferiority test). all-zero | all-positive: a count's mean over "
        "steps on every seed (an observation, no test: outside Holm's family).")
    margin: float | None = Field(None, gt=0, description="equal | not-below | not-above: the equivalence margin, "
                                 "in the quantity's units, fixed before the runs. A registration without one cannot "
                                 "conclude 'no effect': it is refused, or, transcribed from an old registration, "
                                 "judged 'not detected' at best.")

    @model_validator(mode="after")
    def _consistent(self) -> HypothesisTest:
        on_eval = not self.measure.startswith("train.")
        if on_eval and self.dataset is None:
            raise ValueError(f"dataset: {self.measure} needs the eval set it is measured on")
        if not on_eval and self.dataset is not None:
            raise ValueError(f"dataset: a training stat ({self.measure}) has no eval set")
        if self.vs is not None and self.vs_step is not None:
            raise ValueError("vs_step: give vs (another group) or vs_step (the same runs' step), not both")
        if self.vs_step is not None and not on_eval:
            raise ValueError(f"vs_step: a training stat ({self.measure}) has no eval step")
        if self.margin is not None and self.claim not in NO_EFFECT_CLAIMS:
            raise ValueError(f"margin: only a claim of no effect ({', '.join(NO_EFFECT_CLAIMS)}) has a margin")
        if self.claim in COUNT_CLAIMS and (self.vs is not None or self.vs_step is not None or on_eval):
            raise ValueError(f"claim: {self.claim} is a count's own value (a train.<stat>), never a difference")
        return self


class Hypothesis(_Section):
    id: str = Field(..., pattern=r"^[\w.-]+$", description="Its name in the registration (H1, ...).")
    text: str = Field(..., min_length=1, description="The hypothesis as registered, word for word.")
    family: str | None = Field(None, description="The family Holm's correction runs over (default: one family, "
                               "all of the study's hypotheses together); set only where the registration names one.")
    tests: list[HypothesisTest] = Field(..., min_length=1, description="What it is judged on: one comparison each "
                                        "(with a p-value, in Holm's family) or one count (outside it).")
    untested: list[str] = Field(default_factory=list, description="Parts of `text` that no test judges, each with "
                                "why (a claim about every step where only means over steps were kept).")


class Preregistration(_Section):
    transcribed: str | None = Field(None, description="Set when these structured hypotheses were written after the "
                                    "registration they transcribe (its own text, such as a config's comments, stays "
                                    "the record): when, why, and where the registration is. A transcribed claim of "
                                    "no effect may lack a margin (the registration fixed none).")
    alpha: float = Field(0.05, gt=0, lt=1, description="Family-wise error rate: Holm's correction within each "
                         "family.")
    hypotheses: list[Hypothesis] = Field(..., min_length=1, description="The hypotheses, fixed before the runs.")

    @model_validator(mode="after")
    def _rules(self) -> Preregistration:
        ids = [h.id for h in self.hypotheses]
        for i, h in enumerate(self.hypotheses):
            if ids.count(h.id) > 1:
                raise ValueError(f"hypotheses.{i}.id: {h.id!r} names two hypotheses")
            for t, test in enumerate(h.tests):
                if test.claim in NO_EFFECT_CLAIMS and test.margin is None and self.transcribed is None:
                    raise ValueError(f"hypotheses.{i}.tests.{t}.margin: a claim of no effect ({test.claim}) needs an "
                                     "equivalence margin fixed before the runs; without one the data can only fail to "
                                     "detect an effect")
        return self


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
    records: Literal["gzip", "folders"] = Field(
        "gzip", description="How each finished run's records are kept in the study's directory: gzip: "
        "records/<group>/seed-<s>.metrics.jsonl.gz; folders: <group>/seed-<s>/ holding its metrics.jsonl (eval lines "
        "with each question's result), config.yaml and final_eval.json. A run whose records are kept is done: a "
        "study on another machine does not run it again.")
    commit_records: bool = Field(False, description="Commit each run's kept records to git as soon as it finishes "
                                 "(the study's directory must lie in a checkout): runs that take hours survive the "
                                 "machine.")
    preregistration: Preregistration | None = Field(
        None, description="The hypotheses fixed before the runs, judged by the study under Holm's correction "
        "(verdicts.md); in the config, or a YAML file beside it named by its path (relative to the config). A study "
        "that carries one refuses to start while its config or that file has changes git has not committed.")
    _registration_files: list[pathlib.Path] = PrivateAttr(default_factory=list)

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


def load_study(path: pathlib.Path) -> StudyConfig:
    """The study config at `path`; a `preregistration` that is a path is read from that file (relative to the
    config's folder). The files that hold a pre-registration are kept (registration_files)."""
    raw = read_yaml_mapping(path, StudyError)
    files = []
    if isinstance(raw.get("preregistration"), str):
        registered = path.parent / raw["preregistration"]
        try:
            raw["preregistration"] = read_yaml_mapping(registered, StudyError)
        except StudyError as exc:
            # from None: a one-line error for the user; the cause adds nothing to it
            raise StudyError(f"preregistration: {str(exc).removeprefix('--config ')}") from None
        files.append(registered)
    try:
        study = StudyConfig.model_validate(raw)
    except ValidationError as exc:
        message = format_validation_error(exc)
        head, _, rest = message.partition(": ")
        if rest.startswith("groups."):  # a cross-reference check
            message = rest
        elif head.startswith("preregistration") and re.match(r"^[\w.]+: ", rest):  # a check of a section's fields
            message = f"{head}.{rest}"
        # from None: a one-line error for the user; the cause adds nothing to it
        raise StudyError(message) from None
    if study.preregistration is not None:
        study._registration_files = [path, *files]
    return study


def registration_files(study: StudyConfig) -> list[pathlib.Path]:
    """The files that hold the study's pre-registration (its config, and the file its `preregistration` names); none
    for a study without one or one not loaded from a file."""
    return list(study._registration_files)
