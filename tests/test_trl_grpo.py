"""benchmarks/trl_grpo.py, the TRL side of issue 28: what can be checked without TRL (the model export it shares
with the vLLM generator, the reward, the phase clock), and, where TRL is installed (not in CI), its config and
its CPU quick mode."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from benchmarks import trl_grpo
from tests.test_attention import reference_kernel

needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed (not in CI)")


def test_save_for_engine_writes_a_model_that_loads_back_identical(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ftis_engine.generation.engine_weights import save_for_engine
    from ftis_engine.model.models import load_model, load_tokenizer

    tokenizer = load_tokenizer("builtin:tiny-s")
    model = load_model("builtin:tiny-s", len(tokenizer), torch.float32, 0, "sdpa")
    assert save_for_engine(model, tokenizer, tmp_path / "m") == str(tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.float32)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert AutoTokenizer.from_pretrained(str(tmp_path / "m"))("123=")["input_ids"] == tokenizer("123=")["input_ids"]


def test_the_reward_is_the_tasks_and_counts_completion_tokens():
    from ftis_engine.config import DataSettings
    from ftis_engine.data.tasks import load_task

    task = load_task(DataSettings(task="tiny-last"), 0)
    tally = {"tokens": 0, "completions": 0}
    reward = trl_grpo.task_reward(task, tally)
    assert reward(completions=[" 7 and more", "3", ""], completion_ids=[[1, 2, 3], [4], []], answer=["7", "4", "1"],
                  prompts=["97=", "14=", "11="]) == [1.0, 0.0, 0.0]
    assert tally == {"tokens": 4, "completions": 3}


def test_the_phase_clock_takes_a_nested_phase_out_of_the_outer_one(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(trl_grpo.time, "perf_counter", lambda: now[0])

    class Trainer:
        def sync(self):
            now[0] += 2.0

        def generate(self):
            now[0] += 1.0
            self.sync()
            now[0] += 4.0

    trainer, clock = Trainer(), trl_grpo.PhaseClock()
    assert clock.wrap(trainer, "sync", "weight_sync_seconds") and clock.wrap(trainer, "generate", "gen_seconds")
    assert not clock.wrap(trainer, "absent", "other_seconds")
    trainer.generate()
    assert dict(clock.seconds) == {"weight_sync_seconds": 2.0, "gen_seconds": 5.0}
    clock.reset()
    trainer.sync()
    assert dict(clock.seconds) == {"weight_sync_seconds": 2.0}


def test_micro_batch_must_divide_the_steps_completions():
    with pytest.raises(SystemExit):
        trl_grpo.parse_args(["--micro-batch", "10", "--output", "x.json"])  # 144 completions


def test_the_precision_defaults_to_float32_masters_as_ours_trains():
    assert trl_grpo.parse_args(["--output", "x.json"]).precision == "fp32-master"
    assert trl_grpo.parse_args(["--precision", "bf16", "--output", "x.json"]).precision == "bf16"
    assert trl_grpo.parse_args(["--quick", "--output", "x.json"]).precision == "fp32"  # the CPU smoke test
    assert trl_grpo.parse_args(["--output", "x.json"]).layers == "auto"


@pytest.mark.parametrize("precision, layer_mode", [("fp32-master", "compile"), ("bf16", "eager")])
def test_trls_model_holds_the_masters_dtype_and_compiles_its_layers_as_ours(tmp_path, precision, layer_mode):
    """fp32-master: float32 weights (AdamW's states follow them), TRL's bf16=True then autocasts; bf16: the
    2026-11-27 run's bf16 weights. compile: each decoder layer as ftis_engine.model.layers compiles ours."""
    from ftis_engine.model import layers

    master = trl_grpo.PRECISIONS[precision][0]
    trl_grpo.export_model("builtin:tiny-s", 0, master, tmp_path / "m")
    model = trl_grpo.trainer_model(tmp_path / "m", master, "sdpa", layer_mode)
    assert {p.dtype for p in model.parameters()} == {master}
    assert layers.compiled(model) == (layer_mode == "compile")
    assert model.config._attn_implementation == "sdpa"


def _padded_batch():
    """TRL's layout: left-padded prompts, then completions padded on the right (one ended early), and a row with no
    padding at all."""
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 0], [8, 9, 10, 11, 12, 13, 14, 15], [0, 21, 22, 23, 24, 0, 0, 0]])
    mask = (ids != 0).long()
    return ids, mask


