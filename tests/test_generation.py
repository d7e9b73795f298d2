"""The HF generator: sampler log-probs, EOS handling, seeding."""

from __future__ import annotations

import warnings

import pytest
import torch

import ftis_engine.generation as generation
from ftis_engine.generation import SamplingSettings, cut_at_eos
from ftis_kernels import fused_linear_token_logprobs

from .helpers import member


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_generation_logprobs_are_the_trainers_logprobs_of_the_sampled_tokens(temperature):
    m, _ = member(1)
    prompts = [m.tokenizer("12=")["input_ids"], m.tokenizer("98765=")["input_ids"]]
    groups = m.generator.generate(prompts, SamplingSettings(n=3, max_new_tokens=12, temperature=temperature, seed=5))
    body, head = m.body_and_head()
    for prompt, completions in zip(prompts, groups):
        assert len(completions) == 3
        for c in completions:
            ids = torch.tensor(prompt + c.token_ids.tolist())
            with torch.no_grad():
                hidden = body(input_ids=ids[None], use_cache=False).last_hidden_state[0]
            rows = hidden[len(prompt) - 1 : len(prompt) - 1 + c.token_ids.numel()]
            recomputed = fused_linear_token_logprobs(rows, head.weight, c.token_ids.long(), temperature=temperature)
            torch.testing.assert_close(c.logprobs, recomputed, rtol=0, atol=2e-5)


def test_completions_stop_at_eos_or_at_max_new_tokens():
    m, _ = member(0)
    prompts = [m.tokenizer(f"{i}=")["input_ids"] for i in range(8)]
    groups = m.generator.generate(prompts, SamplingSettings(n=8, max_new_tokens=40, seed=0))
    reasons = set()
    for completions in groups:
        for c in completions:
            reasons.add(c.finish_reason)
            eos_positions = [i for i, t in enumerate(c.token_ids.tolist()) if t in m.generator.eos_ids]
            if c.finish_reason == "stop":
                assert eos_positions == [c.token_ids.numel() - 1]
            else:
                assert c.token_ids.numel() == 40 and not eos_positions
            assert c.logprobs.shape == c.token_ids.shape and bool((c.logprobs <= 0).all())
    assert reasons == {"stop", "length"}


def test_same_seed_same_completions_other_seed_other_ones():
    m, _ = member(0)
    prompts = [m.tokenizer("3=")["input_ids"]]
    a = m.generator.generate(prompts, SamplingSettings(n=4, max_new_tokens=6, seed=1))[0]
    b = m.generator.generate(prompts, SamplingSettings(n=4, max_new_tokens=6, seed=1))[0]
    c = m.generator.generate(prompts, SamplingSettings(n=4, max_new_tokens=6, seed=2))[0]
    assert all(torch.equal(x.token_ids, y.token_ids) for x, y in zip(a, b))
    assert not all(torch.equal(x.token_ids, y.token_ids) for x, y in zip(a, c))


def test_sampling_and_greedy_never_wait_on_the_other_ranks_of_the_world(monkeypatch):
    """transformers turns on synced_gpus (an all-reduce over the whole world at every token) for an FSDP-managed
    model in a world of several ranks; each rank generates its own prompts, and the world holds other members."""
    m, _ = member(0)
    prompts = [m.tokenizer("3=")["input_ids"]]
    m.generator.model._is_fsdp_managed_module = True  # what torch's fully_shard marks its modules with
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)

    def all_reduce(*args, **kwargs):
        raise AssertionError("generation waited on the world")

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    assert len(m.generator.generate(prompts, SamplingSettings(n=2, max_new_tokens=4, seed=0))[0]) == 2
    assert len(m.generator.greedy(prompts, 4)) == 1


def test_cut_at_eos():
    done = cut_at_eos(torch.tensor([5, 6, 0, 7]), torch.tensor([-1.0, -2.0, -3.0, -4.0]), {0}, 4)
    assert done.token_ids.tolist() == [5, 6, 0] and done.finish_reason == "stop"
    cut = cut_at_eos(torch.tensor([5, 6, 7]), torch.zeros(3), {0}, 2)
    assert cut.token_ids.tolist() == [5, 6] and cut.finish_reason == "length"


