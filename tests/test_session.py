"""Opening a run (train, eval, a rank): checks before anything is written, and restoring checkpoints with one
clear line for every way a run directory can be unusable."""

from __future__ import annotations

import re
import shutil
import types

import pytest

from ftis_engine.run import loop as run, restore, rundir, session
from ftis_engine.config import ConfigError, dump_config
from ftis_engine.run.rundir import RunDirError, RunLock, check_fresh_run, check_resume_config, eval_config
from ftis_engine.run.session import AgreedError, Start, foreign_tokenizers, open_run
from ftis_engine.topology.layout import Role, Seat

from .helpers import short_config


def test_each_member_knows_which_peers_tokenise_otherwise_and_a_differing_copy_stops():
    from ftis_engine.model.models import load_tokenizer, vocabulary_hash

    config = short_config("members.1.model=builtin:tiny-m-bpe")
    char, bpe = load_tokenizer("builtin:tiny-s"), load_tokenizer("builtin:tiny-m-bpe")
    hashes = {0: vocabulary_hash(char), 1: vocabulary_hash(bpe)}
    foreign = foreign_tokenizers(config, {0: char, 1: bpe}, hashes)
    assert foreign[0] == {1: bpe} and foreign[1] == {0: char}
    assert foreign_tokenizers(config, {0: char, 1: char}, {0: hashes[0], 1: hashes[0]}) == {0: {}, 1: {}}
    with pytest.raises(ConfigError, match="members.1.model: this rank's copy of its tokenizer differs"):
        foreign_tokenizers(config, {0: char, 1: char}, hashes)