def test_trls_padded_batches_take_ours_varlen_attention_and_compute_what_sdpa_does_under_the_mask(monkeypatch):
    """--attn varlen: each row's tokens packed one row after the other for ours' varlen attention (the float64 stand-in
    of torch's kernel here: tests/test_attention.py), put back in place; equal to sdpa under the causal and padding
    mask at every token, forward and gradients (TRL's loss reads tokens only)."""
    from ftis_engine.model import attention
    from ftis_engine.model.models import load_model

    monkeypatch.setattr(attention, "_kernel", lambda: (reference_kernel, {"window_size": (-1, 0)}, True))
    calls = []
    real = attention.varlen_attention
    monkeypatch.setattr(attention, "varlen_attention", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    trl_grpo.register_padded_varlen()
    varlen = load_model("builtin:tiny-m", 101, torch.float64, 0, attention.NAME)  # 6 query heads, 2 KV heads
    sdpa = load_model("builtin:tiny-m", 101, torch.float64, 0, "sdpa")
    ids, mask = _padded_batch()
    ours, theirs = (model(input_ids=ids, attention_mask=mask).logits for model in (varlen, sdpa))
    kept = mask.bool()
    torch.testing.assert_close(ours[kept], theirs[kept], rtol=1e-10, atol=1e-10)
    assert calls and all(shape[0] == 1 and shape[2] == int(kept.sum()) for shape in calls)  # one packed row a layer
    ours[kept].square().sum().backward()
    theirs[kept].square().sum().backward()
    for (name, a), b in zip(varlen.named_parameters(), sdpa.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-9, msg=name)


def test_trls_model_loads_with_ours_varlen_for_padded_batches(tmp_path):
    from transformers import AttentionInterface

    from ftis_engine.model import attention

    trl_grpo.export_model("builtin:tiny-s", 0, torch.float32, tmp_path / "m")
    model = trl_grpo.trainer_model(tmp_path / "m", torch.float32, attention.NAME, "eager")
    assert model.config._attn_implementation == attention.NAME
    assert AttentionInterface._global_mapping[attention.NAME] is trl_grpo.padded_varlen_attention


@needs_trl
def test_the_grpo_config_autocasts_to_bf16_unless_the_precision_is_fp32(tmp_path):
    for precision, bf16 in (("fp32-master", True), ("bf16", True), ("fp32", False)):
        args = trl_grpo.parse_args(["--precision", precision, "--output", "x.json"])
        assert trl_grpo.grpo_config(args, tmp_path).bf16 is bf16


@needs_trl
def test_the_json_says_what_ran_and_trl_trains_the_model_built_for_it(tmp_path, monkeypatch):
    """The settings pair_summary.py compares, and the model TRL is given: float32 masters with compiled layers
    here (TRL's own training is stood in for: compiling on a CPU takes minutes)."""
    import trl

    from ftis_engine.model import layers

    given = {}

    class Trainer:
        def __init__(self, model, args, **kwargs):
            given.update(model=model, args=args)

        def train(self):
            pass

    monkeypatch.setattr(trl, "GRPOTrainer", Trainer)
    assert trl_grpo.main(["--quick", "--precision", "fp32-master", "--layers", "compile",
                          "--output", str(tmp_path / "trl.json")]) == 0
    assert {p.dtype for p in given["model"].parameters()} == {torch.float32} and given["args"].bf16
    assert layers.compiled(given["model"])
    settings = json.loads((tmp_path / "trl.json").read_text())["settings"]
    assert settings == {"precision": "bfloat16", "master_dtype": "float32", "attention": "sdpa",
                        "compile": "compile", "vocab_size": 101, "batch": 8, "length": 8}


@needs_trl
def test_the_grpo_config_matches_ours_alone(tmp_path):
    """configs/gpu/alone-shape-1.5b.yaml's numbers: 144 completions a step in one optimizer step, groups of 12,
    512 new tokens, the sequence-mean loss, TIS capped at 2, vLLM colocated and asleep during the update."""
    config = trl_grpo.grpo_config(trl_grpo.parse_args(["--output", "x.json"]), tmp_path)
    assert (config.per_device_train_batch_size, config.gradient_accumulation_steps) == (16, 9)
    assert (config.generation_batch_size, config.steps_per_generation, config.num_generations) == (144, 9, 12)
    assert (config.max_completion_length, config.temperature, config.learning_rate) == (512, 1.0, 1e-6)
    assert (config.loss_type, config.beta, config.epsilon, config.scale_rewards) == ("grpo", 0.0, 0.2, "group")
    assert (config.vllm_importance_sampling_mode, config.vllm_importance_sampling_clip_max) == ("token_truncate", 2.0)
    assert (config.use_vllm, config.vllm_mode, config.vllm_enable_sleep_mode) == (True, "colocate", True)
    assert (config.vllm_gpu_memory_utilization, config.vllm_max_model_length) == (0.3, 1024)
    assert config.gradient_checkpointing and config.bf16


@needs_trl
def test_quick_mode_trains_two_steps_on_cpu(tmp_path):
    assert trl_grpo.main(["--quick", "--output", str(tmp_path / "trl.json")]) == 0
    result = json.loads((tmp_path / "trl.json").read_text())
    assert [s["step"] for s in result["steps"]] == [1, 2]
    for step in result["steps"]:
        assert step["completions"] == 8 and 0 < step["tokens"] <= 8 * 8
        assert step["seconds"] == pytest.approx(step["gen_seconds"] + step["weight_sync_seconds"]
                                                + step["score_seconds"] + step["update_seconds"])
    assert result["config"]["grpo"]["loss_type"] == "grpo"
    assert result["summary"]["median_step_seconds"] > 0
    assert result["settings"] == {"precision": "float32", "master_dtype": "float32", "attention": "sdpa",
                                  "compile": "eager", "vocab_size": 101, "batch": 8, "length": 8}


@needs_trl
def test_trls_engine_gets_ours_compilation_setting_and_dtype(monkeypatch):
    import trl.generation.vllm_generation as trl_vllm

    from ftis_engine.generation.vllm import COMPILATION_CONFIG

    seen = {}
    monkeypatch.setattr(trl_vllm, "LLM", lambda **kwargs: seen.update(kwargs), raising=False)
    trl_grpo.engine_as_ours()
    trl_vllm.LLM(model="m", max_num_batched_tokens=4096)
    assert seen == {"model": "m", "max_num_batched_tokens": 4096, "compilation_config": COMPILATION_CONFIG,
                    "dtype": "bfloat16"}  # float32 masters saved for the engine: it still generates in bf16


@needs_trl
def test_a_run_that_stops_still_writes_what_stopped_it(tmp_path, monkeypatch):
    import trl

    def stop(self, *args, **kwargs):
        raise RuntimeError("CUDA out of memory\nmore lines")

    monkeypatch.setattr(trl.GRPOTrainer, "train", stop)
    assert trl_grpo.main(["--quick", "--output", str(tmp_path / "trl.json")]) == 1
    result = json.loads((tmp_path / "trl.json").read_text())
    assert result["error"] == "RuntimeError: CUDA out of memory" and result["steps"] == []


def test_trls_engine_levers_are_recorded_as_ours_are():
    """TRL colocated sleeps at level 2 and seeds its engine once; its KV cache is ours' when --kv-cache-gib gives it
    (pair_summary.LEVERS compares them with ours')."""
    args = trl_grpo.parse_args(["--kv-cache-gib", "3", "--gpu-memory-utilization", "0.1", "--output", "x.json"])
    assert trl_grpo.engine_levers(args) == {"sleep_level": 2, "seeds": "one stream", "kv_cache_gib": 3.0,
                                            "gpu_memory_utilization": 0.1}
    assert trl_grpo.engine_levers(trl_grpo.parse_args(["--output", "x.json"]))["kv_cache_gib"] == "share"
    assert trl_grpo.engine_levers(trl_grpo.parse_args(["--quick", "--output", "x.json"])) == {}  # no engine


@needs_trl
def test_trls_engine_gets_ours_kv_cache_when_given(monkeypatch):
    import trl.generation.vllm_generation as trl_vllm

    seen = {}
    monkeypatch.setattr(trl_vllm, "LLM", lambda **kwargs: seen.update(kwargs), raising=False)
    trl_grpo.engine_as_ours(kv_cache_gib=2.5)
    trl_vllm.LLM(model="m")
    assert seen["kv_cache_memory_bytes"] == int(2.5 * 2**30)


@needs_trl
def test_the_json_is_written_after_every_step_so_a_cut_run_keeps_its_steps(tmp_path, monkeypatch):
    written = []
    real = trl_grpo.result_json
    monkeypatch.setattr(trl_grpo, "result_json", lambda *a, **k: written.append(len(k["steps"])) or real(*a, **k))
    assert trl_grpo.main(["--quick", "--output", str(tmp_path / "trl.json")]) == 0
    assert written[0] == 1 and written[-1] == 2 and sorted(written) == written  # step 1's JSON before step 2 ran
    assert not (tmp_path / "trl.json.partial").exists()
