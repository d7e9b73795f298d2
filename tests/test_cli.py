"""The command line: errors are one line with exit code 2 and nothing written; --dry-run prints the config."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import yaml

from .helpers import command_here, run_records

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"


def cli(*args, cwd=None, timeout=300):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "ftis_engine", *map(str, args)], capture_output=True, text=True,
                      cwd=cwd, timeout=timeout, env=env)


@pytest.mark.slow
def test_dry_run_prints_the_resolved_config(tmp_path):
    result = cli("train", "--config", TINY, "--set", "algorithm.kl_threshold=5", "--dry-run", "--output-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert resolved["algorithm"]["kl_threshold"] == 5 and resolved["output_dir"] == str(tmp_path)
    assert not any(tmp_path.iterdir())


def test_dry_run_prints_the_resolved_config_in_this_process(tmp_path, capsys):
    """The idea of the slow tier's test above (a real command), in the unit tier: cli.main in this process."""
    result = command_here(capsys, "train", "--config", TINY, "--set", "algorithm.kl_threshold=5", "--dry-run",
                          "--output-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert resolved["algorithm"]["kl_threshold"] == 5 and resolved["output_dir"] == str(tmp_path)
    assert not any(tmp_path.iterdir())


BAD = [
    (["--set", "algorithm.method=ppo"], "algorithm.method"),
    (["--set", "members.0.lr=abc"], "members.0.lr"),
    (["--set", "members.3.lr=1"], "members.3"),
    (["--set", "rollout.group_sized=3"], "rollout.group_sized"),
    (["--set", "members.0.model=/no/such/model"], "members.0.model"),
    (["--set", "members.0.model=builtin:tiny-xxl"], "members.0.model"),
    (["--set", "data.task=sudoku"], "data.task"),
    (["--set", "data.task=gsm8k", "--set", "data.train_path=/no/such.jsonl"], "data.train_path"),
    (["--set", "members.0.generator=vllm"], "members.0.generator"),
    (["--set", "train.device=cuda"], "train.device"),
    (["--set", "members.1.lora.target_modules=[no_such_proj]"], "members.1.lora.target_modules"),
    (["--set", "data.reward=no_such_module:f"], "data.reward"),
    (["--set", "members.0.betas=[1.5,0.999]"], "members.0.betas.0"),
    (["--set", "seed=99999999999999999999"], "seed"),
    (["--set", "members.0.lr=.inf"], "members.0.lr"),
    (["--output-dir", "/dev/null/runs"], "output_dir"),
    (["--set", "rollout.temperature=1e-300"], "rollout.temperature"),
    (["--set", "train.threads=100000"], "train.threads"),
    (["--set", "members.1.lora.r=1000000000"], "members.1.lora.r"),
    (["--set", "swarm.timeout_s=.inf"], "swarm.timeout_s"),
    (["--set", "train.attn_implementation=flex_attention"], "train.attn_implementation"),
    (["--set", "train.attn_implementation=flash_attention_2"], "train.attn_implementation"),
    (["--set", "train.device=meta"], "train.device"),
    (["--set", "members.0.device=meta"], "members.0.device"),
    (["--set", "data.system_prompt=Think: then answer.", "--set", "members.0.lr=yes"], "members.0.lr"),
    (["--output-dir", "/tmp/" + "x" * 300], "x" * 255),
]


@pytest.mark.parametrize("extra, field", BAD, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD)])
def test_bad_config_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, extra, field):
    """In this process (the command's own error handling; an unexpected exception fails the test with its traceback);
    the next test runs two of them as the command itself."""
    result = command_here(capsys, "train", "--config", TINY, "--output-dir", tmp_path / "out", *extra)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and field in lines[0], result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, field", [pytest.param(*BAD[1], id="members.0.lr", marks=pytest.mark.integration),
                                          pytest.param(*BAD[-2], id="system_prompt", marks=pytest.mark.slow)])