def test_a_new_run_never_writes_into_a_directory_that_holds_one(tmp_path):
    check_fresh_run(tmp_path, resume=False)  # empty: fine
    with pytest.raises(RunDirError, match="--resume: .* holds no run to continue"):
        check_fresh_run(tmp_path, resume=True)
    (tmp_path / "metrics.jsonl").write_text("")  # a run that failed before its first step: not a run
    check_fresh_run(tmp_path, resume=False)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')  # stopped before its first checkpoint: it starts over
    check_fresh_run(tmp_path, resume=False)
    check_fresh_run(tmp_path, resume=True)
    (tmp_path / "final_eval.json").write_text("[]")  # a run that finished (without checkpoints) is kept
    with pytest.raises(RunDirError, match="already holds a run; pass --resume"):
        check_fresh_run(tmp_path, resume=False)
    check_fresh_run(tmp_path, resume=True)
    with pytest.raises(AgreedError, match="already holds a run"):
        open_run(short_config(), Start(tmp_path))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A two-step run with a checkpoint at step 2."""
    run_dir = tmp_path_factory.mktemp("session") / "run"
    config = short_config("train.steps=2", "eval.every=0")
    swarm, start = open_run(config, Start(run_dir))
    assert start == 0
    run.train(swarm, start)
    assert (run_dir / "checkpoints" / "step-2" / "state.json").exists()
    return config, run_dir


def test_a_restart_resumes_by_design_where_a_fresh_start_is_refused(trained):
    """What test_swarm's torchrun restart test proves on processes (slow tier), in process through the one start-up
    (trainer.build): a start that is not a resume refuses a run directory holding a run; an elastic restart
    (Start.restarted) skips that check and resumes from the newest checkpoint."""
    from ftis_engine.run.trainer import build

    config, run_dir = trained
    with pytest.raises(AgreedError, match="already holds a run"):
        build(config, Start(run_dir))
    trainer = build(config, Start(run_dir, restarted=True))
    trainer.swarm.close()
    assert trainer.start_step == 2 and trainer.swarm.role.writes_run and not trainer.swarm.role.independent


def test_resume_restores_the_newest_checkpoint_and_eval_the_given_one(trained, tmp_path, monkeypatch):
    config, run_dir = trained
    checked = []
    monkeypatch.setattr(session, "check_model", lambda member: checked.append(member.index))
    swarm, step = open_run(config, Start(run_dir, resume=True))
    swarm.close()
    assert step == 2 and checked == [0, 1]  # training checks the update's packing once per member
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    swarm, step = open_run(config, Start(copy, checkpoint=copy / "checkpoints" / "step-2"))
    assert checked == [0, 1]  # eval only generates: no check (with train.layers=compile it would compile)
    swarm.close()
    assert step == 2


@pytest.mark.parametrize("damage, message", [
    (lambda ckpt: (ckpt / "state.json").write_text("{not json"), "unreadable state.json"),
    (lambda ckpt: (ckpt / "state.json").unlink(), "unreadable state.json"),
    (lambda ckpt: shutil.rmtree(next(p for p in ckpt.iterdir() if p.is_dir())), "cannot load member"),
    (lambda ckpt: [f.write_bytes(f.read_bytes()[:100]) for f in ckpt.rglob("*.safetensors")],
     "cannot load member"),
    (lambda ckpt: [f.unlink() for f in ckpt.rglob("adapter_model.safetensors")], "cannot load member 'tiny-m-lora'"),
])
def test_an_unusable_checkpoint_is_one_line_naming_it(trained, tmp_path, damage, message):
    config, run_dir = trained
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    ckpt = copy / "checkpoints" / "step-2"
    damage(ckpt)
    with pytest.raises(RunDirError, match=message) as caught:
        open_run(config, Start(copy, checkpoint=ckpt))
    assert str(ckpt) in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("missing", ["optimizer.pt", "rng.pt"])
def test_a_resume_without_the_optimizer_or_rng_state_is_refused_naming_the_file_and_eval_needs_neither(
        trained, tmp_path, missing):
    """An exact resume continues Adam's moments and the sampling streams: a checkpoint without them is refused
    (it would silently restart Adam from zero), while eval, which loads only the weights, still works."""
    config, run_dir = trained
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    gone = copy / "checkpoints" / "step-2" / "members" / "tiny-s" / missing
    gone.unlink()
    with pytest.raises(RunDirError, match=re.escape(f"cannot load member 'tiny-s' (FileNotFoundError: {gone} is "
                                                    "missing (an exact resume needs it))")):
        open_run(config, Start(copy, resume=True))
    swarm, step = open_run(config, Start(copy, checkpoint=copy / "checkpoints" / "step-2"))
    swarm.close()
    assert step == 2


def test_a_checkpoint_file_that_would_run_code_is_refused_without_torchs_advice_to_load_it_unsafely(trained, tmp_path):
    import os

    config, run_dir = trained
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    with open(copy / "checkpoints" / "step-2" / "members" / "tiny-s" / "rng.pt", "wb") as f:
        __import__("pickle").dump({"torch": os.getcwd}, f)  # a callable: weights_only refuses it
    with pytest.raises(RunDirError, match=r"cannot load member 'tiny-s' \(UnpicklingError: it holds pickled objects "
                                          r"other than tensors and plain values; refused unread") as caught:
        open_run(config, Start(copy, resume=True))
    assert "weights_only" not in str(caught.value)


@pytest.mark.parametrize("restore, loader", [
    (lambda m, ckpt: restore.restore_into(m, ckpt, "--resume: checkpoint", True, True), "restore_member"),
    (lambda m, ckpt: restore.restore_shard(m, ckpt, "--resume: checkpoint"), "restore_optimizer_shard")])
def test_a_programming_error_while_restoring_is_raised_as_itself_not_as_an_unloadable_member(
        trained, monkeypatch, restore, loader):
    """What a checkpoint's files raise (a missing file: OSError) is "cannot load member"; an AttributeError in the
    loading code is this code's own and reaches the caller with its type and message."""
    from types import SimpleNamespace

    _, run_dir = trained
    ckpt = run_dir / "checkpoints" / "step-2"
    m = SimpleNamespace(name="tiny-s", generator=SimpleNamespace(sync=lambda model: None), model=None)

    def raising(error):
        def load(*args, **kwargs):
            raise error
        return load

    monkeypatch.setattr(f"ftis_engine.run.restore.{loader}", raising(FileNotFoundError(2, "No such file or directory", "optimizer.pt")))
    with pytest.raises(RunDirError, match=rf"--resume: checkpoint {re.escape(str(ckpt))}: cannot load member "
                                          r"'tiny-s'.*\(FileNotFoundError: "):
        restore(m, ckpt)
    monkeypatch.setattr(f"ftis_engine.run.restore.{loader}", raising(AttributeError("'Member' object has no attribute 'shard'")))
    with pytest.raises(AttributeError, match="has no attribute 'shard'"):
        restore(m, ckpt)


