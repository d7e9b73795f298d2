"""The study runner: a grid of runs, validated before anything runs, resumable, aggregated over seeds."""

from __future__ import annotations

import json
import math
import pathlib

import pytest
import yaml

from ftis_engine import study as study_module
from ftis_engine.study import StudyError, aggregate, check_reuse, interval, load_study, plan

from .helpers import command_here
from .test_cli import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAPER = ROOT / "configs" / "study" / "paper.yaml"

MINIMAL = {
    "study": "t",
    "seeds": [0, 1],
    "base": {"data": {"task": "tiny-add"}, "train": {"steps": 2}, "rollout": {"group_size": 4, "prompts_per_step": 2,
                                                                              "max_new_tokens": 2}},
    "member_sets": {"pair": [{"name": "a", "model": "builtin:tiny-s"}, {"name": "b", "model": "builtin:tiny-s"}]},
    "groups": [{"name": "pair-{method}", "members": "pair", "grid": {"algorithm.method": ["nois", "f-tis"]}}],
}


def write_study(tmp_path, raw) -> pathlib.Path:
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_the_paper_study_has_every_method_with_at_least_three_seeds():
    spec = load_study(PAPER)
    groups = plan(spec, pathlib.Path("/nonexistent"), quick=False)
    methods = {(g.config.collaboration, g.config.algorithm.method) for g in groups if g.member_set == "size"}
    assert {m for c, m in methods if c == "vertical"} >= {"nois", "vis", "tis", "f-nois", "f-vis", "f-tis", "gepo"}
    assert ("alone", "f-tis") in methods and ("horizontal", "f-tis") in methods
    assert {g.config.algorithm.kl_threshold for g in groups if g.name.startswith("size-f-tis")} == {5, 10, 50, 100}
    assert {g.member_set for g in groups} == {"size", "expertise", "params"}
    assert all(len(g.runs) >= 3 for g in groups)


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "study").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_study_plans_in_full_and_quick(path):
    spec = load_study(path)
    full = plan(spec, pathlib.Path("/nonexistent"), quick=False)
    quick = plan(spec, pathlib.Path("/nonexistent"), quick=True)
    assert full and quick and all(len(g.runs) >= 3 for g in full)
    assert {g.name for g in quick} <= {g.name for g in full}


def test_the_families_study_pairs_a_character_and_a_bpe_member_against_alone_and_nois():
    groups = {g.name: g for g in plan(load_study(ROOT / "configs" / "study" / "families.yaml"),
                                      pathlib.Path("/nonexistent"), quick=False)}
    assert set(groups) == {"families-alone", "families-nois", "families-tis", "families-f-tis"}
    models = [m.model for m in groups["families-f-tis"].config.members]
    assert models == ["builtin:tiny-m", "builtin:tiny-m-bpe"]
    assert groups["families-f-tis"].baseline == groups["families-tis"].baseline == "families-nois"


def test_grid_groups_are_named_from_their_values_and_carry_them():
    spec = study_module.StudyConfig.model_validate(MINIMAL)
    groups = plan(spec, pathlib.Path("/out"), quick=False)
    assert [g.name for g in groups] == ["pair-nois", "pair-f-tis"]
    assert [g.config.algorithm.method for g in groups] == ["nois", "f-tis"]
    run = groups[1].runs[1]
    assert (run.seed, run.config.seed, str(run.run_dir)) == (1, 1, "/out/runs/pair-f-tis/seed-1")


def test_groups_runs_the_named_groups_and_those_they_are_paired_with():
    """--groups: the adversary study's amendment plans its seven groups and, transitively, the groups they are
    paired with (honest, in-context, alone); every run of a kept group is as the full plan has it."""
    spec = load_study(ROOT / "configs" / "study" / "adversary.yaml")
    full = {g.name: g for g in plan(spec, pathlib.Path("/out"), quick=False)}
    part2 = ["inject-likelihood", "in-context-likelihood", "forge-filter-monitor", "long-length",
             "in-context-nois", "in-context-tis", "in-context-gepo"]
    groups = plan(spec, pathlib.Path("/out"), quick=False, only=part2)
    assert {g.name for g in groups} == set(part2) | {"honest", "in-context", "alone"}
    for group in groups:
        assert [r.config for r in group.runs] == [r.config for r in full[group.name].runs]
    # a group that names no alone group is paired with its member set's first (families.yaml: families-alone)
    families = load_study(ROOT / "configs" / "study" / "families.yaml")
    assert {g.name for g in plan(families, pathlib.Path("/out"), quick=False, only=["families-tis"])} == {
        "families-tis", "families-nois", "families-alone"}
    with pytest.raises(StudyError, match=r"^--groups: unknown group 'inject-likelyhood'"):
        plan(spec, pathlib.Path("/out"), quick=False, only=["inject-likelyhood"])


def test_the_study_command_refuses_an_unknown_group_in_one_line(tmp_path, capsys):
    result = command_here(capsys, "study", "--config", write_study(tmp_path, MINIMAL), "--groups", "pair-vis",
                          "--output-dir", tmp_path / "out")
    assert result.returncode == 2 and "--groups: unknown group 'pair-vis'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_quick_keeps_its_groups_and_seeds_and_applies_its_overrides():
    spec = study_module.StudyConfig.model_validate(
        {**MINIMAL, "quick": {"seeds": [7], "groups": ["pair-nois"], "set": {"train.steps": 1}}})
    groups = plan(spec, pathlib.Path("/out"), quick=True)
    assert [(g.name, [r.seed for r in g.runs], g.config.train.steps) for g in groups] == [("pair-nois", [7], 1)]


BAD = [
    ({"groups": [{"name": "x", "members": "trio"}]}, "groups.0.members: unknown member set 'trio'"),
    ({"seeds": [0, 0]}, "seeds: seeds must be distinct"),
    ({"colour": "red"}, "colour: unknown key"),
    ({"groups": [{"name": "x", "members": "pair", "set": {"algorithm.is_cap": -1}}]},
     r"groups.0 \(x\): algorithm.is_cap"),
    ({"groups": [{"name": "x", "members": "pair", "set": {"rollout.group_sized": 3}}]},
     r"groups.0 \(x\): rollout.group_sized: unknown key"),
    ({"groups": [{"name": "x", "members": "pair", "collaboration": "diagonal"}]}, r"groups.0 \(x\): collaboration"),
    ({"groups": [{"name": "x-{colour}", "members": "pair", "grid": {"algorithm.method": ["nois"]}}]},
     "groups.0.name: 'x-{colour}' cannot be filled"),
    ({"groups": [{"name": "x", "members": "pair"}, {"name": "x", "members": "pair"}]}, "groups.0.name: 'x' names two"),
    ({"groups": [{"name": "a/b", "members": "pair"}]}, "groups.0.name: 'a/b' is not a plain file name"),
    ({"quick": {"groups": ["nope"]}}, "quick.groups: unknown group 'nope'"),
    ({"quick": {"set": {"train.steps": 0}}}, r"groups.0 \(pair-nois\) with quick.set: train.steps"),
    ({"figures": [{"name": "f", "groups": ["nope"]}]}, "figures.0.groups: unknown group 'nope'"),
    ({"base": {"members": []}}, "base.members: members come from member_sets"),
    ({"groups": [{"name": "x", "members": "pair", "grid": {"algorithm.method": []}}]}, "groups.0.grid"),
    ({"figures": [{"name": "f", "groups": ["pair-nois"], "members": ["zed"]}]},
     "figures.0.members: 'zed' is a member of none of its groups"),
    ({"groups": [{"name": "x", "members": "pair", "alone": "nope"}]}, r"groups \(x\).alone: unknown group 'nope'"),
    ({"groups": [{"name": "x", "members": "pair", "alone": "y"}, {"name": "y", "members": "pair"}]},
     r"groups \(x\).alone: 'y' is a vertical group, not an alone one"),
    ({"groups": [{"name": "x", "members": "pair", "seeds": [1, 1]}]}, "groups.0.seeds: seeds must be distinct"),
    ({"groups": [{"name": "x", "members": "pair", "also_alone": ["x"]}]},
     r"groups \(x\).also_alone: 'x' is a vertical group, not an alone one"),
    ({"figures": [{"name": "f", "kind": "distance", "groups": ["pair-nois"], "members": ["a"], "alone": "zz"}]},
     "figures.0.alone: unknown group 'zz'"),
    ({"figures": [{"name": "f", "kind": "distance", "groups": ["pair-nois"]}]},
     "figures.0.members: a distance figure draws one member"),
    ({"groups": [{"name": "solo", "members": "pair", "collaboration": "alone"},
                 {"name": "x", "members": "pair", "alone": "solo"}], "quick": {"groups": ["x"]}},
     "quick.groups: 'x' is paired with 'solo', which the quick variant leaves out"),
    # --quick validates the whole study: a group it leaves out is checked all the same
    ({"groups": [{"name": "ok", "members": "pair"}, {"name": "bad", "members": "pair", "set": {"train.steps": -1}}],
      "quick": {"groups": ["ok"]}}, r"groups.1 \(bad\): train.steps"),
]


@pytest.mark.parametrize("change, message", BAD)
def test_a_bad_study_config_is_one_error_naming_the_field(tmp_path, change, message):
    path = write_study(tmp_path, {**MINIMAL, **change})
    with pytest.raises(StudyError, match=message):
        spec = load_study(path)
        plan(spec, tmp_path / "out", quick="quick" in change)


def test_the_cli_refuses_a_bad_study_config_with_exit_2_and_writes_nothing(tmp_path, capsys):
    path = write_study(tmp_path, {**MINIMAL, "groups": [{"name": "x", "members": "pair",
                                                        "set": {"algorithm.is_cap": 0}}]})
    result = command_here(capsys, "study", "--config", path, "--output-dir", tmp_path / "out")
    assert result.returncode == 2
    assert result.stderr.startswith("error: groups.0 (x): algorithm.is_cap") and len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_study_whose_runs_would_fail_on_a_bad_model_stops_before_launching_any(tmp_path, capsys):
    raw = {**MINIMAL, "member_sets": {"pair": [{"name": "a", "model": str(tmp_path / "no-such-model")},
                                               {"name": "b", "model": "builtin:tiny-s"}]}}
    result = command_here(capsys, "study", "--config", write_study(tmp_path, raw), "--output-dir", tmp_path / "out")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("error: groups (pair-nois): members.0.model: cannot load model")
    assert not (tmp_path / "out").exists()


