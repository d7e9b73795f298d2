"""logging.report_to: wandb and trackio beside metrics.jsonl and TensorBoard, in their offline modes (nothing is sent
anywhere); the same numbers under the same names, a resumed run continuing the same tracker run."""

from __future__ import annotations

import importlib.util
import json
import os
import sqlite3
import subprocess
import sys

import pytest

from .helpers import SHORT, TINY, run_records


def _train(tmp_path, *overrides, resume=False, steps=2):
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path / "wandb-home"),
           "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"), "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
           "TRACKIO_DIR": str(tmp_path / "trackio"), "HF_HUB_OFFLINE": "1"}
    args = [sys.executable, "-m", "ftis_engine", "train", "--config", str(TINY), "--output-dir", str(tmp_path / "out")]
    for override in [*SHORT, f"train.steps={steps}", "eval.every=0", "checkpoint.every=1", *overrides]:
        args += ["--set", override]
    if resume:
        args.append("--resume")
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)


def _wandb_history(path):
    """The history rows ({key: value}) of an offline .wandb file: a LevelDB-style log (a 7-byte header, then 32 KiB
    blocks of records of [crc 4, length 2, type 1] + data; types full 1, first 2, middle 3, last 4) of protobuf
    Records, read here because wandb's own reader moved into its Go core."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, partial, rows = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (2, 3):
            partial = chunk if kind == 2 else partial + chunk
            continue
        if kind not in (1, 4):
            break
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk if kind == 1 else partial + chunk)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def _records(tmp_path):
    return run_records(tmp_path / "out" / "tiny", "train")


def test_a_tracker_that_is_not_installed_is_named_with_its_install_hint(monkeypatch):
    from ftis_engine.report import trackers

    real = importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    assert trackers.check_available(["tensorboard", "trackio"]) is None or importlib.util.find_spec("trackio") is None
    assert trackers.check_available(["tensorboard", "wandb"]) == (
        "logging.report_to: wandb is not installed; pip install 'ftis-engine[wandb]' (or wandb)")


def test_report_to_names_known_trackers_once_and_may_change_on_resume():
    from ftis_engine.config import ConfigError, load_config
    from ftis_engine.run.rundir import resumable

    with pytest.raises(ConfigError, match="logging.report_to"):
        load_config(TINY, ["logging.report_to=[wandb, wandb]"])
    with pytest.raises(ConfigError, match="logging.report_to"):
        load_config(TINY, ["logging.report_to=[mlflow]"])
    assert load_config(TINY, []).logging.report_to == ["tensorboard"]
    assert resumable("logging.report_to") and resumable("logging.project")


@pytest.mark.slow
def test_without_any_tracker_only_metrics_jsonl_is_written(tmp_path):
    done = _train(tmp_path, "logging.report_to=[]", steps=1)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (tmp_path / "out" / "tiny" / "tensorboard").exists() and _records(tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("wandb") is None or importlib.util.find_spec("trackio") is None,
                    reason="wandb and trackio are optional extras (pip install 'ftis-engine[wandb,trackio]')")
def test_wandb_and_trackio_offline_get_every_number_and_a_resume_continues_their_runs(tmp_path):
    trackers = "logging.report_to=[tensorboard, wandb, trackio]"
    done = _train(tmp_path, trackers, "logging.project=ftis-test", steps=2)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "out" / "tiny"
    run_id = (run_dir / "wandb_id").read_text()
    done = _train(tmp_path, trackers, "logging.project=ftis-test", resume=True, steps=3)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (run_dir / "wandb_id").read_text() == run_id  # the same wandb run, continued
    records = _records(tmp_path)
    last = {r["member"]: r for r in records if r["step"] == 3}
    assert set(last) == {"tiny-s", "tiny-m-lora"}

    # wandb (offline, in the run directory): the first start and the resume, both under the one id; their history
    # holds every train record's numbers by the same names at the run's step
    runs = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 2
    history = {}
    for run in runs:
        for items in _wandb_history(run / f"run-{run_id}.wandb"):
            history.update({(key, items["step"]): value for key, value in items.items() if key != "step"})
    for record in records:
        for key in ("reward_mean", "loss", "is_weight_mean"):
            name = f"{record['member']}/train/{key}"
            assert history[(name, record["step"])] == pytest.approx(record[key]), name

    # trackio (local SQLite): every train record's numbers, at its step, in the run named after run_name
    database = tmp_path / "trackio" / "ftis-test.db"
    with sqlite3.connect(database) as db:
        rows = db.execute("SELECT run_name, step, metrics FROM metrics").fetchall()
    logged = {}
    for run_name, step, metrics in rows:
        assert run_name == "tiny"
        for key, value in json.loads(metrics).items():
            logged[(key, step)] = value
    for record in records:
        key = f"{record['member']}/train/reward_mean"
        assert logged[(key, record["step"])] == pytest.approx(record["reward_mean"]), key


@pytest.mark.parametrize("tracker", ["wandb", "trackio"])
def test_a_tracker_that_is_not_installed_is_one_line_before_anything_is_written_in_one_process(tmp_path, capsys,
                                                                                               monkeypatch, tracker):
    """One process skipped the launcher's check: ModuleNotFoundError after config.yaml and an empty metrics.jsonl."""
    from ftis_engine.report import trackers

    from .helpers import command_here

    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None if name == tracker else real(name))
    done = command_here(capsys, "train", "--config", TINY, "--output-dir", tmp_path / "runs", "--set",
                        f"logging.report_to=[{tracker}]", "--set", "train.steps=1")
    assert done.returncode == 2 and done.stderr.splitlines() == [
        f"error: logging.report_to: {tracker} is not installed; {trackers.EXTRA_HINT[tracker]}"], done.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("failure", [RuntimeError("trackio: no such project"), KeyboardInterrupt()])
def test_a_tracker_that_fails_to_open_closes_those_already_open(tmp_path, monkeypatch, failure):
    """wandb opened, then trackio fails (or a Ctrl-C comes): wandb is closed, and the failure is raised as itself."""
    from ftis_engine.report import trackers

    closed = []

    class Opened:
        def __init__(self, *args):
            pass

        def close(self):
            closed.append("wandb")

    def fails(*args):
        raise failure

    monkeypatch.setattr(trackers, "WandbTracker", Opened)
    monkeypatch.setattr(trackers, "TrackioTracker", fails)
    with pytest.raises(type(failure)):
        trackers.open_trackers(["tensorboard", "wandb", "trackio"], tmp_path, "p", "n", "g", {}, resume=False)
    assert closed == ["wandb"]
    opened = trackers.open_trackers(["tensorboard", "wandb"], tmp_path, "p", "n", "g", {}, resume=False)
    assert [type(t) for t in opened] == [Opened] and closed == ["wandb"]  # all open: the caller closes them