def test_bad_config_as_a_command_exits_2_with_one_line_and_no_traceback(tmp_path, extra, field):
    result = cli("train", "--config", TINY, "--output-dir", tmp_path / "out", *extra)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0] and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_missing_or_broken_config_file(tmp_path, capsys):
    for args in (["train", "--config", tmp_path / "nope.yaml"], ["train"], ["plot", tmp_path / "nothing"]):
        result = command_here(capsys, *args)
        assert result.returncode == 2, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("run_name: [unclosed\n")
    result = command_here(capsys, "train", "--config", broken)
    assert result.returncode == 2 and "--config" in result.stderr


@pytest.mark.integration
def test_module_entry_point_and_help():
    result = cli("--help")
    assert result.returncode == 0 and "train" in result.stdout and "plot" in result.stdout
    result = cli("train", "--help")
    flags = [line for line in result.stdout.splitlines() if "--resume" in line or "--dry-run" in line]
    assert result.returncode == 0 and len(flags) == 2 and not any("<bool>" in line for line in flags)


@pytest.mark.slow
def test_triton_backend_on_cpu_is_refused_before_anything_is_written(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "ftis_engine", "train", "--config", str(TINY), "--output-dir",
                         str(tmp_path / "out"), "--set", "train.backend=triton"], capture_output=True, text=True,
                        env={**env, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}, timeout=300)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: train.backend: 'triton' needs CUDA tensors (got cpu); on CPU set TRITON_INTERPRET=1 before triton is "
        "imported, or use backend='torch' (train.device='auto' gives cpu here)"]
    assert not (tmp_path / "out").exists()


