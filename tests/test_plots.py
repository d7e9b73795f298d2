"""Plots of a run: the validation curves and the training stats, smoothed when a run is long."""

from __future__ import annotations

import json

from ftis_engine.plots import TRAIN_KEYS, make_plots, running_mean


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


def test_plot_of_a_log_whose_lines_are_json_but_no_records_is_one_line(tmp_path):
    from .test_cli import cli

    (tmp_path / "metrics.jsonl").write_text("[1, 2, 3]\n")
    result = cli("plot", tmp_path)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"error: RUN_DIR {tmp_path}:") and "Traceback" not in result.stderr