def test_a_checkpoint_state_of_another_form_is_one_line_naming_its_file(trained, tmp_path):
    """rng.pt holding a list where a dict was saved: torch and random raise TypeError there, the file's fault."""
    import torch

    config, run_dir = trained
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    rng = copy / "checkpoints" / "step-2" / "members" / "tiny-s" / "rng.pt"
    torch.save([1, 2], rng)
    with pytest.raises(RunDirError, match=rf"cannot load member 'tiny-s' \(ValueError: {re.escape(str(rng))}: does "
                                          r"not hold an RNG state \(TypeError: "):
        open_run(config, Start(copy, resume=True))


def test_an_adapter_that_does_not_fit_the_member_is_refused_instead_of_resuming_a_fresh_one(trained, tmp_path):
    """set_peft_model_state_dict loads what matches and ignores the rest: an adapter saved for other modules would
    leave the member's own adapter at its fresh init. It is refused, naming the file."""
    from safetensors.torch import load_file, save_file

    config, run_dir = trained
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    adapter = copy / "checkpoints" / "step-2" / "members" / "tiny-m-lora" / "model" / "adapter_model.safetensors"
    weights = load_file(adapter)
    save_file({k.replace("q_proj", "x_proj"): v for k, v in weights.items()}, adapter)
    with pytest.raises(RunDirError, match=r"cannot load member 'tiny-m-lora' \(.*adapter_model.safetensors does not "
                                          r"fit members.1 \(tiny-m-lora\)'s adapter \(\d+ of its weights missing"):
        open_run(config, Start(copy, resume=True))


def test_a_checkpoint_pruned_while_it_is_read_says_so_and_names_the_newest(trained, tmp_path, monkeypatch):
    from ftis_engine.model import checkpoint as checkpoints

    config, run_dir = trained
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    older, newest = copy / "checkpoints" / "step-1", copy / "checkpoints" / "step-2"
    shutil.copytree(newest, older)
    honest = checkpoints.read_state

    def read_while_pruned(checkpoint):  # a running training's prune removes it between listing and reading
        shutil.rmtree(checkpoint)
        return honest(checkpoint)

    monkeypatch.setattr("ftis_engine.run.restore.read_state", read_while_pruned)
    with pytest.raises(RunDirError, match=re.escape("it was removed while being read") + ".*" +
                       re.escape(f"the newest complete one now is {newest}: retry with it")):
        open_run(config, Start(copy, checkpoint=older))


