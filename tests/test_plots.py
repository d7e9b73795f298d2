"""Plots of a run: the validation curves and the training stats, smoothed when a run is long."""

from __future__ import annotations

import json

import pytest

from ftis_engine.report.plots import TRAIN_KEYS, make_plots, running_mean


def test_running_mean_averages_each_value_with_those_before_it():
    assert running_mean([1.0, 2.0, 3.0, 4.0, 5.0], 2) == [1.0, 1.5, 2.5, 3.5, 4.5]
    assert running_mean([4.0, 0.0, 2.0], 1) == [4.0, 0.0, 2.0]
    assert running_mean([3.0, 6.0, 9.0, 0.0], 3) == [3.0, 4.5, 6.0, 5.0]


def test_make_plots_writes_both_figures_for_a_long_run(tmp_path):
    lines = []
    for step in range(1, 61):
        for member in ("a", "b"):
            lines.append({"step": step, "member": member, "kind": "train", **{k: 0.01 * step for k in TRAIN_KEYS}})
        if step % 20 == 0:
            lines += [{"step": step, "member": m, "kind": "eval", "dataset": "tiny-last", "accuracy": 0.5}
                      for m in ("a", "b")]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    written = make_plots(tmp_path)
    assert [p.name for p in written] == ["eval.png", "train.png"]
    assert all(p.stat().st_size > 10_000 for p in written)


def test_plot_of_a_log_whose_lines_are_json_but_no_records_is_one_line(tmp_path, capsys):
    from .helpers import command_here

    (tmp_path / "metrics.jsonl").write_text("[1, 2, 3]\n")
    result = command_here(capsys, "plot", tmp_path)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"error: RUN_DIR {tmp_path}:") and "Traceback" not in result.stderr


