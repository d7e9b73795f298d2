"""Checkpoints and records checked whole before they are used (issue 78, findings 3-8 and 10): a damaged data.json
never turns the data check off, a checkpoint's NaN weights, a member folder of another kind or shape are the
checkpoint's fault named as its file's (one line, exit 2, nothing fetched from the network), and a full disk before
the first checkpoint says what is true and leaves no temporary file."""

from __future__ import annotations

import errno
import json
import pathlib
import shutil
import socket

import pytest
import torch
from safetensors.torch import load_file, save_file

from ftis_engine.app import cli

from .helpers import SHORT, TINY, command_here, run_records

STEPS = [*SHORT, "train.steps=4", "eval.every=0", "eval.at_start=false"]


def _args(output_dir: pathlib.Path, *overrides: str) -> list:
    args = ["train", "--config", TINY, "--output-dir", output_dir]
    for override in [*STEPS, *overrides]:
        args += ["--set", override]
    return args


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> pathlib.Path:
    """A run of 4 steps with complete checkpoints at steps 2 and 4 (its output directory)."""
    out = tmp_path_factory.mktemp("trust") / "runs"
    try:
        cli.main([str(a) for a in _args(out)])
    except SystemExit as exc:
        assert exc.code in (0, None)
    assert sorted(p.name for p in (out / "tiny" / "checkpoints").iterdir() if p.name.startswith("step-")) == \
        ["step-2", "step-4"]
    return out


@pytest.fixture
def copy(finished, tmp_path) -> pathlib.Path:
    """A copy of the finished run's output directory, for a test to damage."""
    shutil.copytree(finished, tmp_path / "runs")
    return tmp_path / "runs"


def _resume(capsys, out: pathlib.Path, *extra: str):
    return command_here(capsys, *_args(out, "train.steps=5"), "--resume", *extra)


def _one_line(result) -> str:
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def _leftovers(run_dir: pathlib.Path) -> list[str]:
    return sorted(p.name for p in run_dir.rglob("*") if ".tmp" in p.name)


@pytest.fixture
def no_network(monkeypatch):
    """The hub's client online (the tests run it offline) and every connection it would make refused and counted: a
    local checkpoint or model is read from the disk alone, so the test ends with none attempted."""
    import huggingface_hub.constants

    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("no network in this test")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    yield
    assert attempts == []


# ----------------------------------------------------------------------------------- data.json (findings 3, 7, 10)

DAMAGED_RECORDS = {
    "missing": (lambda f: f.unlink(), "is missing"),
    "empty": (lambda f: f.write_text(""), "is empty"),
    "not JSON": (lambda f: f.write_text('{"files": {'), "is not JSON"),
    "not a record": (lambda f: f.write_text("[1, 2]"), "is not a data record"),
    "a digest out of form": (lambda f: f.write_text(json.dumps({"files": {"data.train_path": {
        "path": "x", "sha256": "abc"}}, "changes": []})), "files.data.train_path is not a file's path and sha256"),
    "a step out of range": (lambda f: f.write_text(json.dumps({"files": {}, "changes": [{"step": -1, "fields": []}]})),
                            "changes.0 is not a step"),
    "a directory": (lambda f: (f.unlink(), f.mkdir()), "is not a file"),
}


@pytest.mark.parametrize("damage", DAMAGED_RECORDS)
def test_a_resume_over_a_data_record_that_is_not_whole_is_refused_naming_it_and_keeps_it(copy, capsys, damage):
    """A missing, emptied or damaged data.json turned the data-change check off: the run trained on changed data
    without a word and rewrote data.json with the new digests. Now refused in one line naming the file, exit 2,
    the file as it was and nothing left behind (a data.json that is a directory: a 51-line traceback before)."""
    run_dir = copy / "tiny"
    record = run_dir / "data.json"
    make, said = DAMAGED_RECORDS[damage]
    make(record)
    before = record.read_bytes() if record.is_file() else None
    result = _resume(capsys, copy)
    line = _one_line(result)
    assert result.returncode == 2 and f"--resume: {record}" in line and said in line and \
        "--allow-data-change" in line, line
    assert (record.read_bytes() if record.is_file() else None) == before
    assert record.is_dir() == (damage == "a directory")
    assert _leftovers(run_dir) == [] and max(r["step"] for r in run_records(run_dir)) == 4


@pytest.mark.parametrize("damage", ["empty", "a directory"])
def test_allow_data_change_goes_on_past_a_damaged_record_saying_so_and_recording_it(copy, capsys, caplog, damage,
                                                                                     no_network):
    """The resume goes on, its checkpoint read from the disk alone (no_network: nothing dialled, the hub online)."""
    run_dir = copy / "tiny"
    DAMAGED_RECORDS[damage][0](run_dir / "data.json")
    result = _resume(capsys, copy, "--allow-data-change")
    assert result.returncode == 0, result.stderr
    assert "data_changed_at" in caplog.text and str(run_dir / "data.json") in caplog.text
    kept = run_dir / "data.json.unusable-step-4"  # the evidence, never overwritten silently
    assert kept.is_dir() if damage == "a directory" else kept.read_text() == ""
    record = json.loads((run_dir / "data.json").read_text())
    assert [(c["step"], c["fields"]) for c in record["changes"]] == [(4, [])]
    assert DAMAGED_RECORDS[damage][1] in record["changes"][0]["unverified"]
    assert {r["data_changed_at"] for r in run_records(run_dir) if r["step"] == 5} == {4}
    assert _leftovers(run_dir) == []


