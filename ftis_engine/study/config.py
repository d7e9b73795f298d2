"""A study's config: the schema of configs/study/*.yaml (one pydantic tree, every field described) and its loading."""

from __future__ import annotations

import pathlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

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


def load_study(path: pathlib.Path) -> StudyConfig:
    raw = read_yaml_mapping(path, StudyError)
    try:
        return StudyConfig.model_validate(raw)
    except ValidationError as exc:
        message = format_validation_error(exc)
        if ": " in message and message.split(": ", 1)[1].startswith("groups."):  # a cross-reference check
            message = message.split(": ", 1)[1]
        raise StudyError(message) from None