def test_a_figure_naming_an_eval_set_of_none_of_its_groups_is_refused_before_any_run(tmp_path, capsys):
    raw = {**MINIMAL, "figures": [{"name": "f", "groups": ["pair-nois"], "datasets": ["gsm8k"]}]}
    result = command_here(capsys, "study", "--config", write_study(tmp_path, raw), "--output-dir", tmp_path / "out")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("error: figures.0.datasets: 'gsm8k' is an eval set of none of its groups (tiny-add)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["file", "under-file"])
def test_a_study_output_dir_that_cannot_be_written_is_one_line(tmp_path, capsys, where):
    (tmp_path / "a-file").write_text("x")
    out = tmp_path / "a-file" if where == "file" else tmp_path / "a-file" / "out"
    result = command_here(capsys, "study", "--config", write_study(tmp_path, MINIMAL), "--output-dir", out)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"error: --output-dir: cannot write to {out}")


def test_the_interval_is_the_mean_with_students_t_half_width():
    got = interval([0.5, 0.7, 0.6])
    half = 4.303 * 0.1 / math.sqrt(3)
    assert got["mean"] == pytest.approx(0.6) and got["n"] == 3
    assert (got["low"], got["high"]) == (pytest.approx(0.6 - half), pytest.approx(0.6 + half))
    assert interval([0.25]) == {"mean": 0.25, "low": 0.25, "high": 0.25, "n": 1, "values": [0.25]}
    assert interval([0.25, 0.5], seeds=[7, 3])["seeds"] == [7, 3]