def test_plot_refuses_an_empty_log_and_resume_needs_a_run(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("")
    result = command_here(capsys, "plot", tmp_path)
    assert result.returncode == 2 and "metrics.jsonl holds no records yet" in result.stderr
    result = command_here(capsys, "train", "--config", TINY, "--output-dir", tmp_path / "out", "--resume")
    assert result.returncode == 2 and "holds no run to continue" in result.stderr
    assert not (tmp_path / "out").exists()


def _main_exit(monkeypatch, capsys, raise_in_step, tmp_path) -> tuple[int, str]:
    """Run `train` in this process with run_step replaced by `raise_in_step`; (exit code, stderr)."""
    from ftis_engine.run import loop as run

    monkeypatch.setattr(run, "run_step", raise_in_step)
    done = command_here(capsys, "train", "--config", TINY, "--output-dir", tmp_path, "--set", "eval.at_start=false",
                        "--set", "train.steps=2")
    return done.returncode, done.stderr


def test_a_divergence_is_one_line_with_exit_code_1(monkeypatch, capsys, tmp_path):
    from ftis_engine.model.update import DivergenceError

    def diverge(swarm, step):
        raise DivergenceError(f"step {step}: members.0 (tiny-s) diverged: the loss is nan")

    code, err = _main_exit(monkeypatch, capsys, diverge, tmp_path)
    assert code == 1 and err.strip().splitlines()[-1] == "error: step 1: members.0 (tiny-s) diverged: the loss is nan"
    assert "Traceback" not in err


def test_ctrl_c_is_one_line_with_exit_code_130(monkeypatch, capsys, tmp_path):
    def interrupt(swarm, step):
        raise KeyboardInterrupt

    code, err = _main_exit(monkeypatch, capsys, interrupt, tmp_path)
    assert code == 130 and err.strip().splitlines()[-1] == (
        "error: interrupted before the run's first checkpoint; nothing to continue from: rerun the same command to "
        "start it again")


@pytest.mark.slow
def test_a_run_that_fails_before_its_first_checkpoint_leaves_nothing_that_blocks_its_rerun(monkeypatch, capsys,
                                                                                           tmp_path):
    """A failure in step 1, after the step-0 eval wrote config.yaml, TensorBoard events and eval records: the rerun
    (plain, or with --resume and another config) starts over, the earlier log kept aside; a run that wrote a
    checkpoint still blocks a plain rerun, and a Ctrl-C then names its newest checkpoint."""

    from ftis_engine.app import cli as cli_module
    from ftis_engine.run import loop as run

    def fail(swarm, step):
        raise RuntimeError("a bug in step 1")

    args = ["train", "--config", str(TINY), "--output-dir", str(tmp_path), "--set", "train.steps=2", "--set",
            "eval.max_samples=4", "--set", "eval.every=0", "--set", "checkpoint.every=1"]
    honest = run.run_step
    monkeypatch.setattr(run, "run_step", fail)
    with pytest.raises(RuntimeError, match="a bug in step 1"):
        cli_module.main(args)
    run_dir = tmp_path / "tiny"
    assert (run_dir / "config.yaml").is_file() and (run_dir / "metrics.jsonl").stat().st_size > 0
    monkeypatch.setattr(run, "run_step", honest)
    for extra in (["--resume", "--set", "rollout.group_size=4"], []):  # both start over: nothing to continue
        with pytest.raises(SystemExit) as done:
            cli_module.main(args + extra)
        assert done.value.code == 0, capsys.readouterr().err
        if extra:  # as if that one too had stopped before its first checkpoint
            shutil.rmtree(run_dir / "checkpoints")
            (run_dir / "final_eval.json").unlink()
    kept = sorted(p.name for p in run_dir.glob("metrics.jsonl.*"))
    assert len(kept) == 2  # the failed start's log and the first rerun's, never deleted
    assert sorted({r["step"] for r in run_records(run_dir, "train")}) == [1, 2]
    with pytest.raises(SystemExit) as done:
        cli_module.main(args)  # now it has a checkpoint and its end: a plain rerun is refused
    assert done.value.code == 2 and "already holds a run; pass --resume" in capsys.readouterr().err

    def interrupt(swarm, step):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "run_step", interrupt)
    with pytest.raises(SystemExit) as done:
        cli_module.main(args[:5] + ["--set", "train.steps=3", "--set", "eval.max_samples=4", "--resume"])
    assert done.value.code == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: interrupted; the newest complete checkpoint (step 2) is intact: continue with --resume")


