"""Opening a run (train, eval, a rank): checks before anything is written, and restoring checkpoints with one
clear line for every way a run directory can be unusable."""

from __future__ import annotations

import shutil

import pytest

from ftis_engine import run
from ftis_engine.session import AgreedError, RunDirError, check_fresh_run, check_shared_vocabulary, open_run

from .helpers import short_config


def test_members_must_share_one_vocabulary_and_the_first_other_is_named():
    check_shared_vocabulary({0: "a", 1: "a", 2: "a"})
    with pytest.raises(AgreedError, match="members.2.model: its tokenizer vocabulary differs from members.0's"):
        check_shared_vocabulary({0: "a", 1: "a", 2: "b", 3: "b"})


def test_a_new_run_never_writes_into_a_directory_that_holds_one(tmp_path):
    check_fresh_run(tmp_path, resume=False)  # empty: fine
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(RunDirError, match="already holds a run; pass --resume"):
        check_fresh_run(tmp_path, resume=False)
    check_fresh_run(tmp_path, resume=True)
    with pytest.raises(AgreedError, match="already holds a run"):
        open_run(short_config(), tmp_path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A two-step run with a checkpoint at step 2."""
    run_dir = tmp_path_factory.mktemp("session") / "run"
    config = short_config("train.steps=2", "eval.every=0")
    swarm, start = open_run(config, run_dir)
    assert start == 0
    run.train(swarm, start)
    assert (run_dir / "checkpoints" / "step-2" / "state.json").exists()
    return config, run_dir


def test_resume_restores_the_newest_checkpoint_and_eval_the_given_one(trained, tmp_path):
    config, run_dir = trained
    swarm, step = open_run(config, run_dir, resume=True)
    swarm.close()
    assert step == 2
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    swarm, step = open_run(config, copy, checkpoint=copy / "checkpoints" / "step-2")
    swarm.close()
    assert step == 2


@pytest.mark.parametrize("damage, message", [
    (lambda ckpt: (ckpt / "state.json").write_text("{not json"), "unreadable state.json"),
    (lambda ckpt: (ckpt / "state.json").unlink(), "unreadable state.json"),
    (lambda ckpt: shutil.rmtree(next(p for p in ckpt.iterdir() if p.is_dir())), "cannot load member"),
    (lambda ckpt: [f.write_bytes(f.read_bytes()[:100]) for f in ckpt.rglob("*.safetensors")],
     "cannot load member"),
])
def test_an_unusable_checkpoint_is_one_line_naming_it(trained, tmp_path, damage, message):
    config, run_dir = trained
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    ckpt = copy / "checkpoints" / "step-2"
    damage(ckpt)
    with pytest.raises(RunDirError, match=message) as caught:
        open_run(config, copy, checkpoint=ckpt)
    assert str(ckpt) in str(caught.value) and "\n" not in str(caught.value)