def test_a_second_run_into_a_held_directory_stops_naming_the_holder(tmp_path):
    run_dir = tmp_path / "out" / "run"
    with RunLock(run_dir):
        assert "pid" in (run_dir / ".lock").read_text()
        with pytest.raises(RunDirError, match=r"is in use by another run \(pid \d+ on .* since "):
            with RunLock(run_dir):
                pass
    assert not (tmp_path / "out").exists()  # nothing was written: the directories it created are gone again
    with RunLock(run_dir):  # free again
        (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    assert (run_dir / "metrics.jsonl").exists()  # a run's files stay
    with RunLock(tmp_path / "study", kind="study"):
        with pytest.raises(RunDirError, match=r"^--output-dir: .* is in use by another study \(pid \d+ .*choose "
                                              r"another --output-dir$"):
            with RunLock(tmp_path / "study", kind="study"):
                pass


def test_resume_refuses_a_config_that_changes_the_run_but_not_its_length_or_cadence(trained):
    config, run_dir = trained
    check_resume_config(run_dir, config.model_copy(update={"seed": 0}))
    longer = short_config("train.steps=5", "eval.every=0", "eval.max_samples=4", "checkpoint.every=1")
    check_resume_config(run_dir, longer)
    for override, field in (("members.0.betas=[0.8, 0.9]", "members.0.betas.0"),
                            ("rollout.group_size=3", "rollout.group_size"), ("algorithm.method=tis", "algorithm.method")):
        with pytest.raises(RunDirError, match=f"--resume: the config differs .* in {field} ") as caught:
            check_resume_config(run_dir, short_config("train.steps=2", "eval.every=0", override))
        assert all(key in str(caught.value) for key in rundir.RESUMABLE)  # the message lists what may change


def test_a_resume_may_lengthen_a_constant_schedule_but_not_one_that_decays_over_train_steps(trained, tmp_path):
    """Extending a cosine run from 2 to 5 steps would move its schedule (the rate jumps at the resumed step):
    refused, naming train.steps; a constant one may grow."""
    config, run_dir = trained
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    cosine = ("train.lr_schedule=cosine", "eval.every=0")
    saved = short_config("train.steps=2", *cosine)
    (copy / "config.yaml").write_text(dump_config(saved))
    check_resume_config(copy, saved)
    with pytest.raises(RunDirError, match=r"^--resume: train.steps 2 -> 5 would move the cosine learning-rate "
                                          r"schedule"):
        check_resume_config(copy, short_config("train.steps=5", *cosine))
    check_resume_config(run_dir, short_config("train.steps=5", "eval.every=0"))  # constant: fine


def test_after_an_out_of_memory_crash_a_resume_may_move_the_run_or_shrink_its_memory(trained):
    """Device, an engine's share of the GPU, recompute and the completions logged change memory and speed, not the
    update: a resumed run may change them."""
    config, run_dir = trained
    check_resume_config(run_dir, short_config("train.steps=2", "eval.every=0", "members.0.device=cpu",
                                              "members.1.vllm.gpu_memory_utilization=0.2",
                                              f"train.gradient_checkpointing={not config.train.gradient_checkpointing}",
                                              "logging.completions=3"))


def test_a_file_system_without_locks_is_said_as_such_not_as_a_run_in_the_way(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(RunDirError, match=r"^run_name: cannot lock .*\.lock \(No locks available\): its file system "
                                          r"takes no flock"):
        with RunLock(tmp_path / "run"):
            pass


def test_eval_uses_the_runs_own_config_and_refuses_one_that_builds_other_models(trained):
    config, run_dir = trained
    assert eval_config(run_dir, None) == config  # config.yaml beside the checkpoints
    assert eval_config(run_dir, short_config("train.steps=2", "eval.max_samples=3")).eval.max_samples == 3
    assert eval_config(run_dir, None, ["eval.max_samples=3"]).eval.max_samples == 3  # --set on the run's own
    with pytest.raises(RunDirError, match=re.escape("--set: builds other models than the run trained (seed (0 -> 1)")):
        eval_config(run_dir, None, ["seed=1"])  # the --set is named, not a --config nobody gave
    for override, field in (("seed=1", "seed"), ("members.1.lora.target_modules=[q_proj]",
                                                 "members.1.lora.target_modules"), ("members.0.seed=9", "members.0.seed")):
        with pytest.raises(RunDirError, match=re.escape(f"--config: builds other models than the run trained ({field} ")):
            eval_config(run_dir, short_config("train.steps=2", "eval.every=0", override))


def test_a_run_that_fails_to_open_closes_the_generators_it_built(trained, tmp_path, monkeypatch):
    from ftis_engine.run import session

    config, run_dir = trained
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    for f in (copy / "checkpoints" / "step-2").rglob("adapter_model.safetensors"):
        f.unlink()  # the second member cannot be restored, after both were built
    closed = []
    monkeypatch.setattr(session, "close_generators", lambda members: closed.extend(m.name for m in members))
    with pytest.raises(RunDirError, match="cannot load member 'tiny-m-lora'"):
        open_run(config, Start(copy, checkpoint=copy / "checkpoints" / "step-2"))
    assert closed == ["tiny-s", "tiny-m-lora"]  # a vLLM engine would otherwise hold its GPU memory


def test_a_run_that_fails_before_its_first_step_closes_its_generators_once(tmp_path, monkeypatch):
    """The Trainer closes the members' generators however the run ends, its start included: an exchange that fails
    to start (an open swarm's coordinator that never answers) left them open (a vLLM engine holds a GPU)."""
    from ftis_engine.run.trainer import Learner, build

    closed = []
    monkeypatch.setattr(session.Swarm, "close", lambda self: closed.append(True))
    trainer = build(short_config(), Start(tmp_path / "run"))
    assert type(trainer) is Learner and closed == []

    def unanswered(*args, **kwargs):
        raise TimeoutError("no coordinator answered within 5 s")

    monkeypatch.setattr(trainer.swarm.exchange, "start", unanswered)
    with pytest.raises(TimeoutError, match="no coordinator answered"), trainer:
        trainer.run()
    assert closed == [True]
    trainer.close()  # closing again closes nothing twice
    assert closed == [True]


def test_a_learner_closes_its_generators_before_the_run_is_marked_finished(tmp_path, monkeypatch):
    """final_eval.json is what a study takes for a finished run: it is written after the generators closed, so a
    close that fails (a vLLM engine that does not go) leaves a run that is not marked finished."""
    from ftis_engine.run import records
    from ftis_engine.run.trainer import Start as TrainerStart, run as run_trainer

    events = []
    monkeypatch.setattr(session.Swarm, "close", lambda self: events.append("close"))
    finish = records.SharedRecords.finish
    monkeypatch.setattr(records.SharedRecords, "finish",
                        lambda self, final: (events.append("finish"), finish(self, final)))
    run_dir = tmp_path / "run"
    run_trainer(short_config("train.steps=1", "eval.at_start=false", "eval.max_samples=2", "checkpoint.every=0"),
                TrainerStart(run_dir))
    assert events == ["close", "finish"] and (run_dir / "final_eval.json").is_file()

    def failing(self):
        raise RuntimeError("the engine did not go")

    monkeypatch.setattr(session.Swarm, "close", failing)
    again = tmp_path / "again"
    with pytest.raises(RuntimeError, match="the engine did not go"):
        run_trainer(short_config("train.steps=1", "eval.at_start=false", "eval.max_samples=2", "checkpoint.every=0"),
                    TrainerStart(again))
    assert (again / "metrics.jsonl").is_file() and not (again / "final_eval.json").exists()


@pytest.mark.parametrize("role", ["learner", "sampler", "evaluator"])
def test_the_trainer_of_each_role_runs_its_work_and_closes_the_generators_once_however_it_ends(role, monkeypatch,
                                                                                               tmp_path):
    """build chooses the Trainer from the role once (Learner, Sampler, Evaluator); trainer.run is the one start-up
    every entry point calls, and the generators close once whether the work returns or raises."""
    import dataclasses

    from ftis_engine.run import trainer as trainer_module

    closed, ran = [], []
    work = {"learner": "train", "sampler": "run_sampler", "evaluator": "evaluate_all"}[role]

    def fake_open_run(config, start, connection=None):
        swarm = types.SimpleNamespace(role=dataclasses.replace(
            Role(), evaluating=role == "evaluator",
            seat=Seat(0, 0, 0, 1) if role == "sampler" else None),
            exchange=types.SimpleNamespace(collectives=types.SimpleNamespace(gather_records=lambda r: r)),
            close=lambda: closed.append(True))
        return swarm, 3

    def doing(*args, **kwargs):
        ran.append(args[1])
        if fail:
            raise RuntimeError("a bug")
        return [{"member": "a"}]

    monkeypatch.setattr(trainer_module, "open_run", fake_open_run)
    monkeypatch.setattr(trainer_module, work, doing)
    kinds = {"learner": trainer_module.Learner, "sampler": trainer_module.Sampler,
             "evaluator": trainer_module.Evaluator}
    assert type(trainer_module.build(None, None)) is kinds[role]
    for fail in (False, True):
        closed.clear()
        emitted = []
        if fail:
            with pytest.raises(RuntimeError, match="a bug"):
                trainer_module.run(None, None, emit=emitted.append)
        else:
            records = trainer_module.run(None, None, emit=emitted.append)
            assert records == ([] if role == "sampler" else [{"member": "a"}])
            assert emitted == ([{"member": "a"}] if role == "evaluator" else [])  # eval: rank 0 prints them
        assert closed == [True]  # eval: after its records were emitted (emitted is checked before the close too)
    assert ran == [3, 3]  # each started after the step it opened at


def test_a_run_that_fails_to_open_after_its_members_are_built_closes_their_generators(trained, tmp_path,
                                                                                       monkeypatch):
    """A receiver's kept state (screen.json, admission.json) that does not load fails the open after every member
    was built: their generators are closed too (a vLLM engine holds a GPU), as when a member fails."""
    config, run_dir = trained
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    closed = []
    monkeypatch.setattr(session, "close_generators", lambda members: closed.extend(m.name for m in members))

    def unreadable(receivers, members, source, config):
        raise RunDirError(f"--resume: {source}/screen.json: not a screen state")

    monkeypatch.setattr(session, "resume_screens", unreadable)
    with pytest.raises(RunDirError, match="not a screen state"):
        open_run(config, Start(copy, resume=True))
    assert closed == ["tiny-s", "tiny-m-lora"]


def test_a_resume_that_would_end_before_its_checkpoint_is_refused(trained, tmp_path):
    config, run_dir = trained
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    shorter = short_config("train.steps=1", "eval.every=0")
    with pytest.raises(RunDirError, match=r"^train.steps: 1 is below step 2 of the checkpoint a resume continues "
                                          r"from; a resume can only go on"):
        open_run(shorter, Start(copy, resume=True))


def test_without_config_yaml_the_checkpoints_own_record_decides_what_a_resume_may_change(trained, tmp_path):
    import json

    config, run_dir = trained
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    (copy / "config.yaml").unlink()
    check_resume_config(copy, short_config("train.steps=4", "eval.every=0"))  # a longer run: allowed
    with pytest.raises(RunDirError, match=r"--resume: the config differs .* in rollout.group_size "):
        check_resume_config(copy, short_config("train.steps=2", "eval.every=0", "rollout.group_size=3"))
    state = copy / "checkpoints" / "step-2" / "state.json"
    record = json.loads(state.read_text())
    del record["config"]  # a checkpoint of an older version: no record, no config.yaml
    state.write_text(json.dumps(record))
    with pytest.raises(RunDirError, match=r"has no config.yaml and its newest checkpoint records no config"):
        check_resume_config(copy, config)


@pytest.mark.parametrize("step", [-3, 100, True])
def test_a_state_json_whose_step_is_not_its_directorys_is_refused(trained, tmp_path, step):
    import json

    config, run_dir = trained
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    state = copy / "checkpoints" / "step-2" / "state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "step": step}))
    with pytest.raises(RunDirError, match=rf"its state.json says step {step!r}, its directory step-2"):
        open_run(config, Start(copy, checkpoint=copy / "checkpoints" / "step-2"))


def test_after_a_divergence_a_resume_may_lower_the_step_size_and_the_restored_optimizer_takes_it(trained, tmp_path):
    """The divergence message says to --resume with a smaller step: a resume may change members.N.lr, grad_clip and
    weight_decay, and the restored Adam uses the config's lr and weight decay, not the ones it saved."""
    config, run_dir = trained
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    lower = short_config("train.steps=3", "eval.every=0", "members.0.lr=1e-5", "members.1.grad_clip=0.5",
                         "members.0.weight_decay=0.01", "members.0.optimizer=adam")
    check_resume_config(copy, lower)
    swarm, step = open_run(lower, Start(copy, resume=True))
    try:
        groups = swarm.members[0].optimizer.param_groups
        assert step == 2 and groups[0]["lr"] == 1e-5 and groups[0]["weight_decay"] == 0.01
        assert any(swarm.members[0].optimizer.state.values())  # Adam's moments came back
    finally:
        swarm.close()
