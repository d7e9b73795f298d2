"""benchmarks/run_pair_gpu.sh, benchmarks/pair_plan.py and the configs they run (issue 67): the stages in the
issue's order with the arguments each gets (run against stand-ins for python3 and nvidia-smi that log their
arguments), a stage that no longer fits the call skipped, the results packed after every stage; the memory plan
for an H100 and an H200; each engine's KV cache the run's need; TRL given ours' settings."""

from __future__ import annotations

import os
import pathlib
import re
import stat
import subprocess
import tarfile

import pytest

from benchmarks import pair_plan, trl_grpo

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "run_pair_gpu.sh"
GIB = 1 << 30

FAKE_PYTHON = r"""#!/usr/bin/env bash
# logs its arguments; leaves what the stage would leave
echo "python3 $*" >> "$FAKE_LOG"
if [ "$1 $2 $3" = "-m ftis_engine train" ]; then
  while [ $# -gt 0 ]; do
    case "$1" in --output-dir) dir=$2 ;; run_name=*) name=${1#run_name=} ;; esac
    [ "$1" = --set ] && case "$2" in run_name=*) name=${2#run_name=} ;; esac
    shift
  done
  mkdir -p "$dir/$name" && echo '{"step": 1, "kind": "train"}' > "$dir/$name/metrics.jsonl"
elif [ "$1" = benchmarks/pair_summary.py ] && [ "$2" = --settings ]; then echo '{}'
elif [ "$1" = benchmarks/trl_grpo.py ]; then
  while [ $# -gt 1 ]; do [ "$1" = --output ] && echo '{}' > "$2"; shift; done
fi
exit 0
"""
FAKE_NVIDIA_SMI = r"""#!/usr/bin/env bash
case "$*" in
  *memory.total*) echo "$FAKE_GPU_MIB" ;;
  *name*) echo "NVIDIA H200" ;;
  *) echo 1000 ;;
esac
"""