def test_top_p_below_one_warns_once_about_biased_ratios(monkeypatch):
    monkeypatch.setattr(generation, "_warned_biased", False)
    m, _ = member(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            m.generator.generate([m.tokenizer("3=")["input_ids"]], SamplingSettings(n=2, max_new_tokens=2, top_p=0.9))
    assert sum("biased" in str(w.message) for w in caught) == 1


def test_a_top_k_that_covers_the_whole_vocabulary_truncates_nothing_and_warns_nothing(monkeypatch):
    monkeypatch.setattr(generation, "_warned_biased", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generation.warn_if_biased(1.0, 500, vocab_size=500)
        assert not caught
        generation.warn_if_biased(1.0, 499, vocab_size=500)
    assert sum("biased" in str(w.message) for w in caught) == 1


def test_a_models_shipped_sampling_defaults_do_not_leak_into_the_recorded_distribution():
    """Models ship generation configs (min_p, top_k, temperature...); sampling must use exactly ours."""
    m, _ = member(1)
    m.causal_lm.generation_config.min_p = 0.999  # would turn sampling into greedy decoding
    m.causal_lm.generation_config.top_k = 3
    m.causal_lm.generation_config.temperature = 0.3
    prompt = m.tokenizer("12=")["input_ids"]
    completions = m.generator.generate([prompt], SamplingSettings(n=8, max_new_tokens=6, seed=3))[0]
    body, head = m.body_and_head()
    for c in completions:
        ids = torch.tensor(prompt + c.token_ids.tolist())
        with torch.no_grad():
            hidden = body(input_ids=ids[None], use_cache=False).last_hidden_state[0]
        rows = hidden[len(prompt) - 1 : len(prompt) - 1 + c.token_ids.numel()]
        torch.testing.assert_close(c.logprobs, fused_linear_token_logprobs(rows, head.weight, c.token_ids.long()),
                                   rtol=0, atol=2e-5)
    assert m.causal_lm.generation_config.min_p == 0.999  # the model's own config is left as it was
    assert len({tuple(c.token_ids.tolist()) for c in completions}) > 1  # sampled, not greedy


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_diverged_models_logits_end_generation_with_a_non_finite_error_not_the_samplers_traceback(value):
    """A diverged model's logits (NaN; +inf, or -inf for every token, from huge finite weights) made multinomial
    raise its own RuntimeError ("probability tensor contains either inf, nan or element < 0"; a device-side assert
    on a GPU). Generation now ends with NonFiniteInputError, which the step turns into the divergence advice."""
    from ftis_kernels import NonFiniteInputError

    m, _ = member(0)

    def diverged(module, inputs, logits):
        logits = logits.clone()
        if value == -float("inf"):
            logits[0, -1, :] = value
        else:
            logits[0, -1, 3] = value
        return logits

    m.body_and_head()[1].register_forward_hook(diverged)
    with pytest.raises(NonFiniteInputError, match="logits held NaN or \\+inf in generation"):
        m.generator.generate([[5, 6], [7]], SamplingSettings(n=2, max_new_tokens=3, seed=0))


def test_the_recorder_samples_a_non_finite_row_from_zeros_and_leaves_the_others_alone():
    from ftis_engine.generation.hf import _SampledLogprobRecorder

    recorder = _SampledLogprobRecorder()
    inf = float("inf")
    scores = torch.tensor([[0.5, -inf, 2.0], [float("nan"), 1.0, 0.0], [inf, 0.0, 0.0], [-inf, -inf, -inf]])
    out = recorder(torch.zeros(4, 1, dtype=torch.long), scores.clone())
    assert torch.equal(out[0], scores[0]) and torch.equal(out[1:], torch.zeros(3, 3))
    assert bool(recorder.nonfinite)
    recorder = _SampledLogprobRecorder()
    recorder(torch.zeros(1, 1, dtype=torch.long), scores[:1].clone())  # -inf alone is a masked token, not divergence
    assert not bool(recorder.nonfinite)


def test_a_failed_generation_leaves_the_model_in_the_mode_it_found_it():
    m, _ = member(0)
    m.model.train()

    def broken_generate(*args, **kwargs):
        raise RuntimeError("out of memory")

    m.causal_lm.generate = broken_generate
    for call in (lambda: m.generator.generate([[5, 6]], SamplingSettings(n=2, max_new_tokens=3)),
                 lambda: m.generator.greedy([[5, 6]], 3)):
        with pytest.raises(RuntimeError, match="out of memory"):
            call()
        assert m.model.training  # dropout and friends stay as training needs them


def test_eos_ids_are_the_generation_configs_and_the_tokenizers():
    from types import SimpleNamespace

    tokenizer = SimpleNamespace(eos_token_id=2)
    assert generation.eos_token_ids(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[7, 9])),
                                    tokenizer) == {2, 7, 9}
    assert generation.eos_token_ids(SimpleNamespace(), tokenizer) == {2}  # a model without a generation config


def test_a_vllm_engine_that_fails_to_start_leaves_no_temporary_weights(monkeypatch, tmp_path):
    import sys
    import tempfile
    from types import ModuleType

    from ftis_engine.generation import vllm as vllm_gen

    fake = ModuleType("vllm")

    class LLM:
        def __init__(self, **kwargs):
            raise RuntimeError("CUDA out of memory")

    fake.LLM = LLM
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(vllm_gen, "check_available", lambda device=None: None)
    monkeypatch.setattr(vllm_gen, "engine_platform", lambda: type("Platform", (), {
        "device_type": "cpu", "is_sleep_mode_available": staticmethod(lambda: False)})())
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    m, config = member(0)
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        vllm_gen.VLLMGenerator(m.model, m.tokenizer, torch.device("cpu"), config.members[0], config, seed=0)
    assert list(tmp_path.iterdir()) == []  # the built-in model's weights written for the engine are gone
