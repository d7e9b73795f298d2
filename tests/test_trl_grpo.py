"""benchmarks/trl_grpo.py, the TRL side of issue 28: what can be checked without TRL (the model export it shares
with the vLLM generator, the reward, the phase clock), and, where TRL is installed (not in CI), its config and
its CPU quick mode."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from benchmarks import trl_grpo

needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed (not in CI)")


def test_save_for_engine_writes_a_model_that_loads_back_identical(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ftis_engine.generation.vllm import save_for_engine
    from ftis_engine.models import load_model, load_tokenizer

    tokenizer = load_tokenizer("builtin:tiny-s")
    model = load_model("builtin:tiny-s", len(tokenizer), torch.float32, 0, "sdpa")
    assert save_for_engine(model, tokenizer, tmp_path / "m") == str(tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.float32)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert AutoTokenizer.from_pretrained(str(tmp_path / "m"))("123=")["input_ids"] == tokenizer("123=")["input_ids"]


def test_the_reward_is_the_tasks_and_counts_completion_tokens():
    from ftis_engine.config import DataSettings
    from ftis_engine.tasks import load_task

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


@needs_trl
def test_trls_engine_gets_ours_compilation_setting(monkeypatch):
    import trl.generation.vllm_generation as trl_vllm

    from ftis_engine.generation.vllm import COMPILATION_CONFIG

    seen = {}
    monkeypatch.setattr(trl_vllm, "LLM", lambda **kwargs: seen.update(kwargs), raising=False)
    trl_grpo.compile_engine_as_ours()
    trl_vllm.LLM(model="m", max_num_batched_tokens=4096)
    assert seen == {"model": "m", "max_num_batched_tokens": 4096, "compilation_config": COMPILATION_CONFIG}


@needs_trl
def test_a_run_that_stops_still_writes_what_stopped_it(tmp_path, monkeypatch):
    import trl

    def stop(self, *args, **kwargs):
        raise RuntimeError("CUDA out of memory\nmore lines")

    monkeypatch.setattr(trl.GRPOTrainer, "train", stop)
    assert trl_grpo.main(["--quick", "--output", str(tmp_path / "trl.json")]) == 1
    result = json.loads((tmp_path / "trl.json").read_text())
    assert result["error"] == "RuntimeError: CUDA out of memory" and result["steps"] == []