def run_stages(tmp_path, *stages, gpu_mib=143_771, call_limit=570, env=None):
    """run_pair_gpu.sh with the given stages against the stand-ins; returns (exit status, the commands logged, the
    results folder, $OUT)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("python3", FAKE_PYTHON), ("nvidia-smi", FAKE_NVIDIA_SMI)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IEXEC)
    for name in ("results", "out", "scratch", "vsite", "src"):
        (tmp_path / name).mkdir(exist_ok=True)
    log = tmp_path / "log"
    log.write_text("")
    environment = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(log),
                   "FAKE_GPU_MIB": str(gpu_mib), "RESULTS": str(tmp_path / "results"), "OUT": str(tmp_path / "out"),
                   "TMPDIR": str(tmp_path / "scratch"), "VLLM_SITE": str(tmp_path / "vsite"),
                   "FTIS_SRC": str(tmp_path / "src"), "CALL_LIMIT": str(call_limit), **(env or {})}
    environment.pop("FTIS_CACHE_DIR", None)
    done = subprocess.run(["bash", str(SCRIPT), *stages], cwd=ROOT, env=environment, capture_output=True, text=True,
                          timeout=120, check=False)
    return done.returncode, log.read_text().splitlines(), tmp_path / "results", tmp_path / "out"


@pytest.mark.slow
def test_the_stages_run_in_the_issues_order_with_ours_and_trls_like_settings(tmp_path):
    rc, commands, results, out = run_stages(tmp_path, "pair-sync", "alone", "trl", "summary",
                                            env={"ALONE_ARGS": "--set train.steps=6"})
    assert rc == 0
    trains = [c for c in commands if c.startswith("python3 -m ftis_engine train")]
    assert len(trains) == 2
    assert "--config configs/gpu/pair-shapes.yaml --nproc 2" in trains[0] and "run_name=pair-sync" in trains[0]
    assert "members.0.master_dtype=float32 --set members.1.master_dtype=float32" in trains[0]  # 140 GiB: they fit
    assert "--config configs/gpu/alone-shape-1.5b.yaml --set train.steps=6" in trains[1]
    trl = next(c for c in commands if "benchmarks/trl_grpo.py" in c)
    assert "--like configs/gpu/alone-shape-1.5b.yaml --set train.steps=6" in trl  # ours' overrides reach TRL too
    assert trl.endswith(f"--output {results}/trl.json")
    assert commands[-1] == f"python3 benchmarks/pair_summary.py --results {results} --output {results}/pair_h200"
    assert (results / "device.txt").read_text() == "NVIDIA H200\n"
    assert [line.split(":")[0] for line in (results / "stages.txt").read_text().splitlines()] == [
        "== stage pair-sync", "== stage alone", "== stage trl", "== stage summary"]
    assert (results / "pair-sync.metrics.jsonl").exists() and (results / "alone.metrics.jsonl").exists()
    with tarfile.open(out / "pair-results.tar.gz") as packed:  # packed after the last stage with everything
        assert "results/alone.metrics.jsonl" in packed.getnames()
    assert not (tmp_path / "scratch" / "pair-runs" / "alone").exists()  # its checkpoint is not kept


@pytest.mark.slow
def test_the_pair_keeps_the_configs_bf16_masters_on_an_80_gb_gpu(tmp_path):
    rc, commands, _, _ = run_stages(tmp_path, "pair-sync", gpu_mib=81_559)
    assert rc == 0 and "master_dtype" not in commands[0]


@pytest.mark.slow
def test_a_stage_that_would_start_with_less_than_its_start_and_three_steps_left_is_skipped(tmp_path):
    rc, _, results, _ = run_stages(tmp_path, "pair-sync", "alone", "summary", call_limit=160)
    assert rc == 1  # skipped stages count as failed
    stages = (results / "stages.txt").read_text()
    assert re.search(r"stage pair-sync: skipped, 14\d s left in this call \(it needs 200\)", stages)
    assert "stage alone: exit 0" in stages and "stage summary: exit 0" in stages


def test_trl_on_the_3b_shape_takes_the_3b_models_kv_need():
    sets = re.search(r'^TRL_3B="(.*)"$', SCRIPT.read_text(), re.MULTILINE).group(1).split()
    overrides = [value for flag, value in zip(sets[::2], sets[1::2], strict=True) if flag == "--set"]
    args = trl_grpo.parse_args(["--like", "configs/gpu/alone-shape-1.5b.yaml", *sets, "--output", "x.json"])
    assert args.model == "builtin:shape-3b-qwen" and "members.0.model=builtin:shape-3b-qwen" in overrides
    from ftis_engine.config import load_config

    pair = load_config(ROOT / "configs" / "gpu" / "pair-shapes.yaml")
    assert args.kv_cache_gib == pair.members[1].vllm.kv_cache_gib == pair_plan.kv_need(pair, 1) / GIB


@pytest.mark.parametrize("path", ["configs/gpu/alone-shape-1.5b.yaml", "configs/gpu/pair-shapes.yaml"])
def test_each_engines_kv_cache_is_the_runs_need(path):
    """kv_cache_gib: keys and values of the member's completions of a step at the engine's length, bf16."""
    from ftis_engine.config import load_config

    config = load_config(ROOT / path)
    for index, member in enumerate(config.members):
        assert member.vllm.kv_cache_gib == pair_plan.kv_need(config, index) / GIB
        assert (member.vllm.sleep_level, member.vllm.per_request_seed) == (2, False)
        assert member.model.endswith("-qwen")  # Qwen2.5's vocabulary


def test_the_1_5b_engines_kv_need_is_28_kib_a_token_for_144_sequences_of_768_tokens():
    from ftis_engine.config import load_config

    config = load_config(ROOT / "configs" / "gpu" / "alone-shape-1.5b.yaml")
    per_token = 2 * 28 * 2 * 128 * 2  # K and V, 28 layers, 2 KV heads of 128, bf16
    assert pair_plan.completions_a_step(config, 0) == 144
    need = per_token * (512 + 256) * 144
    assert pair_plan.kv_need(config, 0) == -(-need // (GIB // 16)) * (GIB // 16) == 3 * GIB


def test_trl_runs_as_ours_alone_config_runs_its_member():
    """--like: the same model and init seed, task, steps, batch, length, temperature, learning rate, precision,
    attention, compiled layers and engine memory as ours' member 0."""
    from ftis_engine.config import load_config
    from ftis_engine.member.members import member_init_seed

    config = load_config(ROOT / "configs" / "gpu" / "alone-shape-1.5b.yaml")
    member = config.members[0]
    args = trl_grpo.parse_args(["--like", "configs/gpu/alone-shape-1.5b.yaml", "--output", "x.json"])
    assert (args.model, args.seed, args.task, args.steps) == (member.model, member_init_seed(config, 0),
                                                              config.data.task, config.train.steps)
    assert (args.prompts * args.group, args.max_new_tokens) == (144, 256)
    assert (args.temperature, args.lr) == (config.rollout.temperature, member.lr)
    assert (args.precision, args.attn, args.layers) == ("fp32-master", "varlen", "auto")
    assert (args.kv_cache_gib, args.gpu_memory_utilization) == (3.0, 0.1)
    assert trl_grpo.parse_args(["--like", "configs/gpu/alone-shape-1.5b.yaml", "--steps", "4",
                                "--output", "x.json"]).steps == 4  # a flag given wins
    with pytest.raises(SystemExit):
        trl_grpo.parse_args(["--set", "train.steps=4", "--output", "x.json"])  # --set needs --like


def test_the_memory_plan_fits_float32_masters_of_the_pair_on_an_h200_only():
    """python benchmarks/pair_plan.py: the pair's float32 masters (102 GiB with both engines) fit an H200, not an
    H100, where the config's bf16 masters (59 GiB) do; ours alone (36 GiB) fits both. Preflight lets each start
    that fits."""
    table = pair_plan.table(pair_plan.RUNS)
    rows = {tuple(cell.strip() for cell in line.split("|")[1:8:2]): line for line in table.splitlines()[2:]}

    def row(label, gpu):
        return next(line for (run, gpu_name, *_), line in rows.items() if run.startswith(label) and gpu_name == gpu)

    assert "| 59.1 | yes |" in row("pair, bf16", "H100 80GB") and "| yes |" in row("pair, bf16", "H100 80GB")
    assert "| 102.2 | **no** |" in row("pair, float32", "H100 80GB")
    assert "| 102.2 | yes |" in row("pair, float32", "H200 141GB") and row("pair, float32", "H200 141GB").endswith(
        "| yes |")
    assert "| 36.0 | yes |" in row("ours alone", "H100 80GB")
