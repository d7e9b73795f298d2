"""End to end on the shortened tiny default: training, metrics, checkpoints, resume, kill -9 + resume."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from ftis_engine.app.cli import main
from ftis_kernels import STAT_KEYS

from .helpers import SHORT, TINY, run_records

TRAIN_KEYS = {"step", "member", "kind", "reward_mean", "loss", "tokens", "gen_seconds", "train_seconds",
              "sync_seconds", "own_ratio_mean", "exchange_bytes", "exchange_tokens", "exchange_sequences", *STAT_KEYS}
EVAL_KEYS = {"step", "member", "kind", "accuracy", "dataset"}


def run_cli(*args: str) -> int:
    try:
        main(list(args))
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def train_args(out: pathlib.Path, *overrides: str) -> list[str]:
    args = ["train", "--config", str(TINY), "--output-dir", str(out)]
    for o in [*SHORT, "run_name=e2e", *overrides]:
        args += ["--set", o]
    return args


def train_steps(run_dir: pathlib.Path) -> dict[str, list[int]]:
    steps: dict[str, list[int]] = {}
    for r in run_records(run_dir):
        if r["kind"] == "train":
            steps.setdefault(r["member"], []).append(r["step"])
    return steps


@pytest.mark.slow
def test_short_tiny_run_logs_every_key_checkpoints_and_plots(tmp_path):
    assert run_cli(*train_args(tmp_path)) == 0
    run_dir = tmp_path / "e2e"
    lines = run_records(run_dir)
    members = {"tiny-s", "tiny-m-lora"}
    for r in lines:
        assert (TRAIN_KEYS if r["kind"] == "train" else EVAL_KEYS) <= set(r), r
    assert train_steps(run_dir) == {m: [1, 2, 3, 4] for m in members}
    assert sorted({(r["step"], r["member"]) for r in lines if r["kind"] == "eval"}) == sorted(
        (s, m) for s in (0, 2, 4) for m in members)
    for r in lines:
        if r["kind"] == "train":
            own = r["exchange_sequences"]
            assert r["exchange_bytes"] == 4 + 32 * own + 8 * r["exchange_tokens"] and own == 2 * 4
            assert r["tokens"] > r["exchange_tokens"]  # trained on its peer's rollouts too
    assert (run_dir / "config.yaml").is_file() and any((run_dir / "tensorboard").iterdir())
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-2", "step-4"]
    ckpt = run_dir / "checkpoints" / "step-4" / "members"
    assert (ckpt / "tiny-s" / "model" / "model.safetensors").is_file()
    assert (ckpt / "tiny-m-lora" / "model" / "adapter_model.safetensors").is_file()  # LoRA: the adapter only
    assert (ckpt / "tiny-s" / "optimizer.pt").is_file()
    assert {p.name for p in (run_dir / "plots").iterdir()} == {"eval.png", "train.png"}

    # a second train into the same run directory without --resume refuses, and writes nothing
    before = (run_dir / "metrics.jsonl").read_text()
    assert run_cli(*train_args(tmp_path)) == 2
    assert (run_dir / "metrics.jsonl").read_text() == before

    # resume with more steps: continues at 5, no gap, no repeat
    assert run_cli(*train_args(tmp_path, "train.steps=6"), "--resume") == 0
    assert train_steps(run_dir) == {m: [1, 2, 3, 4, 5, 6] for m in members}

    # eval of a checkpoint reproduces the logged accuracy of that step
    from ftis_engine.app.cli import app  # noqa: F401  (the command is exercised through main)

    logged = {(r["member"], r["dataset"]): r["accuracy"] for r in run_records(run_dir, "eval") if r["step"] == 6}
    ckpt_dir = run_dir / "checkpoints" / "step-6"
    eval_args = ["eval", "--config", str(TINY), "--checkpoint", str(ckpt_dir)]
    for o in SHORT:
        eval_args += ["--set", o]
    out = subprocess.run([sys.executable, "-m", "ftis_engine", *eval_args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    evaluated = {(r["member"], r["dataset"]): r["accuracy"] for r in map(json.loads, out.stdout.splitlines())}
    assert evaluated == logged


@pytest.mark.integration
def test_kill_9_after_the_first_checkpoint_then_resume_finishes_with_no_gap(tmp_path):
    args = [sys.executable, "-m", "ftis_engine", *train_args(tmp_path, "train.steps=8", "eval.every=0")]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    first = tmp_path / "e2e" / "checkpoints" / "step-2"
    deadline = time.time() + 240
    while not first.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert first.exists(), "no checkpoint appeared"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = max(max(v) for v in train_steps(tmp_path / "e2e").values())
    assert killed_at < 8
    assert run_cli(*train_args(tmp_path, "train.steps=8", "eval.every=0"), "--resume") == 0
    assert train_steps(tmp_path / "e2e") == {m: list(range(1, 9)) for m in ("tiny-s", "tiny-m-lora")}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["horizontal", "alone"])
def test_other_collaboration_modes_run(tmp_path, mode):
    assert run_cli(*train_args(tmp_path, f"collaboration={mode}", "train.steps=2", "eval.every=0",
                               "checkpoint.every=0")) == 0
    for r in run_records(tmp_path / "e2e"):
        if r["kind"] != "train":
            continue
        if mode == "alone":
            assert r["exchange_bytes"] == 0 and r["sequences"] == r["own_sequences"] == 2 * 4
        else:  # every member generates half of every prompt's group and trains on the whole groups
            assert r["own_sequences"] == 4 * 2 and r["sequences"] == 4 * 4


@pytest.mark.slow
def test_gsm8k_task_runs_on_the_real_data_with_tiny_models(tmp_path, shared_data):
    overrides = [
        "data.task=gsm8k", f"data.train_path={shared_data / 'gsm8k' / 'train.jsonl'}",
        f"data.eval_paths.gsm8k={shared_data / 'gsm8k' / 'test.jsonl'}",
        f"data.eval_paths.math500={shared_data / 'math500' / 'test.jsonl'}",
        "data.max_prompt_tokens=1000", "train.steps=1", "eval.every=0", "eval.max_samples=2", "eval.max_new_tokens=4",
        "rollout.max_new_tokens=4", "rollout.prompts_per_step=2", "rollout.group_size=2", "checkpoint.every=0",
    ]
    assert run_cli(*train_args(tmp_path, *overrides)) == 0
    datasets = {r["dataset"] for r in run_records(tmp_path / "e2e") if r["kind"] == "eval"}
    assert datasets == {"gsm8k", "math500"}


@pytest.mark.slow
def test_resume_without_any_checkpoint_starts_over_without_duplicating_step_0(tmp_path):
    import shutil

    assert run_cli(*train_args(tmp_path, "train.steps=2", "eval.every=0")) == 0
    shutil.rmtree(tmp_path / "e2e" / "checkpoints")  # as if the run died before its first checkpoint
    assert run_cli(*train_args(tmp_path, "train.steps=2", "eval.every=0"), "--resume") == 0
    lines = run_records(tmp_path / "e2e")
    assert sorted((r["step"], r["member"]) for r in lines if r["kind"] == "eval" and r["step"] == 0) == [
        (0, "tiny-m-lora"), (0, "tiny-s")]
    assert train_steps(tmp_path / "e2e") == {m: [1, 2] for m in ("tiny-s", "tiny-m-lora")}


@pytest.mark.slow
def test_epochs_mini_batches_a_cosine_warmup_and_a_kl_penalty_act_in_a_run(tmp_path):
    """`--set train.epochs=2 --set train.mini_batches=2 --set algorithm.beta=0.04 --set train.lr_schedule=cosine
    --set train.warmup_steps=5 --set logging.completions=2` on the tiny default: four optimizer steps a step, the PPO
    clip acting (clip_frac > 0 in some step), the policy moving off its reference (ref_kl_mean > 0), the lr in every
    record rising over the warm-up, then falling, and completions.jsonl holding the samples."""
    assert run_cli(*train_args(tmp_path, "train.steps=10", "eval.every=0", "checkpoint.every=0", "train.epochs=2",
                               "train.mini_batches=2", "algorithm.beta=0.04", "train.lr_schedule=cosine",
                               "train.warmup_steps=5", "logging.completions=2")) == 0
    train = [r for r in run_records(tmp_path / "e2e") if r["kind"] == "train" and r["member"] == "tiny-s"]
    assert all(r["optimizer_steps"] == 4 for r in train)
    assert any(r["clip_frac"] > 0 for r in train) and train[-1]["ref_kl_mean"] > 0
    assert len((tmp_path / "e2e" / "completions.jsonl").read_text().splitlines()) == 10 * 2 * 2
    lrs = [r["lr"] for r in train]
    assert lrs[:5] == pytest.approx([2e-3 * s / 5 for s in range(1, 6)]) and lrs[4] > lrs[6] > lrs[9] > 0


@pytest.mark.slow
def test_logging_completions_writes_samples_a_person_can_read_with_what_the_update_saw(tmp_path):
    assert run_cli(*train_args(tmp_path, "train.steps=2", "eval.every=0", "checkpoint.every=0",
                               "logging.completions=3")) == 0
    lines = [json.loads(x) for x in (tmp_path / "e2e" / "completions.jsonl").read_text().splitlines()]
    assert sorted({(r["step"], r["member"]) for r in lines}) == [(s, m) for s in (1, 2)
                                                                for m in ("tiny-m-lora", "tiny-s")]
    assert len(lines) == 2 * 2 * 3 and not any(r["kind"] != "completion" for r in lines)
    for r in lines:
        assert r["prompt"] and isinstance(r["completion"], str)
        assert r["from"] in ("tiny-s", "tiny-m-lora") and 0 < r["is_weight"] <= 2.0 and isinstance(r["filtered"], bool)
        assert r["reward"] in (0.0, 1.0) and r["kl"] >= 0
    assert all(r["kind"] != "completion" for r in run_records(tmp_path / "e2e"))  # metrics.jsonl stays the metrics


@pytest.mark.slow
def test_weighted_rewards_are_summed_and_each_term_is_logged(tmp_path):
    terms = "[{function: ftis_engine.data.rewards:tiny_answer_reward, weight: 2.0}, " \
            "{function: ftis_engine.data.rewards:final_answer_reward, weight: 1.0}]"
    assert run_cli(*train_args(tmp_path, "train.steps=1", "eval.every=0", "eval.at_start=false",
                               "checkpoint.every=0", f"data.rewards={terms}")) == 0
    for r in (x for x in run_records(tmp_path / "e2e") if x["kind"] == "train"):
        tiny, final = r["reward/ftis_engine.data.rewards:tiny_answer_reward"], r["reward/ftis_engine.data.rewards:final_answer_reward"]
        assert r["reward_mean"] == pytest.approx(2.0 * tiny + final)