def _fake_run(run, curve: list[tuple[int, float]], kl: list[float], samples: int | None = None) -> None:
    run.run_dir.mkdir(parents=True)
    lines = [{"step": s, "member": "a", "kind": "eval", "dataset": "tiny-add", "accuracy": acc,
              **({"samples": samples} if samples else {})} for s, acc in curve]
    lines += [{"step": i + 1, "member": "a", "kind": "train", "kl_mean": v, "filtered_frac": 0.5, "sequences": 8,
               "own_sequences": 4} for i, v in enumerate(kl)]
    (run.run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (run.run_dir / "final_eval.json").write_text("[]")


def test_aggregation_over_seeds_gives_final_area_early_curve_and_stats(tmp_path):
    spec = study_module.StudyConfig.model_validate(MINIMAL)
    group = plan(spec, tmp_path, quick=False)[0]
    _fake_run(group.runs[0], [(0, 0.0), (2, 0.4), (4, 0.6)], [1.0, 3.0])
    _fake_run(group.runs[1], [(0, 0.2), (2, 0.2), (4, 0.8)], [5.0, 7.0])
    summary = aggregate(spec, [group], quick=False, command="c")
    entry = summary["groups"][0]
    assert (entry["method"], entry["collaboration"], entry["g"], entry["seeds"]) == ("nois", "vertical", 50.0, [0, 1])
    result = entry["by_member"]["a"]
    assert result["final"]["tiny-add"]["values"] == [0.6, 0.8]
    # trapezoids: seed 0 (0.4 + 1.0) * 2 / 2 / 4 = 0.35; seed 1 (0.4 + 1.0) * 2 / 2 / 4 = 0.35
    assert result["auc"]["tiny-add"]["values"] == pytest.approx([0.35, 0.35])
    assert result["early"]["tiny-add"]["values"] == pytest.approx([0.4, 0.2])  # the eval at step 2 of 4
    assert result["curve"]["tiny-add"]["steps"] == [0, 2, 4]
    assert result["curve"]["tiny-add"]["mean"] == pytest.approx([0.1, 0.3, 0.7])
    assert result["train"]["kl_mean"]["values"] == [2.0, 6.0]
    # half of each step's sequences were the peer's: their KL is twice the step's mean, their filtered share too
    assert result["train"]["peer_kl_mean"]["values"] == [4.0, 12.0]
    assert result["train"]["peer_filtered_frac"]["values"] == [1.0, 1.0]
    assert "b" in entry["by_member"] and entry["by_member"]["b"]["final"] == {}


def _train_lines(path: pathlib.Path, rows: list[tuple[int, float, float]]) -> None:
    """Train records of member a at (step, filtered_frac over all 8 sequences, is_truncated_frac); 4 are the peer's."""
    lines = [{"step": 0, "member": "a", "kind": "eval", "dataset": "tiny-add", "accuracy": 0.5}]
    lines += [{"step": s, "member": "a", "kind": "train", "filtered_frac": f, "is_truncated_frac": t,
               "sequences": 8, "own_sequences": 4, "peer_sequences": 4, "own_ratio_mean": 1 + s / 100}
              for s, f, t in rows]
    lines[-1]["own_ratio_mean"] = float("nan")  # a step without own rollouts: no ratio (left out of the range)
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (path / "final_eval.json").write_text("[]")


def test_the_filters_drop_and_the_truncated_share_are_kept_step_by_step_over_seeds(tmp_path):
    """Issue 77's report: per step, the share of the peers' sequences the filter dropped (the step's filtered_frac
    over all sequences times 8 / 4 peers' sequences) and the truncated share, mean and band over the seeds that
    logged that step; a figure of them beside the eval curves, for collaborating groups only."""
    from ftis_engine.study import draw_figures

    spec = study_module.StudyConfig.model_validate({**MINIMAL, "figures": [{"name": "f", "groups": ["pair-f-tis"]}]})
    group = plan(spec, tmp_path, quick=False)[1]
    _train_lines(group.runs[0].run_dir, [(1, 0.0, 0.1), (2, 0.25, 0.3)])
    _train_lines(group.runs[1].run_dir, [(1, 0.125, 0.2), (2, 0.5, 0.5), (3, 0.5, 0.5)])  # step 3: seed 1 only
    with open(group.runs[0].run_dir / "metrics.jsonl", "a") as f:  # a ratio past any float: left out, no crash
        f.write(json.dumps({"step": 4, "member": "a", "kind": "train", "own_ratio_mean": 10 ** 400}) + "\n")
    summary = aggregate(spec, [group], quick=False, command="c")
    trace = summary["groups"][0]["by_member"]["a"]["train_curve"]
    assert trace["peer_filtered_frac"]["steps"] == [1, 2, 3] and trace["peer_filtered_frac"]["seeds"] == [0, 1]
    assert trace["peer_filtered_frac"]["values"] == [[0.0, 0.25], [0.5, 1.0], [1.0]]
    assert trace["peer_filtered_frac"]["n"] == [2, 2, 1]
    assert trace["peer_filtered_frac"]["mean"] == pytest.approx([0.125, 0.75, 1.0])
    assert trace["is_truncated_frac"]["mean"] == pytest.approx([0.15, 0.4, 0.5])
    low, high = trace["is_truncated_frac"]["low"][0], trace["is_truncated_frac"]["high"][0]
    assert low == 0.0 and high == pytest.approx(0.15 + 12.706 * math.sqrt(0.005) / math.sqrt(2))  # set within [0, 1]
    assert summary["groups"][0]["by_member"]["b"]["train_curve"] == {}
    # the checks: every step of every seed (the NaN ratios left out), all of a step's peers filtered twice
    checks = summary["groups"][0]["by_member"]["a"]["checks"]
    assert checks == {"steps": 6, "own_ratio": [1.01, 1.02], "peer_sequences": [4.0, 4.0], "peer_filtered_max": 1.0,
                      "all_filtered_steps": 2}
    table = study_module.report_markdown(summary, [])
    assert "| pair-f-tis | a | 6 | 1.0100, 1.0200 | 4, 4 | 1.000 | 2 |" in table
    assert "| pair-f-tis | b | 0 | – | – | – | – |" in table
    drawn = draw_figures(spec, summary, tmp_path / "figures")
    assert [p.name for p in drawn] == ["f.png", "f-train.png"] and all(p.stat().st_size > 0 for p in drawn)
    summary["groups"][0]["collaboration"] = "alone"  # no peers: nothing to draw
    assert [p.name for p in draw_figures(spec, summary, tmp_path / "alone")] == ["f.png"]


def test_a_run_without_an_eval_of_one_dataset_leaves_the_other_seeds_paired_by_seed(tmp_path):
    raw = {**MINIMAL, "seeds": [3, 4, 5],
           "groups": [{"name": "alone", "members": "pair", "collaboration": "alone"},
                      {"name": "pair", "members": "pair"}]}
    spec = study_module.StudyConfig.model_validate(raw)
    alone, pair = plan(spec, tmp_path, quick=False)
    for run, final in zip(alone.runs, (0.1, 0.2, 0.3)):
        _fake_run(run, [(0, 0.0), (2, final)], [1.0])
    for run, final in zip(pair.runs, (0.5, None, 0.9)):  # seed 4's run never evaluated tiny-add
        _fake_run(run, [(0, 0.0), (2, final)] if final is not None else [], [1.0])
    summary = aggregate(spec, [alone, pair], quick=False, command="c")
    final = summary["groups"][1]["by_member"]["a"]["final"]["tiny-add"]
    assert final["seeds"] == [3, 5] and final["values"] == [0.5, 0.9]
    vs = summary["groups"][1]["by_member"]["a"]["vs_alone"]["final"]["tiny-add"]
    assert vs["seeds"] == [3, 5] and vs["values"] == pytest.approx([0.5 - 0.1, 0.9 - 0.3])  # not 0.9 - 0.2


def test_a_finished_run_with_another_config_is_refused_not_reused(tmp_path):
    from ftis_engine.config import dump_config

    spec = study_module.StudyConfig.model_validate(MINIMAL)
    run = plan(spec, tmp_path, quick=False)[0].runs[0]
    run.run_dir.mkdir(parents=True)
    other = run.config.model_copy(deep=True)
    other.train.steps = 3
    (run.run_dir / "config.yaml").write_text(dump_config(other))
    check_reuse(run)  # a directory that holds nothing to continue starts over whatever its config says
    (run.run_dir / "final_eval.json").write_text("{}")  # now it holds a finished run
    (run.run_dir / "config.yaml").write_text(dump_config(run.config))
    check_reuse(run)  # the same config: fine
    (run.run_dir / "config.yaml").write_text(dump_config(other))
    with pytest.raises(StudyError, match="was run with train.steps=3, the study now says 2"):
        check_reuse(run)
    moved = run.config.model_copy(deep=True)
    moved.output_dir = "/where/the/study/was/before"  # a study directory moved or copied: still the same run
    (run.run_dir / "config.yaml").write_text(dump_config(moved))
    check_reuse(run)


@pytest.fixture(scope="module")
def quick_study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study") / "quick"
    result = cli("study", "--config", PAPER, "--quick", "--output-dir", out, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.slow
def test_the_quick_paper_study_writes_the_summary_the_report_and_figures(quick_study):
    summary = json.loads((quick_study / "summary.json").read_text())
    assert summary["quick"] and summary["seeds"] == [0]
    assert [g["group"] for g in summary["groups"]] == ["size-alone", "size-f-tis"]
    for group in summary["groups"]:
        assert group["seeds"] == [0] and group["members"] == ["tiny-s", "tiny-m"]
        assert {"method", "collaboration", "g"} <= set(group)
        for result in group["by_member"].values():
            assert set(result["final"]) == {"arith", "arith-ood"}
            assert 0.0 <= result["final"]["arith"]["mean"] <= 1.0
    assert summary["figures"] and all((quick_study / f).stat().st_size > 0 for f in summary["figures"])
    report = (quick_study / "report.md").read_text()
    assert "| size-f-tis | tiny-s | f-tis | vertical | 50 | 0 |" in report  # its seeds: 0


@pytest.mark.slow
def test_a_study_run_again_skips_its_finished_runs(quick_study, monkeypatch):
    def no_launch(self, run):
        raise AssertionError("a finished run was launched again")

    monkeypatch.setattr(study_module.runner.Launcher, "__call__", no_launch)
    summary = study_module.run_study(load_study(PAPER), quick_study, quick=True, progress=False)
    assert len(summary["groups"]) == 2


@pytest.mark.parametrize("failure", [KeyboardInterrupt(), RuntimeError("the launcher's own failure")])
def test_a_ctrl_c_or_a_failed_launch_while_runs_go_stops_every_run_and_is_raised_as_itself(tmp_path, monkeypatch,
                                                                                        failure):
    from types import SimpleNamespace

    from ftis_engine.study import runner

    stopped = []

    class Launcher:
        def __init__(self, env, code):
            pass

        def __call__(self, run):
            raise failure

        def stop(self):
            stopped.append(True)

    monkeypatch.setattr(runner, "Launcher", Launcher)
    with pytest.raises(type(failure)):
        runner._run(SimpleNamespace(study="s", jobs=1), [], ["run"], ["run"], tmp_path, quick=True, jobs=1,
                    command="", progress=False)
    assert stopped == [True]


@pytest.mark.slow
def test_plot_overlays_several_runs_in_one_figure(quick_study, tmp_path):
    runs = [quick_study / "runs" / g / "seed-0" for g in ("size-alone", "size-f-tis")]
    result = cli("plot", *runs, "--out", tmp_path / "overlay.png")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "overlay.png").stat().st_size > 0


def test_plot_names_a_run_directory_without_metrics(tmp_path, capsys):
    result = command_here(capsys, "plot", tmp_path, tmp_path)
    assert result.returncode == 2 and "no metrics.jsonl" in result.stderr


def test_paired_difference_matches_seeds_and_the_report_shows_it():
    from ftis_engine.study import add_paired_differences, paired_difference

    a = {"values": [0.5, 0.7, 0.4], "seeds": [0, 1, 2]}
    b = {"values": [0.3, 0.6], "seeds": [2, 0]}
    diff = paired_difference(a, b)  # seed 2 of b is 0.3, seed 0 is 0.6; seed 1 has no pair
    assert diff["values"] == pytest.approx([0.5 - 0.6, 0.4 - 0.3]) and diff["seeds"] == [0, 2]
    assert paired_difference({"values": [0.5], "seeds": [5]}, b) is None

    def group(name, collaboration, finals):
        return {"group": name, "member_set": "s", "collaboration": collaboration, "seeds": [0, 1],
                "by_member": {"m": {"final": {"d": {"values": finals, "seeds": [0, 1]}}, "auc": {}, "early": {}}}}

    groups = [group("s-alone", "alone", [0.2, 0.4]), group("s-f-tis", "vertical", [0.5, 0.5])]
    add_paired_differences(groups)
    assert "vs_alone" not in groups[0]["by_member"]["m"]
    vs = groups[1]["by_member"]["m"]["vs_alone"]["final"]["d"]
    assert vs["values"] == pytest.approx([0.3, 0.1]) and vs["mean"] == pytest.approx(0.2)


def test_a_group_is_paired_with_its_baseline_filled_from_the_grid():
    from ftis_engine.study import add_paired_differences, report_markdown

    raw = {**MINIMAL, "base": {**MINIMAL["base"], "swarm": {"mode": "async"}},
           "groups": [{"name": "{method}-lat{latency}", "members": "pair", "baseline": "{method}-lat0",
                       "grid": {"algorithm.method": ["nois", "tis"], "swarm.latency": [0, 2]}}]}
    groups = plan(study_module.StudyConfig.model_validate(raw), pathlib.Path("/out"), quick=False)
    assert [(g.name, g.baseline, g.config.swarm.latency.max) for g in groups] == [
        ("nois-lat0", "nois-lat0", 0), ("nois-lat2", "nois-lat0", 2), ("tis-lat0", "tis-lat0", 0),
        ("tis-lat2", "tis-lat0", 2)]
    bad = {**raw, "groups": [{**raw["groups"][0], "baseline": "{method}-lat9"}]}
    with pytest.raises(StudyError, match=r"baseline: unknown group 'nois-lat9'"):
        plan(study_module.StudyConfig.model_validate(bad), pathlib.Path("/out"), quick=False)

    def group(name, baseline, finals):
        return {"group": name, "member_set": "s", "collaboration": "vertical", "seeds": [0, 1], "baseline": baseline,
                "method": "tis", "g": 50.0, "swarm_mode": "async",
                "by_member": {"m": {"final": {"d": {"values": finals, "seeds": [0, 1], "mean": sum(finals) / 2,
                                                    "n": 2, "low": 0, "high": 1}}, "auc": {}, "early": {},
                                    "train": {"staleness_mean": {"mean": 2.0, "n": 2}}}}}

    summary = [group("tis-lat0", "tis-lat0", [0.5, 0.7]), group("tis-lat2", "tis-lat0", [0.2, 0.6])]
    add_paired_differences(summary)
    assert "vs_baseline" not in summary[0]["by_member"]["m"]
    vs = summary[1]["by_member"]["m"]["vs_baseline"]["final"]["d"]
    assert vs["values"] == pytest.approx([-0.3, -0.1])
    report = report_markdown({"study": "t", "quick": False, "seeds": [0, 1], "groups": summary}, [])
    assert "| tis-lat2 | m | tis-lat0 | -0.200" in report and "staleness" in report


def test_a_group_runs_its_own_seeds_and_quick_runs_quick_seeds():
    raw = {**MINIMAL, "groups": [{"name": "more", "members": "pair", "seeds": [0, 1, 2, 3]},
                                 {"name": "std", "members": "pair"}]}
    spec = study_module.StudyConfig.model_validate(raw)
    assert [[r.seed for r in g.runs] for g in plan(spec, pathlib.Path("/out"), quick=False)] == [[0, 1, 2, 3], [0, 1]]
    assert [[r.seed for r in g.runs] for g in plan(spec, pathlib.Path("/out"), quick=True)] == [[0], [0]]


def test_groups_of_several_member_sets_share_one_alone_group_and_make_the_distance_points(tmp_path):
    """The distance study's shape: one receiver alone, paired seed by seed with each dial point's groups; the
    points of the distance figure are each group's measured peer KL and its paired difference, by method."""
    from ftis_engine.study.report import distance_points, report_markdown

    raw = {**MINIMAL, "member_sets": {"solo": [{"name": "a", "model": "builtin:tiny-s"}],
                                      "near": [{"name": "a", "model": "builtin:tiny-s"},
                                               {"name": "n", "model": "builtin:tiny-s"}],
                                      "far": [{"name": "a", "model": "builtin:tiny-s"},
                                              {"name": "f", "model": "builtin:tiny-m"}]},
           "groups": [{"name": "alone", "members": "solo", "collaboration": "alone"},
                      {"name": "alone-half", "members": "solo", "collaboration": "alone",
                       "set": {"rollout.prompts_per_step": 1}},
                      {"name": "near-{method}", "members": "near", "alone": "alone", "also_alone": ["alone-half"],
                       "grid": {"algorithm.method": ["nois", "tis"]}},
                      {"name": "far-{method}", "members": "far", "alone": "alone", "also_alone": ["alone-half"],
                       "grid": {"algorithm.method": ["nois", "tis"]}}]}
    spec = study_module.StudyConfig.model_validate(raw)
    groups = {g.name: g for g in plan(spec, tmp_path, quick=False)}
    finals = {"alone": (0.5, 0.6), "alone-half": (0.4, 0.4), "near-nois": (0.5, 0.7), "near-tis": (0.6, 0.6), "far-nois": (0.1, 0.3),
              "far-tis": (0.5, 0.7)}
    kls = {"near-nois": 1.0, "near-tis": 2.0, "far-nois": 300.0, "far-tis": 200.0, "alone": 0.0, "alone-half": 0.0}
    for name, group in groups.items():
        for run, final in zip(group.runs, finals[name]):
            _fake_run(run, [(0, 0.2), (2, final)], [kls[name]])
    summary = aggregate(spec, list(groups.values()), quick=False, command="c")
    by = {g["group"]: g for g in summary["groups"]}
    vs = by["far-nois"]["by_member"]["a"]["vs_alone"]["final"]["tiny-add"]
    assert vs["values"] == pytest.approx([0.1 - 0.5, 0.3 - 0.6]) and by["far-nois"]["alone"] == "alone"
    assert "vs_alone" not in by["far-nois"]["by_member"]["f"]  # the peer was never trained alone
    points = distance_points(summary["groups"], "a", "final", "tiny-add")
    # a member's own rollouts are half of each step's: the peer KL is twice the step's mean; a member set's distance
    # is the mean over its groups (near: 2 and 4, far: 600 and 400)
    assert [(x, round(d["mean"], 6), where) for x, d, where in points["nois"]] == [
        (3.0, 0.05, "near"), (500.0, -0.35, "far")]
    assert [(x, where) for x, _, where in points["tis"]] == [(3.0, "near"), (500.0, "far")]
    # the further alone group: its own paired differences, its own distance points
    half = by["far-nois"]["by_member"]["a"]["vs_alones"]
    assert set(half) == {"alone", "alone-half"} and half["alone"] == by["far-nois"]["by_member"]["a"]["vs_alone"]
    assert half["alone-half"]["final"]["tiny-add"]["values"] == pytest.approx([0.1 - 0.4, 0.3 - 0.4])
    points = distance_points(summary["groups"], "a", "final", "tiny-add", alone="alone-half")
    assert [round(d["mean"], 6) for _, d, _ in points["nois"]] == [0.2, -0.2]
    report = report_markdown(summary, [])
    assert "Paired with the alone group `alone`" in report
    assert "| far-nois | a | 600 | -0.350 [" in report
    # the distance tables: a row per member set by increasing peer KL, a column per method
    table = report.split("`a` against `alone`, Δ final tiny-add, on seeds 0-1:")[1].split("\n\n")[1].splitlines()
    assert table[0] == "| member set | peer KL | nois | tis |"
    assert table[2].startswith("| near | 3 | 0.050 [") and table[3].startswith("| far | 500 | -0.350 [")


@pytest.mark.slow
def test_the_quick_distance_study_pairs_the_receiver_with_its_one_alone_group_and_draws_the_dial(tmp_path):
    out = tmp_path / "distance"
    result = cli("study", "--config", ROOT / "configs" / "study" / "distance.yaml", "--quick", "--output-dir", out,
                 timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [g["group"] for g in summary["groups"]] == ["alone", "alone-own-budget", "random-nois", "random-f-tis"]
    for group in summary["groups"][2:]:
        receiver = group["by_member"]["receiver"]
        assert group["alone"] == "alone" and receiver["train"]["peer_kl_mean"]["mean"] > 0
        assert set(receiver["vs_alone"]["final"]) == {"arith", "arith-ood"}
        assert set(receiver["vs_alones"]) == {"alone", "alone-own-budget"}
    for name in ("distance", "distance-own-budget"):
        assert f"figures/{name}.png" in summary["figures"] and (out / "figures" / f"{name}.png").stat().st_size > 0
    assert "| random-f-tis | receiver | " in (out / "report.md").read_text()


@pytest.mark.parametrize("template", ["size-{g:999999999999}", "size-{g!r}", "size-{g.real}", "size-{nope}"])
def test_a_malformed_group_name_template_is_one_line_never_a_huge_string(template):
    from ftis_engine.study.config import StudyConfig, StudyError
    from ftis_engine.study.plan import expand_groups

    study = StudyConfig.model_validate({
        "study": "t", "seeds": [0], "base": {}, "member_sets": {"s": [{"name": "a", "model": "builtin:tiny-s"}]},
        "groups": [{"name": template, "members": "s", "grid": {"algorithm.kl_threshold": [5, 10]}}]})
    with pytest.raises(StudyError, match=r"^groups.0.name: .* cannot be filled from the grid"):
        expand_groups(study, quick=False)


def test_a_study_run_whose_config_yaml_is_not_utf8_is_one_line(tmp_path):
    from ftis_engine.study.config import StudyError
    from ftis_engine.study.plan import Run, check_reuse

    from .helpers import short_config

    config = short_config(f"output_dir={tmp_path / 'runs'}", "run_name=seed-0")
    run = Run("g", 0, config, tmp_path / "c.yaml", tmp_path / "log")
    run.run_dir.mkdir(parents=True)
    (run.run_dir / "config.yaml").write_bytes(b"run_name: \xff\xfe\xfa\n")
    check_reuse(run)  # a run that holds nothing to continue (an interrupted start) starts over: no check
    (run.run_dir / "final_eval.json").write_text("[]")  # a finished run: its config must be this one's
    with pytest.raises(StudyError, match=r"^--output-dir: .*config.yaml is not a run config"):
        check_reuse(run)


@pytest.mark.slow
def test_one_ctrl_c_or_sigterm_stops_a_study_and_its_run_and_a_rerun_resumes_it(tmp_path):
    """The signal reaches the study process only (its runs are in sessions of their own): the run in flight is
    interrupted, no queued run starts, nothing is left running, exit 130 with the study's one line; the rerun
    finishes every run. Ctrl-C (SIGINT) first, then SIGTERM on the rerun that resumed it, then a rerun to the end."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    command = [sys.executable, "-m", "ftis_engine", "study", "--config", str(ROOT / "configs" / "study" / "paper.yaml"),
               "--quick", "--jobs", "1", "--output-dir", str(tmp_path / "study")]
    from .helpers import with_default_sigint

    logs = tmp_path / "study" / "logs"
    for signum in (signal.SIGINT, signal.SIGTERM):
        seen = {p: len(p.read_text(errors="replace")) for p in logs.glob("**/*.log")}  # what earlier starts wrote
        study = subprocess.Popen(with_default_sigint(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
        deadline = time.time() + 240
        while time.time() < deadline and not any("run directory:" in p.read_text(errors="replace")[seen.get(p, 0):]
                                                 for p in logs.glob("**/*.log")):
            time.sleep(0.2)
        time.sleep(3)  # inside the run's loading or its first steps
        runs = [c for c in psutil.Process(study.pid).children(recursive=True)]
        assert runs, f"{signum.name}: no run started"
        started = {p for p in logs.glob("**/*.log") if p.read_text().strip()}
        study.send_signal(signum)
        _, err = study.communicate(timeout=120)
        assert study.returncode == 130, (signum.name, err)
        assert err.strip().splitlines()[-1].startswith("error: interrupted; rerun the same command to continue")
        assert not [p for p in runs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]  # none left running
        assert {p for p in logs.glob("**/*.log") if p.read_text().strip()} == started  # no queued run started
        if signum == signal.SIGINT:
            assert len(started) == 1  # the first run: the study had started no other
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert os.path.isfile(tmp_path / "study" / "summary.json")


def test_a_study_run_with_groups_draws_only_the_figures_it_ran_every_group_of(tmp_path):
    """The adversary study's part 2 (run with --groups): of its figures, the two whose groups it ran all of are
    drawn; without the --groups mark, every figure with a group in the summary is (half-drawn ones too)."""
    from ftis_engine.study import draw_figures

    spec = load_study(ROOT / "configs" / "study" / "adversary.yaml")
    summary = json.loads((ROOT / "benchmarks/results/adversary_study/part2/summary.json").read_text())
    assert summary["only"]
    drawn = draw_figures(spec, summary, tmp_path / "only")
    assert sorted(p.stem for p in drawn) == ["each-defense", "in-context-methods"]
    del summary["only"]
    drawn = draw_figures(spec, summary, tmp_path / "all")
    assert sorted(p.stem for p in drawn) == ["each-defense", "honest-defenses", "in-context-methods", "inject-methods",
                                             "receiver-attacks"]


# ------------------------------------------------------------------------- what the report may claim, and how


def _interval(values, seeds, bounds=None):
    return interval(list(values), list(seeds), bounds)


def _summary_group(name, collaboration, finals, seeds, member_set="s", alone=None, method="f-tis", curve=None):
    """A summary group of one member `m` with one eval set `d`: its final values by seed (AUC and early alike)."""
    value = _interval(finals, seeds)
    result = {"final": {"d": value}, "auc": {"d": value}, "early": {"d": value}, "train": {},
              "curve": {"d": curve} if curve else {}}
    return {"group": name, "member_set": member_set, "collaboration": collaboration, "method": method, "g": 50.0,
            "seeds": list(seeds), "alone": alone, "baseline": None, "by_member": {"m": result}}


def _report(groups, **extra):
    from ftis_engine.study import add_paired_differences, report_markdown

    add_paired_differences(groups)
    return report_markdown({"study": "t", "quick": False, "seeds": [0, 1, 2], "groups": groups, **extra}, [])


def test_students_t_p_value_is_005_at_the_95_percent_quantile_and_a_sign_test_without_spread():
    from ftis_engine.study.aggregate import _T95, t_test_p

    for df in (1, 2, 3, 4, 5, 9, 29):
        n = df + 1
        # n values of mean t * s / sqrt(n) and sample sd s = 1: the t statistic is the quantile
        base = [(-1.0) ** k for k in range(n)] if n % 2 == 0 else [0.0] + [(-1.0) ** k for k in range(n - 1)]
        mean0 = sum(base) / n
        sd = math.sqrt(sum((v - mean0) ** 2 for v in base) / (n - 1))
        values = [(v - mean0) / sd + _T95[df - 1] / math.sqrt(n) for v in base]
        assert t_test_p(values) == pytest.approx(0.05, abs=2e-4), df
    assert t_test_p([0.1, -0.1, 0.0]) == pytest.approx(1.0)
    # every seed the same difference (0.015 - 0.010 on three seeds): no t-test, the sign test's 2 / 2^3
    assert t_test_p([0.015 - 0.010, 0.010 - 0.005, 0.005]) == 0.25
    assert t_test_p([0.0, 0.0, 0.0]) == 1.0


def test_holm_rejects_step_down_against_alpha_over_the_hypotheses_left():
    from ftis_engine.study.aggregate import holm

    # m = 4: 0.01 <= 0.05/4, 0.016 <= 0.05/3, 0.03 > 0.05/2: stop there, 0.04 is not rejected either
    assert holm([0.03, 0.01, 0.04, 0.016]) == [False, True, False, True]
    assert holm([0.2, 0.001]) == [False, True] and holm([]) == []


def test_an_accuracy_interval_is_clipped_at_0_and_1_and_marked_and_all_zero_seeds_are_a_count():
    from ftis_engine.study.report import _fmt
    from ftis_engine.study.aggregate import ACCURACY_BOUNDS

    asr = interval([0.0, 0.0, 0.0, 0.05, 0.0], seeds=[0, 1, 2, 3, 4], bounds=ACCURACY_BOUNDS)
    assert asr["low"] == 0.0 and asr["clipped"] and asr["high"] == pytest.approx(0.01 + 2.776 * 0.02236 / math.sqrt(5),
                                                                                 rel=1e-3)
    assert _fmt(asr, bounds=ACCURACY_BOUNDS) == "0.010 [0.000*, 0.038]"
    high = interval([1.0, 0.9, 1.0], bounds=ACCURACY_BOUNDS)
    assert high["high"] == 1.0 and high["clipped"] and _fmt(high, bounds=ACCURACY_BOUNDS).endswith("1.000*]")
    assert "clipped" not in interval([0.4, 0.5, 0.6], bounds=ACCURACY_BOUNDS)
    # a summary made before aggregate clipped: clipped when shown
    old = {"mean": 0.01, "low": -0.008, "high": 0.028, "n": 5, "values": [0.0, 0.0, 0.0, 0.05, 0.0]}
    assert _fmt(old, bounds=ACCURACY_BOUNDS) == "0.010 [0.000*, 0.028]"
    zeros = {"mean": 0.0, "low": 0.0, "high": 0.0, "n": 5, "values": [0.0] * 5}
    assert _fmt(zeros, bounds=ACCURACY_BOUNDS, questions=100) == "0 of 500"
    assert _fmt(zeros, bounds=ACCURACY_BOUNDS) == "0.000 on all 5 seeds"
    same = {"mean": 0.005, "low": 0.005, "high": 0.005, "n": 3, "values": [0.015 - 0.010, 0.010 - 0.005, 0.005]}
    assert _fmt(same) == "0.005 on all 3 seeds"


def test_absolute_numbers_of_groups_with_other_seeds_are_compared_on_the_seeds_they_share():
    """The published paper study: size-alone ran seeds 0-5, size-tis 0-2. Over its 6 seeds tiny-s alone ends at
    0.362, over seeds 0-2 at 0.450: size-tis's 0.427 is below alone on the seeds both have, though above 0.362."""
    from ftis_engine.study import report_markdown

    summary = json.loads((ROOT / "benchmarks/results/paper_study/summary.json").read_text())
    report = report_markdown(summary, [])
    size = report.split("## Member set `size`")[1].split("## Member set")[0]
    shared, six = size.split("The groups that ran seeds 0-5, on all of them")
    assert "On seeds 0-2, which every group of this set has" in shared
    assert "| size-alone | tiny-s | – | alone | – | 0-2 | 0.450 [" in shared
    assert "| size-tis | tiny-s | tis | vertical | – | 0-2 | 0.427 [" in shared
    assert "| 0-5 |" not in shared and "| 0-2 | 0.362 [" not in shared
    assert "| size-alone | tiny-s | – | alone | – | 0-5 | 0.362 [" in six
    assert "size-tis |" not in six.split("Paired")[0]


def test_the_report_counts_the_paired_intervals_that_exclude_0_and_marks_those_holding_under_holm():
    groups = [_summary_group("alone", "alone", [0.50, 0.60, 0.55], [0, 1, 2]),
              _summary_group("big", "vertical", [0.80, 0.91, 0.85], [0, 1, 2], method="nois"),  # +0.30 +- 0.005
              _summary_group("noise", "vertical", [0.60, 0.50, 0.58], [0, 1, 2], method="tis")]
    report = _report(groups)
    # 2 groups x (final, AUC, early) = 6 intervals; big's 3 exclude 0, noise's none
    assert "this report shows 6 paired intervals" in report and "and 3 of them exclude 0" in report
    assert "6 intervals in this table, 3 exclude 0" in report
    paired = report.split("Paired with")[1]
    row = next(line for line in paired.splitlines() if line.startswith("| big | m |"))
    # p of each of big's cells: t = 0.3033 / (0.0058 / sqrt 3), df 2: about 0.0004 < 0.05 / 6
    assert row.count("†") == 3 and row.endswith("| 0-2 |")
    assert "†" not in next(line for line in paired.splitlines() if line.startswith("| noise | m |"))


def test_the_report_states_each_eval_sets_size_and_that_intervals_are_over_seeds_on_it():
    groups = [_summary_group("alone", "alone", [0.5, 0.6, 0.55], [0, 1, 2])]
    report = _report(groups, eval_questions={"d": 200, "d-asr-inject": 200})
    assert "over seeds only, on fixed eval sets, the same questions for every seed and group: d 200 questions" in report
    assert "another draw of 200 questions alone would move an accuracy of 0.5 by about ±0.069" in report
    assert "their sizes are not recorded" in _report([_summary_group("alone", "alone", [0.5, 0.6], [0, 1])])


def test_aggregation_records_each_eval_sets_size_and_each_seeds_curve(tmp_path):
    spec = study_module.StudyConfig.model_validate(MINIMAL)
    group = plan(spec, tmp_path, quick=False)[0]
    for run, final in zip(group.runs, (0.5, 0.75)):
        _fake_run(run, [(0, 0.25), (2, final)], [1.0], samples=4)
    summary = aggregate(spec, [group], quick=False, command="c")
    assert summary["eval_questions"] == {"tiny-add": 4} and summary["groups"][0]["eval_questions"] == {"tiny-add": 4}
    curve = summary["groups"][0]["by_member"]["a"]["curve"]["tiny-add"]
    assert curve["seeds"] == [0, 1] and curve["values"] == [[0.25, 0.25], [0.5, 0.75]]


def test_a_figure_draws_groups_of_other_seeds_on_the_seeds_they_share():
    from ftis_engine.study.report import curve_lines

    def curve(values_by_seed):
        seeds = list(values_by_seed)
        values = [[values_by_seed[s][k] for s in seeds] for k in range(2)]
        means = [sum(v) / len(v) for v in values]
        return {"steps": [0, 10], "mean": means, "low": means, "high": means, "seeds": seeds, "values": values}

    six = _summary_group("six", "alone", [0.1] * 6, range(6), curve=curve({s: (0.1, 0.1 * s) for s in range(6)}))
    three = _summary_group("three", "vertical", [0.2] * 3, range(3), curve=curve({s: (0.2, 0.2) for s in range(3)}))
    lines, note = curve_lines([six, three], "m", "d")
    assert note == "on seeds 0-2, which every group here has"
    assert [seeds for _, _, seeds in lines] == [[0, 1, 2], [0, 1, 2]]
    assert lines[0][1]["mean"] == pytest.approx([0.1, 0.1])  # (0 + 0.1 + 0.2) / 3, not (0 + ... + 0.5) / 6
    # a summary that kept only the means: each line on its own seeds, said; bands within [0, 1]
    for g in (six, three):
        for key in ("seeds", "values"):
            del g["by_member"]["m"]["curve"]["d"][key]
    six["by_member"]["m"]["curve"]["d"]["low"] = [-0.1, -0.2]
    lines, note = curve_lines([six, three], "m", "d")
    assert note == "lines on different seeds: compare only lines with the same seeds"
    assert [seeds for _, _, seeds in lines] == [[0, 1, 2, 3, 4, 5], [0, 1, 2]] and lines[0][1]["low"] == [0.0, 0.0]


def test_the_distance_figure_names_the_kl_its_groups_measured():
    from ftis_engine.study.report import kl_measure

    groups = [{"collaboration": "vertical", "kl_estimator": "k3", "kl_reduction": "sum"},
              {"collaboration": "alone", "kl_estimator": "k1", "kl_reduction": "mean"}]
    assert kl_measure(groups) == "k3, summed over a completion"
    groups[1]["collaboration"] = "vertical"
    assert kl_measure(groups) == "k3, summed over a completion / k1, mean over a completion's tokens"


def test_the_code_version_is_this_checkouts_commit_and_unknown_outside_git(tmp_path):
    import re
    import subprocess

    from ftis_engine.study.runner import code_version

    code = code_version()
    inside = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if inside.returncode == 0:
        assert code["commit"] == inside.stdout.strip() and re.fullmatch(r"[0-9a-f]{40}", code["commit"])
        assert isinstance(code["dirty"], bool)
    assert code_version(tmp_path) == {"commit": "unknown", "dirty": None}


def test_a_run_reused_from_other_code_is_named_and_the_report_says_so(tmp_path):
    from ftis_engine.study.plan import NOT_RECORDED, runs_under_other_code
    from ftis_engine.study.report import _code_line
    from ftis_engine.study.runner import record_launch

    spec = study_module.StudyConfig.model_validate(MINIMAL)
    runs = plan(spec, tmp_path, quick=False)[0].runs
    for run in runs:
        _fake_run(run, [(0, 0.1)], [1.0])  # finished: reused as they are
    record_launch(runs[0], {"commit": "a" * 40, "dirty": False})
    assert runs_under_other_code(runs, "a" * 40) == [{"group": "pair-nois", "seed": 1, "commits": [NOT_RECORDED]}]
    record_launch(runs[1], {"commit": "a" * 40, "dirty": False})
    assert runs_under_other_code(runs, "a" * 40) == []
    record_launch(runs[0], {"commit": "b" * 40, "dirty": True})  # resumed under other code: both
    other = runs_under_other_code(runs, "b" * 40)
    assert [o["commits"] for o in other] == [["a" * 40, "b" * 40], ["a" * 40]]
    line = _code_line({"code": {"commit": "b" * 40, "dirty": True}, "other_code": other})
    assert line.startswith(f"Code: commit {'b' * 40} with uncommitted changes")
    assert "2 of its runs were made, in whole or in part, under other code" in line and "pair-nois seed 0" in line
    assert _code_line({}).startswith("Code version: not recorded")


def test_a_study_warns_naming_the_runs_it_reuses_from_other_code(tmp_path, monkeypatch, caplog):
    from ftis_engine.study import runner

    spec = study_module.StudyConfig.model_validate(MINIMAL)
    for group in plan(spec, tmp_path, quick=False):
        for run in group.runs:
            _fake_run(run, [(0, 0.1), (2, 0.2)], [1.0])
            run.config_path.parent.mkdir(parents=True, exist_ok=True)
            from ftis_engine.config import dump_config

            (run.run_dir / "config.yaml").write_text(dump_config(run.config))
    monkeypatch.setattr(runner, "code_version", lambda: {"commit": "c" * 40, "dirty": False})
    monkeypatch.setattr(runner, "check_runs", lambda *args: None)
    with caplog.at_level("WARNING", logger="ftis_engine"):
        summary = runner.run_study(spec, tmp_path, progress=False)
    assert "4 of the study's 4 runs to reuse or resume were made under other code" in caplog.text
    assert summary["code"] == {"commit": "c" * 40, "dirty": False} and len(summary["other_code"]) == 4
    assert "4 of its runs were made, in whole or in part, under other code" in (tmp_path / "report.md").read_text()


def test_a_report_is_written_again_from_its_summary_with_eval_sizes_from_the_config(tmp_path):
    from ftis_engine.study.report import rewrite_report

    spec = study_module.StudyConfig.model_validate(MINIMAL)
    groups = plan(spec, tmp_path, quick=False)
    for group in groups:
        for run in group.runs:
            _fake_run(run, [(0, 0.1), (2, 0.2)], [1.0])  # records without samples: a summary from before
    summary = aggregate(spec, groups, quick=False, command="c")
    del summary["eval_questions"]
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    before = (tmp_path / "summary.json").read_text()
    report = rewrite_report(spec, tmp_path, figures=False).read_text()
    from ftis_engine.data.tasks import load_task

    size = len(load_task(groups[0].config.data, 0).evals["tiny-add"])
    assert f"tiny-add {size} questions (sizes from the study's config" in report
    assert (tmp_path / "summary.json").read_text() == before  # the summary is left as it is


# ------------------------------------------------------------------------- pre-registered hypotheses and their verdicts


def test_holm_adjusted_p_values_match_a_hand_computed_oracle():
    from ftis_engine.study.aggregate import holm, holm_adjusted

    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04 -> running max 0.02, 0.03, 0.06, 0.06
    assert holm_adjusted([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm_adjusted([0.6, 0.3]) == pytest.approx([0.6, 0.6])  # 0.3 * 2 = 0.6, then max(0.6, 0.6 * 1)
    assert holm_adjusted([0.9, 0.8, 0.7]) == [1.0, 1.0, 1.0]  # capped at 1
    assert holm([0.01, 0.04, 0.03, 0.005], alpha=0.05) == [True, False, False, True]


def test_the_equivalence_test_against_a_margin_matches_students_t_with_two_degrees_of_freedom():
    from ftis_engine.study.aggregate import margin_p

    # mean 0, sd 0.01 over 3 values: se 0.01 / sqrt(3); against a margin of 0.05, t = 0.05 / se = sqrt(75) on each
    # side, and for 2 degrees of freedom P(T > t) = (1 - t / sqrt(t^2 + 2)) / 2 = (1 - sqrt(75 / 77)) / 2
    oracle = (1 - math.sqrt(75 / 77)) / 2
    values = [0.01, -0.01, 0.0]
    assert margin_p(values, 0.05, "both") == pytest.approx(oracle, rel=1e-9)
    assert margin_p(values, 0.05, "above") == pytest.approx(oracle, rel=1e-9)
    # shifted by +0.04: below the upper margin by 0.01 (t = sqrt(3)), above the lower one by 0.09 (t = sqrt(243))
    shifted = [v + 0.04 for v in values]
    assert margin_p(shifted, 0.05, "below") == pytest.approx((1 - math.sqrt(3 / 5)) / 2, rel=1e-9)
    assert margin_p(shifted, 0.05, "above") == pytest.approx((1 - math.sqrt(243 / 245)) / 2, rel=1e-9)
    assert margin_p(shifted, 0.05, "both") == margin_p(shifted, 0.05, "below")
    assert margin_p([0.0] * 5, 0.05, "both") == 1 / 32  # no spread: the one-sided sign test on each side


def _synthetic_summary():
    """Groups of one member `m` with eval set `d` and a count `quarantined`, over seeds 0-4."""
    def group(name, finals, quarantined=(0.0,) * 5):
        return {"group": name, "seeds": [0, 1, 2, 3, 4], "by_member": {"m": {
            "final": {"d": interval(list(finals), [0, 1, 2, 3, 4])}, "auc": {}, "early": {}, "curve": {},
            "train": {"quarantined": interval(list(quarantined), [0, 1, 2, 3, 4])}}}}

    return {"groups": [group("base", [0.50, 0.60, 0.55, 0.45, 0.52]),
                       group("big", [0.80, 0.91, 0.85, 0.74, 0.83], quarantined=(1.0, 2.0, 0.5, 1.0, 3.0)),  # +0.3
                       group("worse", [0.20, 0.31, 0.25, 0.14, 0.23]),  # -0.3
                       group("noise", [0.60, 0.50, 0.65, 0.40, 0.52]),
                       group("twin", [0.501, 0.598, 0.55, 0.451, 0.52])]}  # base within 0.002


def _preregistration(hypotheses, transcribed=None):
    from ftis_engine.study.config import Preregistration

    return Preregistration.model_validate({"transcribed": transcribed, "hypotheses": hypotheses})


def _test(group, claim, vs="base", **extra):
    return {"group": group, "vs": vs, "member": "m", "measure": "final", "dataset": "d", "claim": claim, **extra}


def test_a_small_synthetic_study_gets_its_verdict_table_under_holm():
    from ftis_engine.study.aggregate import holm_adjusted, margin_p, t_test_p
    from ftis_engine.study.report import verdicts_markdown
    from ftis_engine.study.verdicts import judge

    prereg = _preregistration([
        {"id": "H1", "text": "big beats base", "tests": [_test("big", "above")]},
        {"id": "H2", "text": "worse beats base", "tests": [_test("worse", "above")]},
        {"id": "H3", "text": "noise beats base", "tests": [_test("noise", "above")]},
        {"id": "H4", "text": "twin is base within 0.05", "tests": [_test("twin", "equal", margin=0.05)]},
        {"id": "H5", "text": "absent beats base", "tests": [_test("absent", "above")]},
        {"id": "H6", "text": "base never quarantines; big does", "tests": [
            {"group": "base", "member": "m", "measure": "train.quarantined", "claim": "all-zero"},
            {"group": "big", "member": "m", "measure": "train.quarantined", "claim": "all-positive"}]},
    ])
    verdicts = judge(prereg, [_synthetic_summary()])
    by_id = {h["id"]: h for h in verdicts["hypotheses"]}
    # one family of the five tests with a p-value (the counts are outside it; the absent group's counts with p = 1)
    assert verdicts["families"] == {"all": {"tests": 5, "without_data": 1}}
    diffs = {"big": [0.30, 0.31, 0.30, 0.29, 0.31], "worse": [-0.30, -0.29, -0.30, -0.31, -0.29],
             "noise": [0.10, -0.10, 0.10, -0.05, 0.0], "twin": [0.001, -0.002, 0.0, 0.001, 0.0]}
    raw = [t_test_p(diffs["big"]), t_test_p(diffs["worse"]), t_test_p(diffs["noise"]),
           margin_p(diffs["twin"], 0.05, "both"), 1.0]
    expected = holm_adjusted(raw)
    got = [by_id[h]["tests"][0]["p_holm"] for h in ("H1", "H2", "H3", "H4", "H5")]
    assert got == pytest.approx(expected)
    assert [by_id[h]["verdict"] for h in ("H1", "H2", "H3", "H4", "H5", "H6")] == [
        "holds", "contradicted (1 test: 1 contradicted)", "not detected", "holds", "no data", "holds"]
    assert by_id["H1"]["tests"][0]["estimate"]["mean"] == pytest.approx(0.302)
    table = verdicts_markdown("t", verdicts, command="c", sources=["summary.json"])
    assert "| [H1](#h1) | holds |" in table and "| [H5](#h5) | no data |" in table
    assert "| big - base: m, final d | > 0 | 0.302 [" in table
    assert "| base: m, quarantined | 0 on every seed (count) |" in table


def test_no_effect_is_refused_without_a_margin_and_a_transcribed_one_reads_not_detected(tmp_path):
    from pydantic import ValidationError

    from ftis_engine.study.verdicts import judge

    hypothesis = {"id": "H1", "text": "twin costs nothing", "tests": [_test("twin", "equal")]}
    with pytest.raises(ValidationError, match=r"hypotheses.0.tests.0.margin: a claim of no effect \(equal\) needs an "
                                              r"equivalence margin"):
        _preregistration([hypothesis])
    path = write_study(tmp_path, {**MINIMAL, "preregistration": {"hypotheses": [
        {**hypothesis, "tests": [{**_test("pair-f-tis", "not-below", vs="pair-nois"), "member": "a"}]}]}})
    with pytest.raises(StudyError, match=r"^preregistration.hypotheses.0.tests.0.margin: a claim of no effect"):
        load_study(path)
    # transcribed from an old registration that fixed no margin: accepted, but "no effect" is never concluded, not
    # even where every seed's difference is within 0.002 (twin is base seed by seed, nearly)
    old = judge(_preregistration([hypothesis], transcribed="after the runs"), [_synthetic_summary()])
    assert old["hypotheses"][0]["verdict"] == "not detected"
    # the same claim against a margin fixed before the runs can hold
    fixed = judge(_preregistration([{**hypothesis, "tests": [_test("twin", "equal", margin=0.05)]}]),
                  [_synthetic_summary()])
    assert fixed["hypotheses"][0]["verdict"] == "holds"
    # without a margin, a significant effect in the direction it excludes contradicts it; one it allows satisfies it
    allowed = judge(_preregistration([{**hypothesis, "tests": [_test("big", "not-below")]},
                                      {**hypothesis, "id": "H2", "tests": [_test("worse", "not-below")]}],
                                     transcribed="after the runs"), [_synthetic_summary()])
    assert [h["verdict"] for h in allowed["hypotheses"]] == ["holds", "contradicted (1 test: 1 contradicted)"]


def test_a_hypothesis_naming_an_unknown_group_or_member_is_refused_before_any_run(tmp_path):
    bad = {"id": "H1", "text": "x", "tests": [{**_test("pair-f-tis", "above", vs="pair-vis"), "member": "a"}]}
    spec = study_module.StudyConfig.model_validate({**MINIMAL, "preregistration": {"hypotheses": [bad]}})
    with pytest.raises(StudyError, match=r"^preregistration.hypotheses.0.tests.0.vs: unknown group 'pair-vis'"):
        plan(spec, tmp_path, quick=False)
    bad["tests"][0].update(vs="pair-nois", member="zed")
    spec = study_module.StudyConfig.model_validate({**MINIMAL, "preregistration": {"hypotheses": [bad]}})
    with pytest.raises(StudyError, match=r"^preregistration.hypotheses.0.tests.0.member: 'zed' is not a member"):
        plan(spec, tmp_path, quick=False)


TRANSCRIBED = {"adversary": ["benchmarks/results/adversary_study", "benchmarks/results/adversary_study/part2",
                             "benchmarks/results/adversary_study/part3"],
               "real-models": ["benchmarks/results/real_models"]}


@pytest.mark.parametrize("name", sorted(TRANSCRIBED))
def test_a_transcribed_hypothesis_keeps_its_registrations_words(name):
    """Every hypothesis of a transcribed pre-registration quotes the registration (the config's comments) word for
    word, and the config is what names the transcription."""
    from ftis_engine.study.config import registration_files

    path = ROOT / "configs" / "study" / f"{name}.yaml"
    spec = load_study(path)
    assert spec.preregistration.transcribed and registration_files(spec)[0] == path
    comments = " ".join(line.split("#", 1)[1].strip() for line in path.read_text().splitlines() if "#" in line)
    comments = " ".join(comments.split())
    for hypothesis in spec.preregistration.hypotheses:
        words = " ".join(hypothesis.text.split())
        assert f"{hypothesis.id} {words}" in comments, hypothesis.id


def test_verdicts_of_a_folder_with_no_summary_is_one_line_and_exit_2(tmp_path, capsys):
    """`python -m ftis_engine.study.verdicts` on a study still running (no summary.json yet) printed a traceback."""
    from ftis_engine.study import verdicts

    with pytest.raises(SystemExit) as done:
        verdicts.main(["--config", "configs/study/real-peft.yaml", "--dir", str(tmp_path)])
    (line,) = capsys.readouterr().err.splitlines()
    assert done.value.code == 2 and line.startswith(f"error: --dir {tmp_path}: no readable summary.json"), line
    assert not (tmp_path / "verdicts.md").exists()


@pytest.mark.parametrize("name", sorted(TRANSCRIBED))
def test_the_committed_verdicts_are_what_the_command_recomputes_from_the_committed_summaries(name, tmp_path):
    """docs/studies.md's command for a published study's verdicts, run on copies of its committed summaries, writes
    its committed verdicts.md."""
    import shutil

    from ftis_engine.study import verdicts

    dirs = TRANSCRIBED[name]
    copies = []
    for k, folder in enumerate(dirs):
        (tmp_path / str(k)).mkdir()
        shutil.copy(ROOT / folder / "summary.json", tmp_path / str(k) / "summary.json")
        copies.append(tmp_path / str(k))
    verdicts.main(["--config", f"configs/study/{name}.yaml", *(x for d in copies for x in ("--dir", str(d)))])
    text = (copies[0] / "verdicts.md").read_text()
    for copy, folder in sorted(zip(copies, dirs), key=lambda pair: -len(str(pair[0]))):
        text = text.replace(str(copy), folder)
    assert text == (ROOT / dirs[0] / "verdicts.md").read_text()


def test_the_committed_report_of_a_published_study_is_what_rewrite_recomputes_from_its_summary(tmp_path):
    import shutil

    from ftis_engine.study import rewrite

    shutil.copy(ROOT / "benchmarks/results/adversary_study/part3/summary.json", tmp_path / "summary.json")
    rewrite.main(["--config", str(ROOT / "configs/study/adversary.yaml"), "--dir", str(tmp_path), "--no-figures"])
    committed = ROOT / "benchmarks/results/adversary_study/part3/report.md"
    assert (tmp_path / "report.md").read_text() == committed.read_text()


# ------------------------------------------------------------------------- the order of registration and runs


def _git(repo, *args):
    import subprocess

    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True)


@pytest.fixture
def registered_study(tmp_path):
    """A study with a pre-registration, committed in a fresh git repository: (the repository, its config)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@example.org")
    _git(repo, "config", "user.name", "t")
    hypothesis = {"id": "H1", "text": "f-tis beats nois",
                  "tests": [{**_test("pair-f-tis", "above", vs="pair-nois"), "member": "a"}]}
    path = write_study(repo, {**MINIMAL, "preregistration": {"hypotheses": [hypothesis]}})
    _git(repo, "add", path.name)
    _git(repo, "commit", "-q", "-m", "pre-registration")
    return repo, path


def test_a_committed_pre_registration_is_recorded_with_its_commit(registered_study):
    from ftis_engine.study.config import registration_files
    from ftis_engine.study.runner import check_registered

    repo, path = registered_study
    head = _git(repo, "rev-parse", "HEAD").stdout.strip()
    [record] = check_registered(registration_files(load_study(path)))
    assert record["file"] == str(path) and record["commit"] == head and record["committed"]


@pytest.mark.parametrize("change", ["edited", "staged", "untracked"])
def test_a_study_with_an_uncommitted_pre_registration_refuses_to_start_naming_the_file(registered_study, capsys,
                                                                                        tmp_path, change):
    repo, path = registered_study
    if change == "untracked":
        path = path.rename(repo / "other.yaml")
    else:
        path.write_text(path.read_text().replace("f-tis beats nois", "f-tis beats nois by far"))
        if change == "staged":
            _git(repo, "add", path.name)
    result = command_here(capsys, "study", "--config", path, "--output-dir", tmp_path / "out")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert f"{path}: the study's pre-registration" in result.stderr and not (tmp_path / "out").exists()


def test_a_pre_registration_in_a_file_of_its_own_is_checked_too(registered_study):
    from ftis_engine.study.config import registration_files
    from ftis_engine.study.runner import check_registered

    repo, path = registered_study
    raw = yaml.safe_load(path.read_text())
    (repo / "hypotheses.yaml").write_text(yaml.safe_dump(raw.pop("preregistration")))
    path.write_text(yaml.safe_dump({**raw, "preregistration": "hypotheses.yaml"}))
    _git(repo, "add", path.name)
    _git(repo, "commit", "-q", "-m", "the hypotheses in a file of their own, not yet added")
    spec = load_study(path)
    assert registration_files(spec) == [path, repo / "hypotheses.yaml"]
    with pytest.raises(StudyError, match=r"hypotheses.yaml: the study's pre-registration is not committed"):
        check_registered(registration_files(spec))


def test_a_linked_pre_registration_is_judged_by_the_file_it_points_to(registered_study, tmp_path):
    """A committed config reached through a symbolic link in another folder is committed (git is asked about the
    file, in its own folder); a link in a checkout to a file outside any checkout is outside one."""
    from ftis_engine.study.runner import check_registered

    repo, path = registered_study
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "link.yaml").symlink_to(path)
    [record] = check_registered([elsewhere / "link.yaml"])
    assert record["commit"] == _git(repo, "rev-parse", "HEAD").stdout.strip()
    path.write_text(path.read_text() + "# changed\n")
    with pytest.raises(StudyError, match=r"link.yaml: the study's pre-registration has changes"):
        check_registered([elsewhere / "link.yaml"])
    outside = tmp_path / "outside.yaml"
    outside.write_text("study: x\n")
    (repo / "inside.yaml").symlink_to(outside)
    assert check_registered([repo / "inside.yaml"]) == [{"file": str(repo / "inside.yaml"), "commit": None,
                                                          "committed": None}]


def test_an_aggregate_only_report_keeps_the_registrations_commit_without_refusing(registered_study):
    """--aggregate-only starts no run, so an uncommitted change does not stop it; the report it recomputes still
    names when the registration was committed (and so which launches came before it)."""
    from ftis_engine.study.config import registration_files
    from ftis_engine.study.runner import check_registered

    repo, path = registered_study
    path.write_text(path.read_text() + "# changed\n")
    [record] = check_registered(registration_files(load_study(path)), refuse=False)
    assert record["commit"] == _git(repo, "rev-parse", "HEAD").stdout.strip() and record["committed"]


def test_a_study_records_when_each_run_was_launched_and_keeps_its_records(tmp_path, monkeypatch):
    """Each launch's start goes into the run's code record and the summary's `launches`; each finished run's
    metrics.jsonl is kept compressed in records/, and --aggregate-only recomputes the same tables from those alone
    once the run directories are gone."""
    import shutil

    from ftis_engine.study import runner
    from ftis_engine.study.plan import launch_times
    from ftis_engine.study.runner import record_launch

    spec = study_module.StudyConfig.model_validate(MINIMAL)
    groups = plan(spec, tmp_path, quick=False)
    for group in groups:
        for run, final in zip(group.runs, (0.2, 0.4)):
            _fake_run(run, [(0, 0.1), (2, final)], [1.0], samples=4)
            record_launch(run, {"commit": "c" * 40, "dirty": False})
    started = launch_times(groups[0].runs[0])
    assert len(started) == 1 and started[0].endswith("+00:00")
    monkeypatch.setattr(runner, "check_runs", lambda *args: None)
    summary = runner.run_study(spec, tmp_path, progress=False)
    assert {(x["group"], x["seed"]) for x in summary["launches"]} == {(g.name, s) for g in groups for s in (0, 1)}
    assert "Runs launched from " in (tmp_path / "report.md").read_text()
    report = (tmp_path / "report.md").read_text()
    assert all(run.record_path.is_file() for g in groups for run in g.runs)
    shutil.rmtree(tmp_path / "runs")
    again = runner.run_study(spec, tmp_path, progress=False, aggregate_only=True)
    assert [g["by_member"] for g in again["groups"]] == [g["by_member"] for g in summary["groups"]]
    assert (tmp_path / "report.md").read_text() == report
    with pytest.raises(StudyError, match=r"^--aggregate-only: .* holds no finished run"):
        runner.run_study(spec, tmp_path / "elsewhere", progress=False, aggregate_only=True)


def test_the_report_says_when_a_run_was_launched_before_its_pre_registration_was_last_committed():
    from ftis_engine.study.report import _launch_line

    summary = {"launches": [{"group": "g", "seed": 0, "started": ["2026-11-25T15:00:00+00:00"]},
                            {"group": "g", "seed": 1, "started": ["2026-11-25T15:10:00+00:00"]}],
               "preregistration": {"registered": [{"file": "s.yaml", "commit": "a" * 40,
                                                   "committed": "2026-11-25T15:00:45+00:00"}]}}
    line = _launch_line(summary)
    assert "`s.yaml` last committed in aaaaaaaaaaaa at 2026-11-25T15:00:45+00:00" in line
    assert "Runs launched from 2026-11-25T15:00:00+00:00 to 2026-11-25T15:10:00+00:00" in line
    assert "**1 launch(es) came before the pre-registration's last commit**" in line
    summary["launches"].pop(0)
    assert "came before" not in _launch_line(summary)


def test_a_study_that_keeps_folders_commits_each_run_as_it_finishes_and_a_kept_run_is_not_run_again(tmp_path,
                                                                                                     monkeypatch):
    """Issue 77: a study of hours on a machine that may be replaced between runs. records: folders keeps each
    finished run's metrics.jsonl, config.yaml and final_eval.json at <group>/seed-<s>/, commit_records commits them
    (and nothing else) the moment the run ends, and a run whose records are kept is done: a study on a machine that
    never held its run directory does not run it again, and aggregates it from the kept records."""
    import shutil

    from ftis_engine.study import runner

    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@example.org")
    _git(repo, "config", "user.name", "t")
    (repo / "unrelated.txt").write_text("a person's work in progress\n")
    _git(repo, "add", "unrelated.txt")
    spec = study_module.StudyConfig.model_validate({**MINIMAL, "records": "folders", "commit_records": True})
    out = repo / "study"
    launched = []

    def fake_launch(self, run):
        launched.append((run.group, run.seed))
        _fake_run(run, [(0, 0.1), (2, 0.3 + run.seed / 10)], [1.0], samples=4)
        (run.run_dir / "config.yaml").write_text("resolved\n")
        runner.record_launch(run, {"commit": "c" * 40, "dirty": False})
        return 0

    monkeypatch.setattr(runner.Launcher, "__call__", fake_launch)
    monkeypatch.setattr(runner, "check_runs", lambda *args: None)
    summary = runner.run_study(spec, out, progress=False)
    assert len(launched) == 4
    log = _git(repo, "log", "--format=%s", "--name-only").stdout
    assert log.count("committed as the run finished") == 4
    for group in ("pair-nois", "pair-f-tis"):
        for seed in (0, 1):
            kept = out / group / f"seed-{seed}"
            assert {p.name for p in kept.iterdir()} == {"metrics.jsonl", "config.yaml", "final_eval.json"}
            assert f"study/{group}/seed-{seed}/metrics.jsonl" in log
    assert "unrelated.txt" not in log  # staged by a person: left for them to commit
    assert "runs/" not in log
    # a new machine: the run directories are gone; nothing runs again and the numbers are the same
    shutil.rmtree(out / "runs")
    launched.clear()
    again = runner.run_study(spec, out, progress=False)
    assert launched == []
    assert [g["by_member"] for g in again["groups"]] == [g["by_member"] for g in summary["groups"]]


# ------------------------------------------------------------------------------------------------ issue 78


def _kept_study(tmp_path):
    """MINIMAL's four runs finished and kept in records/ (gzip), their run directories gone: what a committed study
    holds and --aggregate-only reads. Returns (its config file, its output directory, its groups)."""
    import shutil

    from ftis_engine.study.runner import keep_records

    config = write_study(tmp_path, MINIMAL)
    out = tmp_path / "out"
    groups = plan(load_study(config), out, quick=False)
    for group in groups:
        for run, final in zip(group.runs, (0.2, 0.4)):
            _fake_run(run, [(0, 0.1), (2, final)], [1.0], samples=4)
    keep_records([run for group in groups for run in group.runs])
    shutil.rmtree(out / "runs")
    return config, out, groups


def _aggregate_only(capsys, config, out):
    return command_here(capsys, "study", "--config", config, "--output-dir", out, "--aggregate-only")


SEED_AGAIN = "restore the file, or delete it (and the run's directory) to run that seed again"


@pytest.mark.parametrize("damage, said", [
    (lambda data: data[: len(data) // 2], "not a whole gzip stream: cut short"),
    (lambda data: b'{"step": 0}\n', "not gzip data"),
])
def test_aggregate_only_on_a_cut_short_or_non_gzip_record_is_one_line_naming_it(tmp_path, capsys, damage, said):
    """Its own message was good but never caught: a 62-line traceback."""
    config, out, groups = _kept_study(tmp_path)
    record = groups[0].runs[1].record_path
    record.write_bytes(damage(record.read_bytes()))
    result = _aggregate_only(capsys, config, out)
    assert result.returncode == 2 and result.stderr.splitlines() == [
        f"error: {record}: cannot read it ({said}) (group pair-nois, seed 1); {SEED_AGAIN}"], result.stderr
    assert not (out / "summary.json").exists()


BAD_RECORDS = [
    ({"accuracy": 1e308}, "accuracy: 1e+308 is not a share of the questions in [0, 1]"),
    ({"accuracy": float("nan")}, "accuracy: nan is not a share of the questions in [0, 1]"),
    ({"accuracy": -0.5}, "accuracy: -0.5 is not a share of the questions in [0, 1]"),
    ({"accuracy": True}, "accuracy: True is not a share of the questions in [0, 1]"),
    ({"samples": -4}, "samples: -4 is not a count of questions (a whole number, at least 1)"),
    ({"samples": 0}, "samples: 0 is not a count of questions (a whole number, at least 1)"),
    ({"dataset": None}, "dataset: None is not an eval set's name"),
    ({"attack_success_by": {"inject": 2.0}}, "attack_success_by: not a share in [0, 1] for each payload"),
    ({"step": -1}, "step -1: below 0"),
    ({"kind": "train", "kl_mean": 1e308}, "kl_mean: 1e+308 is not a number within +-1e+15"),
    ({"kind": "train", "reward_mean": float("inf")}, "reward_mean: inf is not a number within +-1e+15"),
    ({"kind": "train", "sequences": "8"}, "sequences: '8' is not a number within +-1e+15"),
]


@pytest.mark.parametrize("change, said", BAD_RECORDS, ids=[s.split(":")[0] for _, s in BAD_RECORDS])
def test_a_record_out_of_range_is_refused_naming_the_file_and_its_line(tmp_path, change, said):
    """An accuracy of 1e308 or a negative samples crashed the aggregate (OverflowError in the standard deviation,
    a math domain error in the report); a NaN accuracy went into summary.json as a bare NaN."""
    spec = study_module.StudyConfig.model_validate(MINIMAL)
    group = plan(spec, tmp_path, quick=False)[0]
    for run in group.runs:
        _fake_run(run, [(0, 0.1), (2, 0.5)], [1.0], samples=4)
    path = group.runs[1].run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[1] = json.dumps({**json.loads(lines[1]), **change})  # line 2: the eval at step 2
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(StudyError) as told:
        aggregate(spec, [group], quick=False, command="c")
    assert str(told.value) == f"{path} line 2: {said} (group pair-nois, seed 1); {SEED_AGAIN}"


def test_aggregate_only_on_a_record_of_1e308_is_one_line_with_exit_code_2(tmp_path, capsys):
    import gzip

    config, out, groups = _kept_study(tmp_path)
    record = groups[1].runs[0].record_path
    text = gzip.decompress(record.read_bytes()).decode().replace('"accuracy": 0.2', '"accuracy": 1e308')
    record.write_bytes(gzip.compress(text.encode()))
    result = _aggregate_only(capsys, config, out)
    assert result.returncode == 2 and result.stderr.splitlines() == [
        f"error: {record} line 2: accuracy: 1e+308 is not a share of the questions in [0, 1] (group pair-f-tis, "
        f"seed 0); {SEED_AGAIN}"], result.stderr


def test_a_second_eval_of_one_step_is_refused_naming_both_lines(tmp_path):
    spec = study_module.StudyConfig.model_validate(MINIMAL)
    group = plan(spec, tmp_path, quick=False)[0]
    for run in group.runs:
        _fake_run(run, [(0, 0.1), (0, 0.5)], [1.0])  # its area over no span divided by zero
    with pytest.raises(StudyError, match=r"metrics.jsonl line 2: a second eval of a on tiny-add at step 0 \(line 1\)"):
        aggregate(spec, [group], quick=False, command="c")


def test_summary_json_is_strict_json_and_a_nan_in_it_writes_nothing(tmp_path):
    from ftis_engine.study import write_outputs

    spec = study_module.StudyConfig.model_validate(MINIMAL)
    groups = plan(spec, tmp_path, quick=False)
    for group in groups:
        for run in group.runs:
            _fake_run(run, [(0, 0.1), (2, 0.5)], [1.0], samples=4)
    summary = aggregate(spec, groups, quick=False, command="c")
    write_outputs(spec, groups, summary, tmp_path)

    def no_constant(name):
        raise AssertionError(f"summary.json holds {name}: not JSON")

    assert json.loads((tmp_path / "summary.json").read_text(), parse_constant=no_constant)["study"] == "t"
    written = (tmp_path / "summary.json").read_bytes()
    summary["groups"][0]["by_member"]["a"]["final"]["tiny-add"]["mean"] = float("nan")
    with pytest.raises(ValueError, match="not JSON compliant"):
        write_outputs(spec, groups, summary, tmp_path)
    assert (tmp_path / "summary.json").read_bytes() == written


def test_a_seed_left_out_of_a_groups_numbers_is_said(tmp_path, caplog):
    """A study's aggregate never drops a seed without saying so: a finished run without an eval of a member, or a
    seed without a finished run."""
    spec = study_module.StudyConfig.model_validate({**MINIMAL, "seeds": [0, 1, 2]})
    group = plan(spec, tmp_path, quick=False)[0]
    _fake_run(group.runs[0], [(0, 0.1), (2, 0.5)], [1.0])
    _fake_run(group.runs[1], [], [1.0])  # finished, no eval record
    with caplog.at_level("WARNING", logger="ftis_engine"):
        summary = aggregate(spec, [group], quick=False, command="c")
    assert summary["groups"][0]["by_member"]["a"]["final"]["tiny-add"]["seeds"] == [0]
    said = [r.getMessage() for r in caplog.records]
    assert "group pair-nois: seed(s) 2 have no finished run and no kept records: left out of its numbers" in said
    assert "group pair-nois: seed(s) 1 have no eval of a on tiny-add: left out of its numbers" in said


def test_a_studys_outputs_replace_links_planted_at_their_names_and_leave_the_targets(tmp_path, capsys):
    """report.md, summary.json and figures/*.png were written through a link placed where the file goes; a link at
    the old temp name (summary.json.tmp) was written through too."""
    config, out, _ = _kept_study(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("kept")
    (out / "figures").mkdir()
    for name in ("report.md", "summary.json", "summary.json.tmp", "figures/set-pair.png"):
        (out / name).symlink_to(outside / "precious")
    result = _aggregate_only(capsys, config, out)
    assert result.returncode == 0, result.stderr
    assert (outside / "precious").read_text() == "kept" and {p.name for p in outside.iterdir()} == {"precious"}
    assert not any((out / name).is_symlink() for name in ("report.md", "summary.json", "figures/set-pair.png"))
    assert (out / "report.md").read_text().startswith("# Study `t`")
    assert (out / "figures" / "set-pair.png").read_bytes().startswith(b"\x89PNG")


def test_a_studys_figures_folder_as_a_link_is_refused_in_one_line(tmp_path, capsys):
    config, out, _ = _kept_study(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (out / "figures").symlink_to(outside)
    result = _aggregate_only(capsys, config, out)
    assert result.returncode == 2 and result.stderr.splitlines() == [
        f"error: {out / 'figures'}: a symbolic link where a folder the command writes goes: nothing is written "
        "through it; move it away (check --output-dir and the paths in the config)"], result.stderr
    assert list(outside.iterdir()) == []


def test_a_studys_kept_records_are_never_written_through_a_link(tmp_path):
    from ftis_engine.core.safefile import LinkRefused
    from ftis_engine.study.runner import keep_records

    spec = study_module.StudyConfig.model_validate(MINIMAL)
    out, outside = tmp_path / "out", tmp_path / "outside"
    outside.mkdir()
    run = plan(spec, out, quick=False)[0].runs[0]
    _fake_run(run, [(0, 0.1)], [1.0])
    (out / "records").symlink_to(outside)
    with pytest.raises(LinkRefused):
        keep_records([run])
    assert list(outside.iterdir()) == []


def test_a_runs_launch_record_is_never_appended_to_through_a_link(tmp_path):
    from ftis_engine.core.safefile import LinkRefused
    from ftis_engine.study.runner import record_launch

    spec = study_module.StudyConfig.model_validate(MINIMAL)
    run = plan(spec, tmp_path / "out", quick=False)[0].runs[0]
    run.code_path.parent.mkdir(parents=True)
    (tmp_path / "precious").write_text("kept")
    run.code_path.symlink_to(tmp_path / "precious")
    with pytest.raises(LinkRefused):
        record_launch(run, {"commit": "c" * 40, "dirty": False})
    assert (tmp_path / "precious").read_text() == "kept"


def test_a_stopped_study_writes_nothing_for_the_runs_it_never_starts(tmp_path):
    """Stopped by Ctrl-C, the study's pool still hands each queued run to the launcher: it wrote every queued run's
    config (32 files in the real-PEFT study's directory) before seeing the stop."""
    from ftis_engine.study import runner

    spec = study_module.StudyConfig.model_validate(MINIMAL)
    run = plan(spec, tmp_path, quick=False)[0].runs[0]
    launcher = runner.Launcher({}, {"commit": "c" * 40, "dirty": False})
    launcher.stop()
    assert launcher(run) is None
    assert not run.config_path.exists() and not run.log_path.exists()