def test_a_fresh_run_over_a_data_record_that_is_a_directory_is_refused_in_one_line(tmp_path, capsys):
    run_dir = tmp_path / "runs" / "tiny"
    (run_dir / "data.json").mkdir(parents=True)
    result = command_here(capsys, *_args(tmp_path / "runs"))
    assert result.returncode == 2 and f"run_name: {run_dir / 'data.json'} is not a file" in _one_line(result)


def test_allow_data_change_without_resume_is_refused_with_dry_run_too(tmp_path, capsys):
    plain = command_here(capsys, *_args(tmp_path), "--allow-data-change")
    dry = command_here(capsys, *_args(tmp_path), "--allow-data-change", "--dry-run")
    assert plain.returncode == dry.returncode == 2 and dry.stdout == ""
    assert _one_line(dry) == _one_line(plain) == \
        "error: --allow-data-change: only with --resume (a new run records the data it starts on)"
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------------------ the weights (findings 4, 5, 6)

def _model_file(out: pathlib.Path, step: int, member: str = "tiny-s") -> pathlib.Path:
    return out / "tiny" / "checkpoints" / f"step-{step}" / "members" / member / "model" / "model.safetensors"


def _rewrite(file: pathlib.Path, change) -> None:
    weights = load_file(file)
    change(weights)
    save_file(weights, file, metadata={"format": "pt"})


def _poison(weights: dict, name: str = "model.norm.weight", value: float = float("nan")) -> None:
    weights[name] = weights[name].clone()
    weights[name][0] = value


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_eval_of_a_checkpoint_whose_weights_hold_nan_is_refused_naming_the_file(copy, capsys, value):
    """It reported accuracy 0.000 with exit 0."""
    file = _model_file(copy, 4)
    _rewrite(file, lambda w: _poison(w, value=value))
    result = command_here(capsys, "eval", "--checkpoint", copy / "tiny" / "checkpoints" / "step-4")
    line = _one_line(result)
    assert result.returncode == 2 and result.stdout == ""
    assert f"{file}: tensor model.norm.weight holds NaN or inf" in line
    assert f"evaluate that one with --checkpoint {copy / 'tiny' / 'checkpoints' / 'step-2'}" in line


def test_a_resume_from_nan_weights_blames_the_checkpoint_and_points_at_the_older_one(copy, capsys):
    """It was told as a divergence with the advice to lower the learning rate and resume from that same
    checkpoint: a loop. The checkpoint is the fault: its file named, and the older complete checkpoint."""
    file = _model_file(copy, 4)
    _rewrite(file, _poison)
    line = _one_line(result := _resume(capsys, copy))
    assert result.returncode == 2 and f"{file}: tensor model.norm.weight holds NaN or inf" in line
    assert "diverged" not in line and "lr" not in line
    assert f"an older complete checkpoint is {copy / 'tiny' / 'checkpoints' / 'step-2'}: move step-4 out of" in line
    shutil.rmtree(copy / "tiny" / "checkpoints" / "step-2")
    assert "no older complete checkpoint is kept" in _one_line(_resume(capsys, copy))


def test_a_resume_from_an_optimizer_state_that_holds_nan_names_the_file(copy, capsys):
    file = copy / "tiny" / "checkpoints" / "step-4" / "members" / "tiny-s" / "optimizer.pt"
    state = torch.load(file, weights_only=True)
    state["state"][0]["exp_avg"][0] = float("nan")
    torch.save(state, file)
    result = _resume(capsys, copy)
    assert result.returncode == 2 and f"{file}: tensor exp_avg of parameter 0 holds NaN or inf" in _one_line(result)


def test_two_members_folders_swapped_are_said_as_such_locally(copy, capsys, no_network):
    """A LoRA adapter where a full model goes made the resume try huggingface.co five times (23 s), then blame the
    network."""
    members = copy / "tiny" / "checkpoints" / "step-4" / "members"
    (members / "tiny-s").rename(members / "x")
    (members / "tiny-m-lora").rename(members / "tiny-s")
    (members / "x").rename(members / "tiny-m-lora")
    line = _one_line(result := _resume(capsys, copy))
    assert result.returncode == 2
    assert f"{members / 'tiny-s' / 'model'}: holds a LoRA adapter (adapter_model.safetensors), but members.0 " \
           "(tiny-s) is a full model" in line and "huggingface" not in line
    shutil.rmtree(members / "tiny-s")  # the other way round: a full model where an adapter goes
    shutil.copytree(copy / "tiny" / "checkpoints" / "step-2" / "members" / "tiny-s", members / "tiny-s")
    line = _one_line(_resume(capsys, copy))
    assert f"{members / 'tiny-m-lora' / 'model'}: holds a full model" in line and "members.1 (tiny-m-lora) trains a " \
           "LoRA adapter" in line


