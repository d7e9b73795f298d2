"""Placement: a member on several ranks (FSDP2 over gloo) and bad placements."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from .helpers import TINY, command_here, run_records, short_config
from .ports import free_port
from .test_swarm import _args, _cli, _env, _kill_rank_after_first_checkpoint, _steps

HERE = pathlib.Path(__file__).resolve().parent


# ------------------------------------------------------------------------------------------------- bad placements


@pytest.mark.parametrize("override, nproc, message", [
    ("members.0.ranks=0", "2", "members.0.ranks"),
    ("members.0.ranks=2", "2", "--nproc 2: the config needs 3 processes"),
    ("members.0.device=cuda:7", "2", "members.0.device"),
    ("members.0.device=gpu:0", "2", "members.0.device"),
])
def test_bad_placements_exit_2_with_one_line(tmp_path, capsys, override, nproc, message):
    result = command_here(capsys, *_args(tmp_path, override), "--nproc", nproc)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not (tmp_path / "swarm").exists()


def test_two_vllm_engines_that_would_fill_one_gpu_are_refused_before_anything_starts(tmp_path, capsys):
    result = command_here(capsys, *_args(tmp_path, "members.0.generator=vllm", "members.1.generator=vllm",
                         "members.0.device=cuda:0", "members.1.device=cuda:0",
                         "members.0.vllm.gpu_memory_utilization=0.5", "members.1.vllm.gpu_memory_utilization=0.5"),
                  "--nproc", "2")
    assert result.returncode == 2, result.stderr
    assert "members.1.vllm.gpu_memory_utilization" in result.stderr and "1.00" in result.stderr


PAIR_ON_ONE_GPU = ["members.0.model=builtin:shape-1.5b", "members.1.model=builtin:shape-3b", "members.1.lora=null",
                   "members.0.generator=vllm", "members.1.generator=vllm", "members.0.dtype=bfloat16",
                   "members.1.dtype=bfloat16", "members.0.device=cuda:0", "members.1.device=cuda:0"]
H100 = 85_520_809_984  # torch.cuda.get_device_properties(0).total_memory of an H100 80GB (79.6 GiB)


def test_the_parameter_count_behind_the_memory_plan_is_exact():
    import torch

    from ftis_engine.config import LoraSettings
    from ftis_engine.model.models import load_model
    from ftis_engine.run.preflight import model_shape, parameter_counts

    for spec in ("builtin:tiny-s", "builtin:tiny-m", "builtin:tiny-l"):
        model = load_model(spec, 101, torch.float32, 0, "sdpa")
        assert parameter_counts(model_shape(spec), None) == (sum(p.numel() for p in model.parameters()),) * 2
    lora = LoraSettings(r=4, alpha=8, target_modules=["q_proj", "down_proj"])
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load_model("builtin:tiny-m", 101, torch.float32, 0, "sdpa"),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert parameter_counts(model_shape("builtin:tiny-m"), lora)[1] == trainable
    # the Qwen2.5-1.5B shape with its real vocabulary is Qwen2.5-1.5B's 1.54B parameters
    assert parameter_counts({**model_shape("builtin:shape-1.5b"), "vocab_size": 151936}, None)[0] == 1_543_714_304
    # the -qwen shapes carry Qwen2.5's vocabulary into the memory plan (their embedding and head: 233 M at 1.5B)
    assert parameter_counts(model_shape("builtin:shape-1.5b-qwen"), None)[0] == 1_543_714_304


def test_a_gpu_plan_whose_training_and_engines_do_not_fit_names_the_field_to_lower():
    from ftis_engine.config import ConfigError
    from ftis_engine.run.preflight import check_memory_plan

    # the paper's pair, full fine-tunes with 16k-token micro-batches and no recompute: the activations alone
    # (about 36 and 58 GiB) do not fit beside the weights and Adam states: no vLLM share could make room
    config = short_config(*PAIR_ON_ONE_GPU, "train.micro_batch_tokens=16384")
    with pytest.raises(ConfigError, match=r"^members.1.device: training the members on cuda:0 \(79.6 GiB\) needs"):
        check_memory_plan(config, [0, 1], "cuda:0", H100)
    # with recompute and 8k tokens, float32 master weights and Adam states (16 bytes a parameter, 4.1 B parameters)
    # and autocast's bf16 copies take about 74 GiB: the plan names the memory-saving mode...
    recompute = [*PAIR_ON_ONE_GPU, "train.gradient_checkpointing=true", "train.micro_batch_tokens=8192"]
    with pytest.raises(ConfigError, match=r"^members.1.device: .* needs about 7\d.\d GiB .* or set "
                                          r"members.1.master_dtype=bfloat16 \(torchao's AdamW"):
        check_memory_plan(short_config(*recompute), [0, 1], "cuda:0", H100)
    # ... which takes about 40 GiB (8 bytes a parameter): the engines' 0.3 + 0.3 of the GPU are then too much...
    fits = [*recompute, "members.0.master_dtype=bfloat16", "members.1.master_dtype=bfloat16"]
    with pytest.raises(ConfigError, match=r"^members.1.vllm.gpu_memory_utilization: .* lower it$"):
        check_memory_plan(short_config(*fits, "members.0.vllm.gpu_memory_utilization=0.3",
                                       "members.1.vllm.gpu_memory_utilization=0.3"), [0, 1], "cuda:0", H100)
    # ... 0.2 + 0.2 fit (the README's one-GPU recipe), and so does the same plan on an H200
    check_memory_plan(short_config(*fits, "members.0.vllm.gpu_memory_utilization=0.2",
                                   "members.1.vllm.gpu_memory_utilization=0.2"), [0, 1], "cuda:0", H100)
    check_memory_plan(short_config(*fits, "members.0.vllm.gpu_memory_utilization=0.3",
                                   "members.1.vllm.gpu_memory_utilization=0.3"), [0, 1], "cuda:0", 150_754_820_096)
    # a LoRA adapter or a second rank shrinks a member's share of the plan
    from ftis_engine.run.preflight import model_shape, training_bytes

    full, lora = (short_config(*fits, *extra) for extra in ([], ["members.1.lora.r=16"]))
    shape = model_shape("builtin:shape-3b")
    assert training_bytes(lora, 1, shape) < 0.5 * training_bytes(full, 1, shape)


def test_a_device_on_a_member_of_several_ranks_is_refused(tmp_path, capsys):
    result = command_here(capsys, *_args(tmp_path, "members.0.ranks=2", "members.0.device=cpu"), "--nproc", "3")
    assert result.returncode == 2 and "members.0.device" in result.stderr and "ranks" in result.stderr


def test_a_member_on_several_ranks_without_processes_is_refused(tmp_path, capsys):
    result = command_here(capsys, *_args(tmp_path, "members.0.ranks=2"))
    assert result.returncode == 2 and "members.0.ranks" in result.stderr and "--nproc 3" in result.stderr


def test_a_members_device_wins_over_train_device():
    from ftis_engine.run.preflight import member_device

    config = short_config("train.device=cuda", "members.1.device=cpu")  # CUDA is not there: only member 0 fails
    assert member_device(config, 1, None).type == "cpu"
    with pytest.raises(Exception, match="CUDA is not available"):
        member_device(config, 0, None)


def test_train_device_and_a_members_device_are_parsed_by_one_rule_naming_their_field():
    import torch

    from ftis_engine.config import ConfigError
    from ftis_engine.run.preflight import resolve_device
    from ftis_engine.run.preflight import check_device

    assert resolve_device("cpu", 1) == check_device("members.0.device", "cpu") == torch.device("cpu")
    assert resolve_device("auto", 0) == torch.device("cpu")  # no CUDA here
    for spec, says in (("cuda:1", "CUDA is not available"), ("meta", "is not a device to train on"),
                       ("gpu", "unknown device")):
        for field, parse in (("train.device", lambda s: resolve_device(s, 0)),
                             ("members.0.device", lambda s: check_device("members.0.device", s))):
            with pytest.raises(ConfigError, match=rf"^{field}: .*{says}") as refused:
                parse(spec)
            assert f"'{spec}'" in str(refused.value)


@pytest.mark.slow
def test_a_member_placed_on_a_device_trains_there_in_one_process(tmp_path):
    """A smoke test of the path (on a CPU machine the only device is the CPU)."""
    result = _cli(*_args(tmp_path, "members.1.device=cpu", "train.steps=1", "checkpoint.every=0"))
    assert result.returncode == 0, result.stderr


# ------------------------------------------------------------------------------------------------- FSDP2 members


@pytest.mark.slow
def test_one_update_on_two_ranks_equals_the_update_on_one(tmp_path):
    """Full, LoRA, GEPO (whole groups) and a member whose layers are compiled (train.layers: compile): the 2-rank
    gradient equals the 1-rank (eager) gradient to float32 rounding; the stats agree; after three Adam steps (each
    about lr x sign) the weights agree to a small fraction of lr. In bf16 compute (FSDP2's mixed-precision policy
    against one rank's autocast, full and LoRA) they agree within bf16 tolerance."""
    port, out = free_port(), tmp_path / "equivalence.json"
    procs = [subprocess.Popen([sys.executable, str(HERE / "placement_worker.py"), str(out)], env=_env(
        RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)), stderr=subprocess.PIPE,
        text=True) for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    cases = json.loads(out.read_text())
    assert set(cases) == {"0-f-tis", "1-f-tis", "0-gepo", "0-f-tis-compile", "0-f-tis-bf16", "1-f-tis-bf16"}
    assert [name for name, case in cases.items() if case["compiled"]] == ["0-f-tis-compile"]
    for name, case in cases.items():
        assert case["master_dtypes"] == ["torch.float32"], name  # the shards hold float32 masters in every case
        assert case["moved"] > 2 * case["lr"], name  # the steps did move the weights
        if name.endswith("-bf16"):  # bf16 compute: FSDP2 gathers bf16 weights, the twin autocasts float32 ones
            assert case["grad_rel_diff"] < 0.05, name
            assert case["moved_rel_diff"] < 0.3, name  # (the largest element: a near-zero gradient's sign flips)
            for stat, (sharded, one) in case["stats"].items():
                assert sharded == pytest.approx(one, rel=0.05, abs=2e-3), (name, stat)
            continue
        assert case["grad_rel_diff"] < 1e-5, name
        assert case["weight_diff"] < 0.1 * case["lr"], name
        for stat, (sharded, one) in case["stats"].items():
            assert sharded == pytest.approx(one, rel=1e-5, abs=1e-7), (name, stat)


@pytest.mark.parametrize("mode, ranks, further", [
    pytest.param("sync", "members.0.ranks=2", 1, marks=pytest.mark.integration),
    pytest.param("async", "members.1.ranks=2", 2, marks=pytest.mark.slow)])
def test_a_two_rank_member_trains_with_its_peer_survives_kill_9_and_its_checkpoint_loads(tmp_path, mode, ranks,
                                                                                         further):
    """kill -9 of the sharded member's further rank after the first checkpoint: the elastic agent restarts every
    rank, the run resumes with no gap; both members trained on each other's rollouts; the sharded member's
    checkpoint is a plain HF model (or adapter) that eval and transformers load."""
    args = _args(tmp_path, ranks, f"swarm.mode={mode}", "train.steps=6", "checkpoint.every=2", "eval.every=0")
    proc = subprocess.Popen([sys.executable, "-m", "ftis_engine", *args, "--nproc", "3", "--max-restarts", "1"],
                        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _kill_rank_after_first_checkpoint(tmp_path, proc, rank=further)  # the sharded member's further rank
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err
    assert f"rank {further}: {'tiny-s' if mode == 'sync' else 'tiny-m-lora'}: shard 2/2" in out  # the layout
    assert _steps(tmp_path) == {m: list(range(1, 7)) for m in ("tiny-s", "tiny-m-lora")}
    train = run_records(tmp_path / "swarm", "train")
    for name in ("tiny-s", "tiny-m-lora"):
        assert sum(r["peer_sequences"] for r in train if r["member"] == name) > 0, name
    checkpoint = tmp_path / "swarm" / "checkpoints" / "step-6"
    sharded = "tiny-s" if mode == "sync" else "tiny-m-lora"
    files = sorted(p.name for p in (checkpoint / "members" / sharded).iterdir())
    assert files == ["model", "optimizer.shard-0.pt", "optimizer.shard-1.pt", "rng.pt"]
    result = _cli("eval", "--checkpoint", str(checkpoint))
    assert result.returncode == 0, result.stderr
    accuracies = [json.loads(x) for x in result.stdout.splitlines() if x.startswith("{")]
    assert {r["member"] for r in accuracies} == {"tiny-s", "tiny-m-lora"}
    final = {r["member"]: r["accuracy"] for r in json.loads((tmp_path / "swarm" / "final_eval.json").read_text())}
    assert all(final[r["member"]] == r["accuracy"] for r in accuracies)  # the same weights as the run ended with
    if sharded == "tiny-s":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(checkpoint / "members" / "tiny-s" / "model")
        assert sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.slow
def test_a_two_rank_member_screens_its_arrivals_on_both_shards_and_applies_its_leaders_verdicts(tmp_path):
    """A sharded receiver with the model-reading defenses on (a likelihood floor no text passes): both shards run
    the screen's forward over what the leader admitted, every peer group is left out (counted), nothing is
    trained on from the peer, and the run ends."""
    args = _args(tmp_path, "members.0.ranks=2", "swarm.mode=async", "train.steps=3", "checkpoint.every=0",
                 "eval.every=0", "eval.at_start=false", "defense.likelihood_floor=-0.001", "defense.claims_monitor=true")
    result = _cli(*args, "--nproc", "3", timeout=400)
    assert result.returncode == 0, result.stderr
    records = [r for r in run_records(tmp_path / "swarm", "train") if r["member"] == "tiny-s"]
    assert [r["step"] for r in records] == [1, 2, 3]  # the leader reports once a step
    assert sum(r["likelihood_dropped"] for r in records) > 0 and all(r["peer_sequences"] == 0 for r in records)
    assert all(r["likelihood_dropped_by"].keys() <= {"tiny-m-lora"} for r in records)


@pytest.mark.slow
def test_the_readme_command_trains_both_members_and_both_gain(tmp_path):
    """`ftis-engine train --config configs/tiny.yaml --set members.0.ranks=2 --nproc 3`, shortened: both members
    gain over their step-0 accuracy."""
    args = ["train", "--config", str(TINY), "--output-dir", str(tmp_path), "--set", "members.0.ranks=2",
            "--set", "train.steps=40", "--set", "eval.every=40", "--set", "checkpoint.every=0",
            "--set", "members.1.lr=4e-3", "--set", "run_name=swarm"]
    result = _cli(*args, "--nproc", "3", timeout=600)
    assert result.returncode == 0, result.stderr
    evals = [r for r in run_records(tmp_path / "swarm") if r["kind"] == "eval"]
    for name in ("tiny-s", "tiny-m-lora"):
        start, end = (next(r["accuracy"] for r in evals if r["member"] == name and r["step"] == s) for s in (0, 40))
        assert end > start + 0.05, (name, start, end)



def test_the_shipped_one_gpu_pair_fits_an_80_gb_gpu_by_the_memory_plan():
    from ftis_engine.config import load_config
    from ftis_engine.run.preflight import check_memory_plan

    config = load_config(pathlib.Path(TINY).parents[0] / "gpu" / "pair-shapes.yaml", [])
    assert [m.device for m in config.members] == ["cuda:0", "cuda:0"]
    check_memory_plan(config, [0, 1], "cuda:0", H100)
    # on half of it training alone (about 36 GiB) leaves too little for even the engines' weights: no share would do
    with pytest.raises(Exception, match=r"^members.1.device: training the members on cuda:0 \(39.8 GiB\)"):
        check_memory_plan(config, [0, 1], "cuda:0", H100 // 2)


def test_a_model_whose_config_cannot_be_read_is_named_when_the_memory_plan_leaves_it_out(caplog):
    """A hub model that is neither cached nor reachable (the tests run offline) has no config to plan with: the plan
    says so, naming the member, instead of skipping it silently."""
    import logging

    from ftis_engine.run.preflight import check_memory_plan, model_shape

    assert model_shape("nobody/no-such-model-anywhere") is None
    config = short_config("members.0.model=nobody/no-such-model-anywhere", "members.0.device=cuda:0",
                          "members.1.device=cuda:0")
    with caplog.at_level(logging.WARNING, logger="ftis_engine"):
        check_memory_plan(config, [0, 1], "cuda:0", H100)
    assert "members.0.model: no config found to plan its memory with" in caplog.text
    assert "with (OSError: " in caplog.text  # and why: what reading its config raised


def test_the_memory_plan_says_why_a_config_gives_nothing_to_plan_with_and_a_programming_error_is_itself(
        tmp_path, monkeypatch):
    """A config that is no decoder the plan knows (BERT's has no num_key_value_heads) is Unplanned with the size it
    lacks; an AttributeError while reading a config is the code's own and propagates as itself."""
    import transformers

    from ftis_engine.run.preflight import Unplanned, model_shape, plan_shape

    transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64).save_pretrained(str(tmp_path / "bert"))
    assert plan_shape(str(tmp_path / "bert")) == Unplanned("its config gives no num_key_value_heads: not a decoder "
                                                           "the plan knows")
    assert model_shape(str(tmp_path / "bert")) is None

    def broken(*args, **kwargs):
        raise AttributeError("'NoneType' object has no attribute 'get'")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", broken)
    with pytest.raises(AttributeError, match="has no attribute 'get'"):
        plan_shape(str(tmp_path / "bert"))
