"""A file the engine reads whole that a stranger could have planted or grown is bounded before it is read (issue
78): the run's final_eval.json, the wandb id, the launcher's exit code, a warm-start cache entry, a config, a
checkpoint's config.json, a study's summary.json and records, coordinator.jsonl's lines. Each read goes through
safefile.read_bytes / open_bounded: a regular file of at most its limit, else one line naming the file."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from ftis_engine.core import safefile


def sparse(path, size: int) -> None:
    """A file of `size` bytes that takes no disk (what a stranger's grown file reads as)."""
    with open(path, "wb") as out:
        out.truncate(size)


def test_the_final_evals_other_ranks_wrote_are_read_bounded_and_checked(tmp_path):
    from ftis_engine.run.rundir import RunDirError
    from ftis_engine.run.records import MAX_FINAL_EVAL_BYTES, read_final_evals, write_final_shared

    path = tmp_path / "final_eval.json"
    assert read_final_evals(path) == []
    write_final_shared(tmp_path, [{"member": "a", "accuracy": 0.5}])
    write_final_shared(tmp_path, [{"member": "b", "accuracy": 0.25}])
    assert [r["member"] for r in read_final_evals(path)] == ["a", "b"]
    sparse(path, MAX_FINAL_EVAL_BYTES + 1)
    with pytest.raises(RunDirError, match=f"^{path}: {MAX_FINAL_EVAL_BYTES + 1} bytes, over the "):
        read_final_evals(path)
    for text, said in [("{not json", "not JSON"), ('{"member": "a"}', "not a list of eval records"),
                       ('[{"accuracy": 1}]', "not a list of eval records")]:
        path.write_text(text)
        with pytest.raises(RunDirError, match=f"^{path}: {said}"):
            write_final_shared(tmp_path, [{"member": "c", "accuracy": 0.0}])
        assert path.read_text() == text  # left as it is


def test_the_wandb_id_is_read_bounded_and_only_an_id(tmp_path):
    from ftis_engine.config import ConfigError
    from ftis_engine.report.trackers import MAX_WANDB_ID_BYTES, read_wandb_id

    path = tmp_path / "wandb_id"
    assert read_wandb_id(path) is None
    path.write_text("1a2b3c4d\n")
    assert read_wandb_id(path) == "1a2b3c4d"
    sparse(path, MAX_WANDB_ID_BYTES + 1)
    with pytest.raises(safefile.TooLarge, match="a wandb id file may hold"):
        read_wandb_id(path)
    path.write_text("../../other run")
    with pytest.raises(ConfigError, match=f"^{path}: not a wandb run id"):
        read_wandb_id(path)


def test_the_launchers_exit_code_is_read_bounded(tmp_path, caplog):
    from ftis_engine.app.launch import MAX_EXIT_FILE_BYTES, _final_code

    path = tmp_path / "final-exit"
    assert _final_code(path) is None
    path.write_text("2")
    assert _final_code(path) == 2
    sparse(path, MAX_EXIT_FILE_BYTES + 1)
    with caplog.at_level(logging.WARNING, logger="ftis_engine.app.launch"):
        assert _final_code(path) is None
    assert f"{path}: not an exit code" in caplog.text


def test_a_warm_start_cache_entry_larger_than_the_models_weights_is_not_read(tmp_path, caplog):
    from ftis_engine.model.warmstart import _read, max_cache_bytes

    model = torch.nn.Linear(4, 4)
    limit = max_cache_bytes(model)
    assert limit == 2 * (16 + 4) * 4 + (16 << 20)
    path = tmp_path / "entry.pt"
    torch.save(model.state_dict(), path)
    assert set(_read(path, torch.device("cpu"), limit)) == {"weight", "bias"}
    sparse(path, limit + 1)
    with caplog.at_level(logging.WARNING, logger="ftis_engine"):
        assert _read(path, torch.device("cpu"), limit) is None
    assert "cannot be used" in caplog.text and "over the" in caplog.text


def test_a_config_file_is_read_bounded(tmp_path):
    from ftis_engine.config import ConfigError
    from ftis_engine.config.load import MAX_CONFIG_BYTES, read_yaml_mapping

    path = tmp_path / "config.yaml"
    sparse(path, MAX_CONFIG_BYTES + 1)
    with pytest.raises(ConfigError, match=f"^--config {path}: cannot read it \\({MAX_CONFIG_BYTES + 1} bytes, over"):
        read_yaml_mapping(path)


def test_plot_reads_the_runs_config_bounded(tmp_path):
    from ftis_engine.report.plots import MAX_CONFIG_BYTES, run_method

    (tmp_path / "config.yaml").write_text("algorithm:\n  method: gepo\n")
    assert run_method(tmp_path) == "gepo"
    sparse(tmp_path / "config.yaml", MAX_CONFIG_BYTES + 1)
    assert run_method(tmp_path) is None  # a plot without the method's name, as for any unreadable config


def test_a_checkpoints_config_json_is_read_bounded(tmp_path):
    from ftis_engine.model.checkpoint_files import MAX_JSON_BYTES, read_small_json

    path = tmp_path / "config.json"
    path.write_text('{"model_type": "qwen2"}')
    assert read_small_json(path) == {"model_type": "qwen2"}
    sparse(path, MAX_JSON_BYTES + 1)
    with pytest.raises(safefile.TooLarge, match="a checkpoint's JSON file may hold"):
        read_small_json(path)
    path.unlink()
    path.mkdir()
    with pytest.raises(IsADirectoryError):
        read_small_json(path)


def test_a_studys_summary_is_read_bounded(tmp_path, monkeypatch):
    from ftis_engine.study import report

    monkeypatch.setattr(report, "MAX_SUMMARY_BYTES", 16)
    (tmp_path / "summary.json").write_text(json.dumps({"groups": {}, "padding": "x" * 32}))
    with pytest.raises(safefile.TooLarge, match="a study's summary.json may hold"):
        report.rewrite_report(None, tmp_path)


def test_a_runs_code_record_is_read_bounded(tmp_path, monkeypatch):
    import importlib
    from types import SimpleNamespace

    plan = importlib.import_module("ftis_engine.study.plan")  # the package's `plan` is the function
    path = tmp_path / "code.jsonl"
    path.write_text(json.dumps({"commit": "abc", "started": "t"}) + "\n")
    run = SimpleNamespace(code_path=path)
    assert plan.launched_under(run) == ["abc"] and plan.launch_times(run) == ["t"]
    monkeypatch.setattr(plan, "MAX_CODE_RECORD_BYTES", 8)
    assert plan.launched_under(run) == [plan.NOT_RECORDED] and plan.launch_times(run) == []


def test_a_failed_runs_last_error_is_read_from_the_end_of_its_log(tmp_path, monkeypatch):
    from ftis_engine.study import runner

    log = tmp_path / "run.log"
    log.write_text("error: an early one\n" + "x" * 100 + "\nerror: the last one\n")
    assert runner.last_error(log) == "the last one"
    monkeypatch.setattr(runner, "MAX_LOG_TAIL_BYTES", 30)
    assert runner.last_error(log) == "the last one"  # its end alone is read
    log.unlink()
    import os

    os.mkfifo(log)
    assert runner.last_error(log) is None  # a FIFO never blocks it


def test_coordinator_log_lines_are_read_bounded(tmp_path, monkeypatch):
    from ftis_engine.openswarm import coordlog

    path = tmp_path / "coordinator.jsonl"
    start = {"time": 0, "event": "start", "member": None, "shared": {"a": 1}, "dataset": "0" * 64}
    long_line = json.dumps({"event": "join", "member": "x" * 200})
    path.write_text(json.dumps(start) + "\n" + long_line + "\n")
    monkeypatch.setattr(coordlog, "MAX_LOG_LINE", len(long_line) - 10)
    members, dataset, recorded, logged = coordlog.restore(path)
    assert recorded == {"a": 1} and dataset == "0" * 64 and logged  # the cut line is no record: skipped
