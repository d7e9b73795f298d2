"""Checkpoints (checkpoint.py): every weight restored exactly, nothing loaded with pickle's code execution,
no non-finite weight ever saved, and a step's checkpoint completed only when every member has staged it."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import pickle
import subprocess

import pytest
import torch

from ftis_engine.model import checkpoint
from ftis_engine.model.checkpoint import (CheckpointWriteError, complete_checkpoints, finalize_when_staged, restore_member,
                                    save_member, stage_members)
from ftis_engine.model.update import DivergenceError

from .helpers import as_rank_1_of_a_world, member


def _tiny_local_model(tmp_path, architecture: str):
    import transformers

    from ftis_engine.model.models import load_tokenizer

    tokenizer = load_tokenizer("builtin:tiny-s")
    common = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if architecture == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
        model = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(config)
    model.save_pretrained(str(tmp_path / architecture))
    tokenizer.save_pretrained(str(tmp_path / architecture))
    return str(tmp_path / architecture)


@pytest.mark.parametrize("architecture", ["qwen2", "mixtral"])
def test_a_checkpoint_restores_every_weight_exactly(tmp_path, architecture):
    """transformers 5 saves some families (MoE experts) under their original names; resume must map them back."""
    path = _tiny_local_model(tmp_path, architecture)
    m, _ = member(1, f"members.1.model={path}", "members.1.lora=null")
    before = {k: v.clone() for k, v in m.model.state_dict().items()}
    save_member(m, tmp_path / "ckpt" / "members" / m.name, save_optimizer=False)
    with torch.no_grad():
        for p in m.model.parameters():
            p.add_(1.0)
    restore_member(m, tmp_path / "ckpt", load_optimizer=False)
    after = m.model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_full_member_led_by_rank_1_saves_its_weights_and_they_come_back(tmp_path, monkeypatch):
    """transformers 5's save_pretrained writes on the world's rank 0 alone and says nothing on the others: member 1
    of a --nproc run checkpointed no weights and its vLLM engine found no config.json (seen on an H200)."""
    m, _ = member(1, "members.1.lora=null")
    before = {k: v.clone() for k, v in m.model.state_dict().items()}
    as_rank_1_of_a_world(monkeypatch)
    plain = tmp_path / "plain"
    m.model.save_pretrained(str(plain))  # the premise: transformers itself writes nothing here
    assert not (plain / "config.json").exists() and not list(plain.glob("*.safetensors"))
    save_member(m, tmp_path / "ckpt" / "members" / m.name, save_optimizer=False)
    assert (tmp_path / "ckpt" / "members" / m.name / "model" / "config.json").is_file()
    assert not hasattr(m.model, "should_save_on_this_rank") or "should_save_on_this_rank" not in vars(m.model)
    with torch.no_grad():
        for p in m.model.parameters():
            p.add_(1.0)
    restore_member(m, tmp_path / "ckpt", load_optimizer=False)
    after = m.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_save_that_writes_no_weights_file_is_an_error_not_a_silent_empty_folder(tmp_path, monkeypatch):
    from ftis_engine.model.saving import save_pretrained

    m, _ = member(1, "members.1.lora=null")
    monkeypatch.setattr(type(m.model), "save_pretrained", lambda self, directory, **kwargs: None)
    with pytest.raises(RuntimeError, match="wrote no weights file"):
        save_pretrained(m.model, tmp_path / "out")


class _Exploit:
    """Unpickling this runs a command: what a checkpoint from someone else could hold."""

    def __reduce__(self):
        return (os.system, ("touch /tmp/ftis-pickle-exploit-ran",))


def test_an_rng_file_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    m, _ = member(0)
    save_member(m, tmp_path / "ckpt" / "members" / m.name, save_optimizer=True)
    marker = "/tmp/ftis-pickle-exploit-ran"
    if os.path.exists(marker):
        os.remove(marker)
    torch.save({"torch": _Exploit()}, tmp_path / "ckpt" / "members" / m.name / "rng.pt")
    with pytest.raises(pickle.UnpicklingError):
        restore_member(m, tmp_path / "ckpt", load_optimizer=True)
    assert not os.path.exists(marker)


def test_the_rng_state_comes_back_exactly(tmp_path):
    m, _ = member(0)
    torch.manual_seed(5)
    save_member(m, tmp_path / "ckpt" / "members" / m.name, save_optimizer=False)
    expected = torch.rand(3)
    torch.manual_seed(99)
    restore_member(m, tmp_path / "ckpt", load_optimizer=False)
    assert torch.equal(torch.rand(3), expected)


def test_weights_that_are_nan_or_inf_are_never_saved(tmp_path):
    m, _ = member(0)
    with torch.no_grad():
        m.trainable_parameters()[0].view(-1)[0] = float("inf")
    with pytest.raises(DivergenceError, match=r"members.0 \(tiny-s\): its weights are NaN or inf; they are not saved"):
        stage_members(tmp_path, 4, [m], save_optimizer=True)
    assert not list((tmp_path / "checkpoints").rglob("rng.pt"))  # not staged: the step can never complete


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"),
                                     RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")])
def test_a_write_that_fails_removes_the_staging_and_says_free_space_then_resume(tmp_path, monkeypatch, failure):
    """What a full disk raises where a file is written (an OSError, torch.save's RuntimeError) is one
    CheckpointWriteError naming the file: the staging goes, the newest complete checkpoint stays."""
    m, _ = member(0)
    stage_members(tmp_path, 2, [m], save_optimizer=True)
    finalize_when_staged(tmp_path, 2, {"members": [m.name]}, keep_last=2)

    def full(*args, **kwargs):
        raise failure

    monkeypatch.setattr(checkpoint.torch, "save", full)
    said = (r"checkpoint step-4 could not be written into .*checkpoints \(.*optimizer.pt: .*\); the newest complete "
            r"checkpoint, step-2, is intact: free space, then --resume")
    with pytest.raises(CheckpointWriteError, match=said) as caught:
        stage_members(tmp_path, 4, [m], save_optimizer=True)
    assert not checkpoint.staging_dir(tmp_path, 4).exists() and [s for s, _ in complete_checkpoints(tmp_path)] == [2]
    assert caught.value.__cause__.__cause__ is failure  # the write's own error stays in the chain, under the file's


def test_a_full_disk_at_the_first_checkpoint_says_there_is_none_to_resume_from(tmp_path, monkeypatch):
    """It said "free space, then --resume" where there was nothing to continue from (issue 78, finding 8)."""
    m, _ = member(0)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(CheckpointWriteError) as caught:
        stage_members(tmp_path, 2, [m], save_optimizer=True)
    assert str(caught.value).endswith("the run has no complete checkpoint yet, so nothing to continue from: free "
                                      "space, then start it again (the same command, without --resume)")
    assert not checkpoint.staging_dir(tmp_path, 2).exists()


def test_a_programming_error_while_a_checkpoint_is_written_is_raised_as_itself_never_as_a_full_disk(tmp_path,
                                                                                                     monkeypatch):
    """Only what a write raises says "free space": an AttributeError in save_member (in a write, or a RuntimeError
    outside the writes) reaches the caller with its type and message."""
    m, _ = member(0)

    def broken(*args, **kwargs):
        raise AttributeError("'Member' object has no attribute 'leads'")

    monkeypatch.setattr(checkpoint, "save_member", broken)
    with pytest.raises(AttributeError, match="has no attribute 'leads'"):
        stage_members(tmp_path, 2, [m], save_optimizer=True)
    monkeypatch.undo()
    monkeypatch.setattr(m.tokenizer, "save_pretrained", broken)  # inside a write: still this code's own error
    with pytest.raises(AttributeError, match="has no attribute 'leads'"):
        stage_members(tmp_path, 4, [m], save_optimizer=True)
    monkeypatch.undo()

    def unlucky():
        raise RuntimeError("not a write")

    monkeypatch.setattr(checkpoint, "rng_state", unlucky)
    with pytest.raises(RuntimeError, match="^not a write$"):
        stage_members(tmp_path, 6, [m], save_optimizer=True)


def test_a_step_is_complete_only_when_every_member_has_staged_it(tmp_path):
    a, _ = member(0)
    b, _ = member(1)
    state = {"members": [a.name, b.name]}
    stage_members(tmp_path, 2, [a], save_optimizer=False)
    assert finalize_when_staged(tmp_path, 2, state, keep_last=2) is None and complete_checkpoints(tmp_path) == []
    stage_members(tmp_path, 2, [b], save_optimizer=False)
    final = finalize_when_staged(tmp_path, 2, state, keep_last=2)
    assert final == tmp_path / "checkpoints" / "step-2"
    assert json.loads((final / "state.json").read_text()) == {"members": [a.name, b.name], "step": 2}
    for step in (4, 6):
        stage_members(tmp_path, step, [a, b], save_optimizer=False)
        finalize_when_staged(tmp_path, step, state, keep_last=2)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [4, 6]  # keep_last


def test_a_checkpoint_is_on_the_disk_before_it_is_complete_and_before_older_ones_are_pruned(tmp_path, monkeypatch):
    """Every file and directory of a step is fsynced before the rename that completes it, and the rename before the
    previous checkpoint is pruned (keep_last 1): a power loss never leaves truncated files as the only checkpoint."""
    from ftis_engine.model import checkpoint

    a, _ = member(0)
    events = []
    real_fsync, real_rmtree = os.fsync, checkpoint.shutil.rmtree
    monkeypatch.setattr(checkpoint.os, "fsync", lambda fd: events.append(("sync", os.readlink(f"/proc/self/fd/{fd}")))
                        or real_fsync(fd))
    monkeypatch.setattr(checkpoint.shutil, "rmtree", lambda path, **kw: events.append(("prune", str(path)))
                        or real_rmtree(path, **kw))
    for step in (1, 2):
        stage_members(tmp_path, step, [a], save_optimizer=True)
        staged = sorted(str(p) for p in (tmp_path / "checkpoints" / f".tmp-step-{step}").rglob("*"))
        events.clear()
        checkpoint.finalize_checkpoint(tmp_path, step, {"members": [a.name]}, keep_last=1)
        synced = [path for kind, path in events if kind == "sync"]
        assert set(staged) <= set(synced)  # every file and directory written, state.json included
        root = str(tmp_path / "checkpoints")
        assert root in synced  # the rename
        if step == 2:
            pruned = events.index(("prune", str(tmp_path / "checkpoints" / ".pruned-step-1")))
            assert events.index(("sync", root)) < pruned
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2]


def test_a_prune_cut_short_never_leaves_a_complete_looking_checkpoint_with_files_missing(tmp_path, monkeypatch):
    """A prune killed halfway through deleting step-1 (keep_last 1): step-1 no longer counts as complete (it was
    renamed away first), and the next clean-up removes what is left of it."""
    from ftis_engine.model import checkpoint

    a, _ = member(0)
    for step in (1, 2):
        stage_members(tmp_path, step, [a], save_optimizer=False)
        if step == 2:
            def killed(path, **kwargs):  # deletes one file, then the process dies
                next(p for p in pathlib.Path(path).rglob("*") if p.is_file()).unlink()
                raise KeyboardInterrupt
            monkeypatch.setattr(checkpoint.shutil, "rmtree", killed)
            with pytest.raises(KeyboardInterrupt):
                checkpoint.finalize_checkpoint(tmp_path, step, {"members": [a.name]}, keep_last=1)
            monkeypatch.undo()
        else:
            checkpoint.finalize_checkpoint(tmp_path, step, {"members": [a.name]}, keep_last=1)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2]
    checkpoint.clear_staging(tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if not p.name.startswith(".finalize")) == \
        ["step-2"]


@pytest.mark.slow
def test_a_full_disk_while_a_checkpoint_is_written_is_one_line_and_resume_works_once_space_is_free(tmp_path):
    """On a small tmpfs (needs root; skipped otherwise): the run checkpoints step 2, the disk is then filled to all
    but 200 kB, and the resumed run's step-4 checkpoint cannot be written: exit 1, one line, no traceback, no
    staging left, step-2 intact. With the space freed, --resume finishes the run."""
    import os
    import subprocess
    import sys

    from .helpers import SHORT, TINY

    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        def train(steps: int, *extra: str) -> subprocess.CompletedProcess:
            args = ["train", "--config", str(TINY), "--output-dir", str(disk)]
            for override in [*SHORT, "eval.every=0", "eval.at_start=false", f"train.steps={steps}",
                             "checkpoint.keep_last=1"]:
                args += ["--set", override]
            return subprocess.run([sys.executable, "-m", "ftis_engine", *args, *extra], capture_output=True,
                              text=True, timeout=300)

        assert train(2).returncode == 0
        stat = os.statvfs(disk)
        filler = disk / "filler"
        filler.write_bytes(b"\0" * (stat.f_bavail * stat.f_frsize - 200_000))
        full = train(4, "--resume")
        assert full.returncode == 1, full.stderr
        assert "Traceback" not in full.stderr
        error = [line for line in full.stderr.splitlines() if line.startswith("error:")]
        assert len(error) == 1 and "step-2, is intact: free space, then --resume" in error[0], full.stderr
        root = disk / "tiny" / "checkpoints"
        assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".finalize")) == ["step-2"]
        filler.unlink()
        assert train(4, "--resume").returncode == 0
        assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-4"]
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the devices differ only on a GPU")
def test_a_restored_optimizer_keeps_adams_step_count_on_the_cpu_and_its_moments_on_the_gpu(tmp_path):
    """As torch's own Adam keeps them: a step count restored onto the GPU would cost a device sync per tensor and
    step."""
    from ftis_engine.member.members import build_member
    from ftis_engine.run.preflight import check_members
    from ftis_engine.model.update import update_member
    from ftis_kernels import LossConfig

    from .helpers import random_items, short_config

    cfg = short_config()
    m = build_member(0, cfg, check_members(cfg)[0], torch.device("cuda"))
    update_member(m, random_items(m.vocab_size), LossConfig(), 100_000, "torch")
    save_member(m, tmp_path / "ckpt" / "members" / m.name, save_optimizer=True)
    restore_member(m, tmp_path / "ckpt", load_rng=False)
    states = list(m.optimizer.state.values())
    assert states and all(s["step"].device.type == "cpu" for s in states)
    assert all(s["exp_avg"].device.type == "cuda" for s in states)