def test_plot_draws_from_a_hand_damaged_log_and_refuses_what_it_cannot_write_in_one_line(tmp_path, capsys):
    """Lines without a member, with a text step or an eval without a dataset are skipped (the rest drawn); --out
    must name a figure file (.png, .pdf, .svg) or a directory; a file where plots/ belongs names RUN_DIR; a
    metrics.jsonl that is a directory is refused by name."""
    from .test_e2e import run_cli

    good = [{"step": s, "member": "a", "kind": "eval", "dataset": "x", "accuracy": s / 10} for s in (0, 5)]
    bad = ['{"member": "a", "kind": "eval"}', '{"step": "2", "member": "a", "kind": "eval"}',
           '{"step": 3, "kind": "train"}', '{"step": 4, "member": "a", "kind": "eval"}', "GARBAGE"]
    for name in ("R1", "R2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("\n".join([json.dumps(r) for r in good] + bad) + "\n")
    assert run_cli("plot", str(tmp_path / "R1")) == 0
    assert (tmp_path / "R1" / "plots" / "eval.png").is_file()
    (tmp_path / "dir").mkdir()
    assert run_cli("plot", str(tmp_path / "R1"), str(tmp_path / "R2"), "--out", str(tmp_path / "dir")) == 0
    assert capsys.readouterr().out.strip().endswith(str(tmp_path / "dir" / "overlay.png"))
    for out in ("x.txt", "name"):
        assert run_cli("plot", str(tmp_path / "R1"), str(tmp_path / "R2"), "--out", str(tmp_path / out)) == 2
        assert f"--out {tmp_path / out}: the figure's file must end in .png, .pdf, .svg" in capsys.readouterr().err
    (tmp_path / "R3").mkdir()
    (tmp_path / "R3" / "metrics.jsonl").write_text(json.dumps(good[0]) + "\n")
    (tmp_path / "R3" / "plots").write_text("a file where the plots directory goes")
    assert run_cli("plot", str(tmp_path / "R3")) == 2
    assert f"error: RUN_DIR {tmp_path / 'R3'}: {tmp_path / 'R3' / 'plots'}: cannot write it" in capsys.readouterr().err
    (tmp_path / "R4" / "metrics.jsonl").mkdir(parents=True)
    assert run_cli("plot", str(tmp_path / "R4")) == 2
    assert "its metrics.jsonl is not a file" in capsys.readouterr().err


def test_the_loss_panel_is_named_for_the_runs_method(tmp_path, monkeypatch):
    """train.png's loss panel says GEPO loss for a GEPO run (it said F-TIS loss whatever the method); a run
    directory without a config says loss."""
    import matplotlib.figure

    from ftis_engine.report.plots import run_method, train_labels

    titles = []
    save = matplotlib.figure.Figure.savefig

    def seen(fig, *args, **kwargs):
        titles.extend(ax.get_title() for ax in fig.axes)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", seen)
    lines = [{"step": s, "member": "a", "kind": "train", **{k: 0.1 for k in TRAIN_KEYS}} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (tmp_path / "config.yaml").write_text("algorithm:\n  method: gepo\n")
    make_plots(tmp_path)
    assert "GEPO loss" in titles and "F-TIS loss" not in titles
    assert run_method(tmp_path) == "gepo" and train_labels("f-nois")["loss"][0] == "F-NoIS loss"
    (tmp_path / "config.yaml").unlink()
    assert run_method(tmp_path) is None and train_labels(None)["loss"][0] == "loss"


def test_plot_of_a_log_with_no_record_it_can_draw_is_one_line_and_writes_nothing(tmp_path, capsys):
    """The log's only record has step -1, dataset null and accuracy 2.5: plot exited 0, wrote nothing, said nothing
    (an empty metrics.jsonl exits 2)."""
    from .helpers import command_here

    records = [{"step": -1, "member": "a", "kind": "eval", "dataset": None, "accuracy": 2.5},
               {"step": 3, "member": "a", "kind": "eval", "dataset": "d", "accuracy": 2.5},
               {"step": -1, "member": "a", "kind": "train", "loss": 0.1},
               {"step": 2, "member": "a", "kind": "train", "loss": "nan"}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    result = command_here(capsys, "plot", tmp_path)
    assert result.returncode == 2 and result.stderr.splitlines() == [
        f"error: RUN_DIR {tmp_path}: metrics.jsonl holds 4 record(s), none that can be drawn: an eval record needs a "
        "step >= 0, a dataset and an accuracy in [0, 1], a train record a step >= 0 and a number under one of "
        f"{', '.join(TRAIN_KEYS)}"], result.stderr
    assert not (tmp_path / "plots").exists()
    with open(tmp_path / "metrics.jsonl", "a") as log:  # one record it can draw: drawn, the others left out
        log.write(json.dumps({"step": 1, "member": "a", "kind": "eval", "dataset": "d", "accuracy": 0.5}) + "\n")
    assert command_here(capsys, "plot", tmp_path).returncode == 0 and (tmp_path / "plots" / "eval.png").is_file()


def _drawable_log(run_dir) -> None:
    lines = [{"step": s, "member": "a", "kind": "eval", "dataset": "d", "accuracy": s / 10} for s in (0, 5)]
    lines += [{"step": s, "member": "a", "kind": "train", **{k: 0.1 for k in TRAIN_KEYS}} for s in (1, 2)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_plots_never_write_through_a_link_planted_where_a_figure_goes(tmp_path):
    """Issue 78: `plot` and the end of `train` wrote plots/eval.png through a symbolic link placed there,
    overwriting its target outside the run directory. The link is replaced by the figure; its target is untouched."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    outside.mkdir()
    (outside / "precious").write_text("kept")
    _drawable_log(run)
    (run / "plots").mkdir()
    (run / "plots" / "eval.png").symlink_to(outside / "precious")
    written = make_plots(run)
    assert written == [run / "plots" / "eval.png", run / "plots" / "train.png"]
    assert not (run / "plots" / "eval.png").is_symlink()
    assert (run / "plots" / "eval.png").read_bytes().startswith(b"\x89PNG")
    assert (outside / "precious").read_text() == "kept" and {p.name for p in outside.iterdir()} == {"precious"}


def test_plots_as_a_link_is_refused_in_one_line_and_nothing_is_written_through_it(tmp_path, capsys):
    """plots/ itself a link: followed before (the figures landed in its target); now `plot` exits 2 naming it."""
    from ftis_engine.core.safefile import LinkRefused

    from .helpers import command_here

    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    outside.mkdir()
    _drawable_log(run)
    (run / "plots").symlink_to(outside)
    with pytest.raises(LinkRefused):
        make_plots(run)
    result = command_here(capsys, "plot", run)
    assert result.returncode == 2 and result.stderr.splitlines() == [
        f"error: RUN_DIR {run}: {run / 'plots'}: cannot write it (a symbolic link where a folder the command writes "
        "goes: nothing is written through it; move it away)"], result.stderr
    assert list(outside.iterdir()) == []


def test_the_overlay_replaces_a_link_at_its_out_file(tmp_path, capsys):
    from .helpers import command_here

    runs = []
    for name in ("R1", "R2"):
        (tmp_path / name).mkdir()
        _drawable_log(tmp_path / name)
        runs.append(tmp_path / name)
    (tmp_path / "precious").write_text("kept")
    (tmp_path / "overlay.png").symlink_to(tmp_path / "precious")
    result = command_here(capsys, "plot", *runs, "--out", tmp_path / "overlay.png")
    assert result.returncode == 0 and (tmp_path / "precious").read_text() == "kept"
    assert (tmp_path / "overlay.png").read_bytes().startswith(b"\x89PNG")