@pytest.mark.parametrize("change, said", [
    (lambda w: w.update({"model.norm.weight": w["model.norm.weight"][:-1].clone()}),
     "tensor model.norm.weight has shape [63], members.0 (tiny-s)'s has [64]"),
    (lambda w: w.update({"model.norm.weight": w["model.norm.weight"].to(torch.bfloat16)}),
     "tensor model.norm.weight is BF16, members.0 (tiny-s) keeps it in F32"),
    (lambda w: w.pop("model.layers.0.mlp.down_proj.weight"), "lacks tensor model.layers.0.mlp.down_proj.weight"),
    (lambda w: w.update({"model.extra.weight": torch.zeros(2)}), "holds an unknown tensor model.extra.weight"),
])
def test_a_full_models_tensor_of_another_shape_or_dtype_missing_or_extra_is_one_line_naming_it(
        copy, capsys, caplog, no_network, change, said):
    """A wrong shape printed transformers' 8-line load report first; a missing tensor was left at a random init
    without a word."""
    file = _model_file(copy, 4)
    _rewrite(file, change)
    line = _one_line(result := _resume(capsys, copy))
    assert result.returncode == 2 and said in line and str(file.parent) in line
    assert "LOAD REPORT" not in caplog.text + result.stdout + result.stderr


def test_an_adapters_tensor_of_another_shape_or_nan_is_one_line_naming_it(copy, capsys):
    file = _model_file(copy, 4, "tiny-m-lora").with_name("adapter_model.safetensors")
    name = next(iter(load_file(file)))
    _rewrite(file, lambda w: w.update({name: w[name][:1].clone()}))
    assert f"{file}: tensor {name} has shape [1," in _one_line(_resume(capsys, copy))
    shutil.copy(_model_file(copy, 2, "tiny-m-lora").with_name("adapter_model.safetensors"), file)
    _rewrite(file, lambda w: _poison(w, name))
    assert f"{file}: tensor {name} holds NaN or inf" in _one_line(_resume(capsys, copy))


def test_a_full_models_config_of_another_architecture_is_refused_naming_it(copy, capsys, no_network):
    config = _model_file(copy, 4).with_name("config.json")
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "llama"}))
    assert f"{config}: describes a 'llama' model, but members.0 (tiny-s) is a 'qwen2' model" in \
        _one_line(_resume(capsys, copy))


def test_a_model_folder_that_holds_an_adapter_is_said_as_such_without_the_hub(copy, capsys, no_network):
    """members.N.model naming a local folder that holds a LoRA adapter: transformers looked for the model on the
    hub and blamed the network."""
    folder = _model_file(copy, 4, "tiny-m-lora").parent
    result = command_here(capsys, *_args(copy / "other", f"members.0.model={folder}"))
    line = _one_line(result)
    assert result.returncode == 2 and f"{folder} has no config.json (it holds a LoRA adapter, not a model)" in line


# ------------------------------------------------------------------------------------------- a full disk (8)

def _fill_at(monkeypatch, name: str) -> None:
    """Writing the file `name` meets a full disk as the OS does: its temporary file is created and written, and
    flushing it to disk fails with ENOSPC (the run's files go through ftis_engine.core.safefile, which must remove it)."""
    import os

    original = os.fsync

    def fsync(fd):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(f".{name}."):
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("name", ["config.yaml", "data.json"])
def test_a_full_disk_before_the_first_checkpoint_says_to_start_again_and_leaves_no_temporary_file(
        tmp_path, capsys, monkeypatch, name):
    """It said "the newest complete checkpoint is intact: free space, then --resume": there was none, --resume then
    refused, and a 0-byte temporary file stayed."""
    _fill_at(monkeypatch, name)
    result = command_here(capsys, *_args(tmp_path / "runs"))
    line = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1 and line.startswith("error: No space left on device writing ")
    assert "no complete checkpoint yet" in line and "start it again (the same command, without --resume)" in line
    assert "intact" not in line
    assert not (tmp_path / "runs").exists() or _leftovers(tmp_path / "runs") == []
    monkeypatch.undo()
    assert command_here(capsys, *_args(tmp_path / "runs", "train.steps=2")).returncode == 0  # as it says


def test_a_full_disk_after_a_checkpoint_says_the_newest_is_intact(copy, capsys, monkeypatch):
    _fill_at(monkeypatch, "config.yaml")
    result = _resume(capsys, copy)
    line = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1 and "the newest complete checkpoint, step-4, is intact: free space, then --resume" \
        in line
    assert _leftovers(copy / "tiny") == []
