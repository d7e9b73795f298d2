"""The README's promise about the embedded default: every member's greedy accuracy rises by at least 20 points
over step 0. (Its wall time is measured by benchmarks/tiny_default.py, not asserted here.)

The README's first command runs the embedded default (CI runs it right before the tests): its run, in runs/tiny,
is what this checks when it is there, finished, made with the default config unchanged and started after every
file of the code last changed; otherwise the test runs the default itself."""

from __future__ import annotations

import pathlib

import pytest

from ftis_engine.app.cli import main
from ftis_engine.config import config_differences, load_config

from .helpers import ROOT, TINY, run_records


def readme_run(root: pathlib.Path = ROOT) -> pathlib.Path | None:
    """runs/tiny when the README's first command made it from the code and config as they are now, else None."""
    run = root / "runs" / "tiny"
    done = run / "final_eval.json"
    if not done.is_file() or not (run / "config.yaml").is_file():
        return None
    code = [p for p in [*root.glob("ftis_engine/**/*"), *root.glob("kernels/**/*")] if "__pycache__" not in p.parts]
    code += [root / "configs" / "tiny.yaml", root / "pyproject.toml", root / "constraints.txt"]
    started = (run / "config.yaml").stat().st_mtime  # written as the run starts
    if started < max(p.stat().st_mtime for p in code if p.is_file()):
        return None  # the code changed since it started: that run does not show what the code does now
    if config_differences(load_config(run / "config.yaml"), load_config(root / "configs" / "tiny.yaml")):
        return None
    return run


def test_a_readme_run_counts_only_when_finished_newer_than_the_code_and_of_the_default_config(tmp_path):
    for part in ("ftis_engine", "kernels", "configs"):
        (tmp_path / part).mkdir()
    (tmp_path / "ftis_engine" / "a.py").write_text("")
    (tmp_path / "configs" / "tiny.yaml").write_text(TINY.read_text())
    run = tmp_path / "runs" / "tiny"
    run.mkdir(parents=True)
    assert readme_run(tmp_path) is None  # nothing finished there
    (run / "config.yaml").write_text(TINY.read_text())
    (run / "final_eval.json").write_text("{}")
    assert readme_run(tmp_path) == run
    (run / "config.yaml").write_text(TINY.read_text().replace("steps: 400", "steps: 2"))
    assert readme_run(tmp_path) is None  # another config
    (run / "config.yaml").write_text(TINY.read_text())
    import os

    later = (run / "config.yaml").stat().st_mtime + 10
    os.utime(tmp_path / "ftis_engine" / "a.py", (later, later))
    assert readme_run(tmp_path) is None  # the code is newer than the run


@pytest.mark.slow
def test_tiny_default_every_member_gains_20_points(tmp_path):
    run = readme_run()
    if run is None:
        with pytest.raises(SystemExit) as done:
            main(["train", "--config", str(TINY), "--output-dir", str(tmp_path)])
        assert done.value.code == 0
        run = tmp_path / "tiny"
    evals = run_records(run, "eval")
    last = max(r["step"] for r in evals)
    for member in {r["member"] for r in evals}:
        start_acc = next(r["accuracy"] for r in evals if r["member"] == member and r["step"] == 0)
        end_acc = next(r["accuracy"] for r in evals if r["member"] == member and r["step"] == last)
        assert end_acc - start_acc >= 0.20, (member, start_acc, end_acc)
