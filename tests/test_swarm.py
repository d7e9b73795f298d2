"""Members in separate processes (gloo on CPU): exchange, untrusted peers, tokenizer check, faults."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import psutil
import pytest

from .helpers import SHORT, TINY, run_records
from .ports import free_port

HERE = pathlib.Path(__file__).resolve().parent


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1", **extra}


def _args(out: pathlib.Path, *overrides: str, config: pathlib.Path = TINY) -> list[str]:
    args = ["train", "--config", str(config), "--output-dir", str(out)]
    for o in [*SHORT, "run_name=swarm", "eval.every=0", *overrides]:
        args += ["--set", o]
    return args


def _train(records: list[dict]) -> list[dict]:
    return [r for r in records if r["kind"] == "train"]


def _steps(out: pathlib.Path) -> dict[str, list[int]]:
    steps: dict[str, list[int]] = {}
    for r in run_records(out / "swarm", "train"):
        steps.setdefault(r["member"], []).append(r["step"])
    return steps


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "ftis_engine", *args], capture_output=True, text=True,
                      timeout=timeout, env=_env())


def _hand_launch(world: int, args: list[str], modes: dict[int, str] | None = None, timeout=300,
                 env_extra: dict | None = None):
    """Start `world` ranks the way torchrun would (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment)."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = _env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **(env_extra or {}))
        mode = (modes or {}).get(rank, "none")
        procs.append(subprocess.Popen([sys.executable, str(HERE / "swarm_worker.py"), mode, *args], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        results.append((p.returncode, err))
    return results


@pytest.mark.integration
def test_two_processes_train_exactly_like_one_and_deliver_bit_exact_rollouts(tmp_path):
    assert _cli(*_args(tmp_path / "local", "train.steps=2", "checkpoint.every=0")).returncode == 0
    result = _cli(*_args(tmp_path / "dist", "train.steps=2", "checkpoint.every=0"), "--nproc", "2")
    assert result.returncode == 0, result.stderr
    local, dist = (run_records(tmp_path / where / "swarm", "train") for where in ("local", "dist"))
    key = lambda r: (r["step"], r["member"])  # noqa: E731
    for a, b in zip(sorted(local, key=key), sorted(dist, key=key)):
        for field in ("reward_mean", "loss", "tokens", "sequences", "exchange_bytes", "rollouts_sha256", "kl_mean"):
            if isinstance(b[field], str):  # fingerprints must be identical; numbers agree to float rounding
                assert a[field] == b[field], field
            else:
                assert a[field] == pytest.approx(b[field], rel=1e-6), field
    sent = {(r["step"], r["member"]): r["rollouts_sha256"] for r in dist}
    for r in dist:
        for key, digest in r["received_sha256"].items():
            peer, step = key.split("@")
            assert int(step) == r["step"] and digest == sent[(r["step"], peer)]  # what the peer encoded arrived
        assert r["exchange_bytes"] == 4 + 32 * r["exchange_sequences"] + 8 * r["exchange_tokens"]
        assert r["sequences"] == 2 * r["own_sequences"]  # its own plus its peer's
    final = json.loads((tmp_path / "dist" / "swarm" / "final_eval.json").read_text())
    assert {r["member"] for r in final} == {"tiny-s", "tiny-m-lora"}  # rank 0 reports every rank's accuracy


@pytest.mark.slow
def test_three_processes_every_member_trains_on_every_members_rollouts(tmp_path):
    config = tmp_path / "three.yaml"
    text = TINY.read_text().replace("algorithm:", "  - name: tiny-l\n    model: builtin:tiny-l\n    lr: 1.0e-3\nalgorithm:")
    config.write_text(text)
    result = _cli(*_args(tmp_path, "train.steps=2", "checkpoint.every=0", "rollout.prompts_per_step=6",
                         config=config), "--nproc", "3")
    assert result.returncode == 0, result.stderr
    records = run_records(tmp_path / "swarm", "train")
    assert {r["member"] for r in records} == {"tiny-s", "tiny-m-lora", "tiny-l"}
    for r in records:
        assert r["own_sequences"] == 2 * 4 and r["sequences"] == 6 * 4 and r["rejected_batches"] == 0
        assert len(r["received_sha256"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ids", "nan", "reward", "truncated", "oversized", "extra"])
def test_a_peer_sending_corrupt_rollouts_is_dropped_and_training_goes_on(tmp_path, mode):
    results = _hand_launch(2, _args(tmp_path, "train.steps=2", "checkpoint.every=0"), modes={1: mode})
    assert [code for code, _ in results] == [0, 0], results
    warnings = [line for line in results[0][1].splitlines() if "dropped the rollouts of peer tiny-m-lora" in line]
    assert len(warnings) == 2  # one line per step
    records = run_records(tmp_path / "swarm", "train")
    honest = [r for r in records if r["member"] == "tiny-s"]
    assert all(r["rejected_batches"] == 1 and r["sequences"] == r["own_sequences"] for r in honest)
    assert all(r["loss"] is not None and abs(r["loss"]) < 1e3 for r in records)
    cheated = [r for r in records if r["member"] == "tiny-m-lora"]
    assert all(r["rejected_batches"] == 0 and r["sequences"] == 2 * r["own_sequences"] for r in cheated)


@pytest.mark.slow
def test_under_torchrun_a_restart_resumes_and_a_fresh_start_refuses_an_existing_run(tmp_path):
    """Member 1 fully fine-tuned: its rank-1 leader's checkpoint must hold its weights (transformers 5 saves on rank 0
    alone unless told otherwise), which the resume loads."""
    args = _args(tmp_path, "train.steps=2", "checkpoint.every=0", "members.1.lora=null")
    assert [code for code, _ in _hand_launch(2, args)] == [0, 0]
    refused = _hand_launch(2, args)
    assert [code for code, _ in refused] == [2, 2]
    assert "already holds a run" in refused[0][1] and len(refused[0][1].strip().splitlines()) == 1
    assert (tmp_path / "swarm" / "checkpoints" / "step-2" / "members" / "tiny-m-lora" / "model" / "config.json").is_file()
    longer = _args(tmp_path, "train.steps=3", "checkpoint.every=0", "members.1.lora=null")
    resumed = _hand_launch(2, longer, env_extra={"TORCHELASTIC_RESTART_COUNT": "1"})
    assert [code for code, _ in resumed] == [0, 0], resumed
    assert _steps(tmp_path) == {m: [1, 2, 3] for m in ("tiny-s", "tiny-m-lora")}


@pytest.mark.slow
def test_under_torchrun_members_with_other_tokenizers_collaborate_unless_one_refuses(tmp_path):
    from ftis_engine.model.models import build_tiny_tokenizer

    other = build_tiny_tokenizer()
    other.add_tokens(["<extra>"])  # another vocabulary: members exchange text, not ids
    other.save_pretrained(str(tmp_path / "other-tokenizer"))
    results = _hand_launch(2, _args(tmp_path / "out", f"members.1.tokenizer={tmp_path / 'other-tokenizer'}",
                                    "members.0.accept_foreign=false", "train.steps=2", "checkpoint.every=0"))
    assert [code for code, _ in results] == [0, 0], results
    train = run_records(tmp_path / "out" / "swarm", "train")
    refused = [r for r in train if r["member"] == "tiny-s"]
    taken = [r for r in train if r["member"] == "tiny-m-lora"]
    assert all(r["peer_sequences"] == 0 and r["foreign_refused"] > 0 for r in refused)
    assert all(r["foreign_sequences"] == r["peer_sequences"] > 0 for r in taken)


def _worker_pid(parent: psutil.Process, rank: int) -> int | None:
    """The elastic agent starts local ranks in order (their rank is set after start, so it is not in
    /proc/PID/environ): the workers sorted by start time and pid are ranks 0, 1, ... A worker is a process the agent
    spawned (multiprocessing's spawn_main in its command line)."""
    workers = []
    for child in parent.children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
            if "resource_tracker" in cmdline:
                continue
            if "spawn_main" in cmdline:
                workers.append((child.create_time(), child.pid))
        except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):
            continue
    workers.sort()
    return workers[rank][1] if len(workers) > rank else None


def _kill_rank_after_first_checkpoint(out: pathlib.Path, proc: subprocess.Popen, rank: int = 1) -> None:
    checkpoint = out / "swarm" / "checkpoints" / "step-2"
    deadline = time.time() + 240
    while not checkpoint.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert checkpoint.exists(), "no checkpoint appeared"
    pid = _worker_pid(psutil.Process(proc.pid), rank)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_kill_9_of_one_rank_ends_the_others_with_a_clear_message(tmp_path):
    args = _args(tmp_path, "train.steps=40", "checkpoint.every=2", "swarm.timeout_s=60")
    proc = subprocess.Popen([sys.executable, "-m", "ftis_engine", *args, "--nproc", "2"], env=_env(),
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _kill_rank_after_first_checkpoint(tmp_path, proc)
    _, err = proc.communicate(timeout=300)  # (a hang's guard, not a measure)
    assert proc.returncode != 0
    # liveness, not speed: the survivor is stopped (by the launcher, or by its own lost peer within swarm.timeout_s)
    # instead of waiting forever: the run ends, short of its 40 steps
    assert max(step for steps in _steps(tmp_path).values() for step in steps) < 40
    # the survivor reports the lost peer, the launcher that the swarm stopped and how to continue
    assert "lost contact with a peer" in err or "rank 1 (tiny-m-lora) failed with signal 9" in err
    assert "swarm stopped" in err and "--resume" in err
    steps = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "swarm" / "checkpoints").glob("step-*"))
    assert steps and all((tmp_path / "swarm" / "checkpoints" / f"step-{s}" / "state.json").is_file() for s in steps)


def kill_and_restart(tmp_path: pathlib.Path, *overrides: str) -> None:
    """Run two processes with one elastic restart allowed, kill -9 rank 1 after the first checkpoint; the run must
    come back and finish (exit 0)."""
    args = _args(tmp_path, "checkpoint.every=2", *overrides)
    proc = subprocess.Popen([sys.executable, "-m", "ftis_engine", *args, "--nproc", "2", "--max-restarts", "1"],
                        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _kill_rank_after_first_checkpoint(tmp_path, proc)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err


@pytest.mark.integration
def test_with_restarts_a_killed_rank_comes_back_and_the_run_finishes_with_no_gap(tmp_path):
    kill_and_restart(tmp_path, "train.steps=8")
    assert _steps(tmp_path) == {m: list(range(1, 9)) for m in ("tiny-s", "tiny-m-lora")}


@pytest.mark.integration
def test_eval_with_nproc_evaluates_a_checkpoint_of_a_multi_process_run_to_the_accuracy_it_logged(tmp_path):
    """`ftis-engine eval --checkpoint DIR --nproc 2`: each rank evaluates its member, rank 0 prints every record;
    the accuracies equal those the two-process run logged at that step (the same weights, greedy)."""
    result = _cli(*_args(tmp_path, "train.steps=2", "checkpoint.every=2", "eval.max_samples=8"), "--nproc", "2")
    assert result.returncode == 0, result.stderr
    checkpoint = tmp_path / "swarm" / "checkpoints" / "step-2"
    evaluated = _cli("eval", "--checkpoint", str(checkpoint), "--nproc", "2")
    assert evaluated.returncode == 0, evaluated.stderr
    lines = [json.loads(x) for x in evaluated.stdout.splitlines() if x.startswith("{")]
    logged = {r["member"]: r["accuracy"] for r in run_records(tmp_path / "swarm", "eval") if r["step"] == 2}
    assert {r["member"]: r["accuracy"] for r in lines} == logged and len(lines) == 2
