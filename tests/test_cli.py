"""The command line: errors are one line with exit code 2 and nothing written; --dry-run prints the config."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"


def cli(*args, cwd=None, timeout=300):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "ftis_engine", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, env=env)


def test_dry_run_prints_the_resolved_config(tmp_path):
    result = cli("train", "--config", TINY, "--set", "algorithm.kl_threshold=5", "--dry-run", "--output-dir", tmp_path)
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
]


@pytest.mark.parametrize("extra, field", BAD, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD)])
def test_bad_config_exits_2_with_one_line_and_writes_nothing(tmp_path, extra, field):
    result = cli("train", "--config", TINY, "--output-dir", tmp_path / "out", *extra)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0] and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_missing_or_broken_config_file(tmp_path):
    for args in (["train", "--config", tmp_path / "nope.yaml"], ["train"], ["plot", tmp_path / "nothing"]):
        result = cli(*args)
        assert result.returncode == 2, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("run_name: [unclosed\n")
    result = cli("train", "--config", broken)
    assert result.returncode == 2 and "--config" in result.stderr


def test_module_entry_point_and_help():
    result = cli("--help")
    assert result.returncode == 0 and "train" in result.stdout and "plot" in result.stdout
    result = cli("train", "--help")
    flags = [line for line in result.stdout.splitlines() if "--resume" in line or "--dry-run" in line]
    assert result.returncode == 0 and len(flags) == 2 and not any("<bool>" in line for line in flags)


def test_triton_backend_on_cpu_is_refused_before_anything_is_written(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "ftis_engine", "train", "--config", str(TINY), "--output-dir",
                             str(tmp_path / "out"), "--set", "train.backend=triton"], capture_output=True, text=True,
                            env={**env, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}, timeout=300)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: train.backend: 'triton' needs a CUDA device, and train.device='auto' gives cpu here; use auto or torch"]
    assert not (tmp_path / "out").exists()


def test_plot_refuses_an_empty_log_and_resume_needs_a_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    result = cli("plot", tmp_path)
    assert result.returncode == 2 and "metrics.jsonl holds no records yet" in result.stderr
    result = cli("train", "--config", TINY, "--output-dir", tmp_path / "out", "--resume")
    assert result.returncode == 2 and "holds no run to continue" in result.stderr
    assert not (tmp_path / "out").exists()