def test_ctrl_c_in_a_study_says_to_rerun_it_not_to_resume(monkeypatch, capsys, tmp_path):
    from ftis_engine.app import cli as cli_module

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("ftis_engine.study.run_study", interrupt)
    with pytest.raises(SystemExit) as done:
        cli_module.main(["study", "--config", str(ROOT / "configs" / "study" / "paper.yaml"), "--quick",
                         "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert done.value.code == 130 and err.startswith("error: interrupted; rerun the same command to continue")
    assert "--resume" not in err


def test_a_missing_vllm_is_reported_before_any_model_is_fetched(monkeypatch):
    from ftis_engine.run import preflight
    from ftis_engine.config import ConfigError, load_config

    monkeypatch.setattr(preflight, "check_model_spec", lambda spec: pytest.fail("a model was looked up first"))
    monkeypatch.setattr("ftis_engine.generation.vllm.check_available", lambda device=None: "vLLM is not installed (hint)")
    cfg = load_config(TINY, ["members.0.generator=vllm", "members.0.model=Some/HubModel"])
    with pytest.raises(ConfigError, match="members.0.generator: vLLM is not installed"):
        preflight.check_members(cfg)


def test_the_step_line_has_the_loss_in_three_digits_and_the_time_left():
    from ftis_engine.report.progress import summary_line

    record = {"kind": "train", "member": "a", "reward_mean": 0.5, "loss": -1.234e-7, "is_weight_mean": 0.91,
              "filtered_frac": 0.125}
    assert summary_line(3, 10, [record], 2.04, 754.0) == (
        "step 3/10 | a: reward 0.500 loss -1.23e-07 w 0.91 filt 0.12 | 2.0s/step, ETA 12m34s")
    assert summary_line(3, 10, [record]).endswith("filt 0.12")


@pytest.mark.slow
def test_a_config_that_is_a_directory_a_pipe_or_a_device_is_named_as_such(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    for path, said in ((tmp_path, "is a directory"), (tmp_path / "fifo", "is not a regular file"),
                       (pathlib.Path("/dev/null"), "is not a regular file"), (tmp_path / "none.yaml", "no such file")):
        result = cli("train", "--config", path, "--dry-run")
        assert result.returncode == 2 and f"--config {path}: {said}" in result.stderr, result.stderr


def test_a_config_that_is_a_directory_a_pipe_or_a_device_is_named_as_such_in_this_process(tmp_path, capsys):
    """The idea of the slow tier's test above (a real command), in the unit tier: cli.main in this process."""
    os.mkfifo(tmp_path / "fifo")
    for path, said in ((tmp_path, "is a directory"), (tmp_path / "fifo", "is not a regular file"),
                       (pathlib.Path("/dev/null"), "is not a regular file"), (tmp_path / "none.yaml", "no such file")):
        result = command_here(capsys, "train", "--config", path, "--dry-run")
        assert result.returncode == 2 and f"--config {path}: {said}" in result.stderr, result.stderr


@pytest.mark.slow
def test_eval_of_a_checkpoint_from_inside_it_needs_no_training_data_and_refuses_an_empty_dataset_list(tmp_path):
    from .helpers import SHORT

    args = ["train", "--config", TINY, "--output-dir", tmp_path]
    for override in [*SHORT, "train.steps=2", "eval.every=0", "eval.max_samples=4"]:
        args += ["--set", override]
    assert cli(*args).returncode == 0
    checkpoint = tmp_path / "tiny" / "checkpoints" / "step-2"
    inside = cli("eval", "--checkpoint", ".", cwd=checkpoint)
    assert inside.returncode == 0, inside.stderr
    assert {json.loads(x)["member"] for x in inside.stdout.splitlines() if x.startswith("{")} == {"tiny-s", "tiny-m-lora"}
    empty = cli("eval", "--checkpoint", checkpoint, "--set", "eval.datasets=[]")
    assert empty.returncode == 2 and "eval.datasets: empty, so there is nothing to evaluate" in empty.stderr


def test_a_task_read_from_files_loads_its_eval_sets_without_its_training_set_for_an_eval(shared_data):
    from ftis_engine.config import load_config
    from ftis_engine.data.tasks import load_task

    evals = f"data.eval_paths={{gsm8k-calc: {shared_data / 'gsm8k' / 'test.jsonl'}}}"
    config = load_config(TINY, ["data.task=gsm8k-calc", f"data.train_path={shared_data / 'gsm8k' / 'train.jsonl'}",
                                evals])
    task = load_task(config.data, 0, with_train=False)
    # the eval set an eval scores is the one training logged: steps that occur in training left out
    assert task.train == [] and task.evals == load_task(config.data, 0).evals
    missing = load_config(TINY, ["data.task=gsm8k-calc", "data.train_path=/no/such/train.jsonl", evals])
    whole = load_task(missing.data, 0, with_train=False).evals["gsm8k-calc"]  # said, and kept whole
    assert len(whole) > len(task.evals["gsm8k-calc"])


def _rows(path: pathlib.Path, offset: int) -> None:
    path.write_text("".join(json.dumps({"question": f"{(a + offset) % 10}+{a % 7}=", "answer": str((2 * a) % 10)})
                            + "\n" for a in range(12)))


def test_a_resume_on_changed_data_is_refused_and_with_allow_data_change_warned_and_marked(tmp_path, capsys, caplog):
    """train on a JSONL file, the file rewritten with other rows, then --resume: it went on on the other data
    without a word (the eval curve joining two sets as one). The run records its data files' sha256 (data.json); a
    resume whose data changed is refused naming the fields, and with --allow-data-change goes on, warned, every
    record from the resumed step carrying data_changed_at."""
    data = tmp_path / "data.jsonl"
    _rows(data, 0)
    args = ["train", "--config", TINY, "--output-dir", tmp_path / "runs", "--set", "data.task=jsonl", "--set",
            f"data.train_path={data}", "--set", f"data.eval_paths={{mine: {data}}}", "--set", "checkpoint.every=2",
            "--set", "eval.every=0", "--set", "eval.max_samples=4", "--set", "rollout.group_size=2", "--set",
            "rollout.prompts_per_step=2", "--set", "rollout.max_new_tokens=2"]
    assert command_here(capsys, *args, "--set", "train.steps=2").returncode == 0
    run_dir = tmp_path / "runs" / "tiny"
    recorded = json.loads((run_dir / "data.json").read_text())
    assert sorted(recorded["files"]) == ["data.eval_paths.mine", "data.train_path"] and recorded["changes"] == []
    _rows(data, 3)  # other rows, same file
    refused = command_here(capsys, *args, "--set", "train.steps=3", "--resume")
    (line,) = refused.stderr.splitlines()
    assert refused.returncode == 2 and line.startswith(
        f"error: --resume: the run's data changed since it recorded it: data.eval_paths.mine ({data}: sha256 "), line
    assert f"data.train_path ({data}: sha256" in line and "pass --allow-data-change" in line
    assert "data.json" in os.listdir(run_dir) and not any(r["step"] == 3 for r in run_records(run_dir))
    assert command_here(capsys, *args, "--set", "train.steps=2", "--allow-data-change").returncode == 2  # no --resume
    allowed = command_here(capsys, *args, "--set", "train.steps=3", "--resume", "--allow-data-change")
    assert allowed.returncode == 0 and "--allow-data-change: the run's data changed" in caplog.text
    assert command_here(capsys, *args, "--set", "train.steps=4", "--resume").returncode == 0  # as recorded since
    records = run_records(run_dir)
    assert {r["step"] for r in records if "data_changed_at" not in r} == {0, 1, 2}
    assert {(r["step"], r["data_changed_at"]) for r in records if r["kind"] == "train" and "data_changed_at" in r} \
        == {(3, 2), (4, 2)}
    assert json.loads((run_dir / "data.json").read_text())["changes"] == [
        {"step": 2, "fields": ["data.eval_paths.mine", "data.train_path"]}]


# ----------------------------------------------------------------------------------------------- a second signal

FINISHING = "import atexit, time; atexit.register(time.sleep, 1.5); from ftis_engine.app.entry import main; main()"


@pytest.mark.parametrize("command, signum, code", [
    pytest.param(["swarm", "serve", "--config", str(ROOT / "configs/swarm/swarm.yaml"), "--bind", "tcp://127.0.0.1:0"],
                 "SIGTERM", 0, id="command0-SIGTERM-0", marks=pytest.mark.slow),
    pytest.param(["train", "--config", str(TINY), "--set", "eval.at_start=false"], "SIGINT", 130,
                 id="command1-SIGINT-130", marks=pytest.mark.integration),
])
def test_a_signal_while_the_process_finishes_changes_neither_its_code_nor_its_lines(tmp_path, command, signum, code):
    """Two SIGTERMs 50 ms apart gave `swarm serve` exit 143 after its summary, and two Ctrl-C 20 ms apart during
    `train` a traceback from an atexit callback after its line: the second landed while the process finished. The
    window is made wide here (an atexit callback that sleeps 1.5 s, run last), and the second signal sent into it."""
    import signal
    import time

    from .helpers import with_default_sigint

    err = tmp_path / "stderr"
    with open(err, "w") as stderr:
        process = subprocess.Popen(with_default_sigint([sys.executable, "-c", FINISHING, *command, "--output-dir",
                                                        str(tmp_path / "out")]), stderr=stderr, cwd=ROOT)
    try:
        ready = "coordinator listening" if command[0] == "swarm" else "step 1/"
        deadline = time.monotonic() + 240
        while ready not in err.read_text():
            assert process.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.1)
        process.send_signal(getattr(signal, signum))
        time.sleep(0.8)  # the command has ended and written its line; the process sleeps in its atexit callback
        process.send_signal(getattr(signal, signum))
        assert process.wait(60) == code
    finally:
        process.kill()
    lines = [x for x in err.read_text().splitlines() if x.strip() and not x.startswith(("step ", "each step"))]
    assert not any("Traceback" in x or "Exception ignored" in x for x in lines), lines
    assert lines[-1].startswith("coordinator stopped: " if code == 0 else "error: interrupted before the run's first")


def test_a_second_ctrl_c_while_the_first_is_cleaned_up_is_ignored_and_its_line_still_said(monkeypatch, capsys,
                                                                                          tmp_path):
    """A Ctrl-C landing while the first one's cleanup runs (closing the members) cut that cleanup short and lost
    the line that says what the run left: it is ignored, the cleanup finishes and the line comes."""
    import signal
    import time

    from ftis_engine.run import session

    def interrupt(swarm, step):
        signal.raise_signal(signal.SIGINT)  # Ctrl-C, in the step (the handler raises here; waited for, in case)
        for _ in range(1000):
            time.sleep(0.01)
        raise AssertionError("the SIGINT was not handled")

    close, closed = session.Swarm.close, []

    def close_and_ctrl_c_again(self):
        signal.raise_signal(signal.SIGINT)  # delivered here, in the cleanup
        close(self)
        closed.append(True)

    monkeypatch.setattr(session.Swarm, "close", close_and_ctrl_c_again)
    # Ctrl-C at Python's default whatever this process inherited: a background job of a non-interactive shell (a
    # CI script's `cmd &`) starts with SIGINT ignored, and the command line then installs no handler of its own
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code, err = _main_exit(monkeypatch, capsys, interrupt, tmp_path)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert closed == [True] and code == 130 and err.strip().splitlines()[-1] == (
        "error: interrupted before the run's first checkpoint; nothing to continue from: rerun the same command to "
        "start it again")


@pytest.mark.slow
def test_a_signal_long_after_the_first_ends_a_cleanup_that_hangs_at_once_in_one_line(tmp_path):
    """What a second signal within 2 s leaves alone, a later one ends: a cleanup that never returns cannot keep
    the command from Ctrl-C."""
    import signal
    import time

    from .helpers import with_default_sigint

    hangs = ("import time, ftis_engine.run.session as s; s.Swarm.close = lambda self: time.sleep(3600); "
             "import ftis_engine.run.loop as r; r.run_step = lambda *a: time.sleep(3600); "
             "from ftis_engine.app.entry import main; main()")
    err = tmp_path / "stderr"
    with open(err, "w") as stderr:
        process = subprocess.Popen(with_default_sigint([sys.executable, "-c", hangs, "train", "--config", str(TINY),
                                                        "--set", "eval.at_start=false", "--output-dir",
                                                        str(tmp_path / "out")]), stderr=stderr, cwd=ROOT)
    try:
        deadline = time.monotonic() + 240
        while "each step" not in err.read_text():  # the legend: the first step is running
            assert process.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.1)
        process.send_signal(signal.SIGINT)  # into the step: the cleanup starts, and hangs
        time.sleep(0.5)
        process.send_signal(signal.SIGINT)  # ignored: the cleanup goes on
        time.sleep(2.0)
        assert process.poll() is None
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 130
    finally:
        process.kill()
    assert err.read_text().splitlines()[-1] == ("error: interrupted again while stopping: stopped at once, its cleanup "
                                                "unfinished")
