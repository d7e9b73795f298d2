"""Models: built-in models and tokenizers; without a reachable hub the run goes offline at once (one warning)."""

from __future__ import annotations

import logging

import pytest
import torch

import huggingface_hub.constants as hub

from ftis_engine import hub as probe
from ftis_engine import models


def test_an_unreachable_hub_switches_to_the_local_cache_once(monkeypatch, caplog):
    calls = []

    def refuse(address, timeout):
        calls.append((address, timeout))
        raise OSError("unreachable")

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(probe.socket, "create_connection", refuse)
    probe.hub_reachable.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="ftis_engine"):
            assert probe.hub_reachable() is False and probe.hub_reachable() is False
        assert calls == [(("huggingface.co", 443), 3)]  # probed once, within 3 s
        assert hub.HF_HUB_OFFLINE is True
        assert caplog.text.count("cannot be reached: using the local cache only") == 1
    finally:
        probe.hub_reachable.cache_clear()


def test_offline_mode_and_proxies_are_not_probed(monkeypatch):
    monkeypatch.setattr(probe.socket, "create_connection", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    probe.hub_reachable.cache_clear()
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    assert probe.hub_reachable() is False
    probe.hub_reachable.cache_clear()
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    assert probe.hub_reachable() is True
    probe.hub_reachable.cache_clear()


def test_offline_mode_set_in_the_environment_after_huggingface_hub_read_it_counts(monkeypatch):
    """A worker forked from the launcher's fork server imported huggingface_hub before the launcher's probe found
    the hub unreachable and set HF_HUB_OFFLINE: the environment's value counts, unprobed, and the library follows."""
    monkeypatch.setattr(probe.socket, "create_connection", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    probe.hub_reachable.cache_clear()
    try:
        assert probe.hub_reachable() is False
        assert hub.HF_HUB_OFFLINE is True
    finally:
        probe.hub_reachable.cache_clear()


# ------------------------------------------------------------------------------------------------- built-ins


def test_the_bpe_builtins_tokenise_the_tasks_text_otherwise_and_every_text_round_trips():
    from ftis_engine.models import bpe_corpus, load_model, load_tokenizer, vocabulary_hash

    char, bpe = load_tokenizer("builtin:tiny-s"), load_tokenizer("builtin:tiny-s-bpe")
    assert load_tokenizer("builtin:tiny-m-bpe").get_vocab() == bpe.get_vocab()
    assert vocabulary_hash(char) != vocabulary_hash(bpe) and len(bpe) == 256 and len(char) == 101
    assert set(char.get_vocab()) <= set(bpe.get_vocab())  # the same symbols, plus merges
    shorter = 0
    for text in bpe_corpus()[::50] + ["hello, World! ~`|\\ {x}\n\t", "<|im_start|>user\n12+7=<|im_end|>\n"]:
        ids = bpe(text, add_special_tokens=False)["input_ids"]
        assert bpe.decode(ids) == text  # no normaliser, no pre-tokenizer, decoding concatenates
        shorter += len(ids) < len(char(text, add_special_tokens=False)["input_ids"])
    assert shorter > 0.8 * len(bpe_corpus()[::50])  # merges do apply to the tasks' text
    assert bpe("37+45=7+5=12,3+4+1=8;82")["input_ids"] != char("37+45=7+5=12,3+4+1=8;82")["input_ids"]
    model = load_model("builtin:tiny-s-bpe", len(bpe), torch.float32, 0, "sdpa")
    assert model.get_output_embeddings().weight.shape[0] == 256


def test_the_shipped_bpe_asset_is_what_its_builder_makes():
    from ftis_engine.models import build_bpe_tokenizer, load_tokenizer

    assert load_tokenizer("builtin:tiny-m-bpe").get_vocab() == build_bpe_tokenizer().get_vocab()


def test_the_3b_shape_has_qwen2_5_3b_layers():
    from ftis_engine.models import CONTEXT, TINY_MODELS

    shape = TINY_MODELS["shape-3b"]
    assert (shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"]) == (2048, 36, 11008)
    assert CONTEXT["shape-3b"] == 32768


def _qwen2(spec: str, vocab: int):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab, max_position_embeddings=models.CONTEXT[models.builtin_name(spec)],
                       rope_theta=10000.0, bos_token_id=None, eos_token_id=0, pad_token_id=0,
                       attn_implementation="sdpa", **models.TINY_MODELS[models.builtin_name(spec)])


def test_a_builtin_built_on_the_cpu_draws_from_the_seeded_cpu_stream_and_leaves_the_callers_stream_alone():
    """The oracle: transformers' own init right after torch.manual_seed(seed). The caller's random stream goes on
    as if no model had been built."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(5)
    Qwen2ForCausalLM(_qwen2("builtin:tiny-m", 101))  # whatever else the caller draws: not part of the oracle
    torch.manual_seed(3)
    expected = Qwen2ForCausalLM(_qwen2("builtin:tiny-m", 101)).state_dict()
    torch.manual_seed(11)
    after = torch.rand(4)
    torch.manual_seed(11)
    built = models.load_model("builtin:tiny-m", 101, torch.float32, 3, "sdpa").state_dict()
    assert torch.equal(torch.rand(4), after)
    assert built.keys() == expected.keys() and all(torch.equal(built[k], expected[k]) for k in expected)
    other = models.load_model("builtin:tiny-m", 101, torch.float32, 4, "sdpa").state_dict()
    assert not torch.equal(other["model.layers.0.mlp.up_proj.weight"], built["model.layers.0.mlp.up_proj.weight"])


def test_a_builtin_is_built_on_its_device_never_first_on_the_cpu(monkeypatch):
    """shape-3b's float32 parameters took over a minute on the CPU's one random stream before they moved to the GPU
    (the pair's start, benchmarks/results/pair_h200): given a device, the model is made there. The meta device stands
    in for a GPU; the model's constructor notes the default device it runs under."""
    import transformers

    seen = []

    class Noted(transformers.Qwen2ForCausalLM):
        def __init__(self, config):
            seen.append(torch.get_default_device())
            super().__init__(config)

    monkeypatch.setattr(transformers, "Qwen2ForCausalLM", Noted)
    model = models.load_model("builtin:shape-3b", 101, torch.bfloat16, 0, "sdpa", torch.device("meta"))
    assert seen == [torch.device("meta")]
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert sum(p.numel() for p in model.parameters()) == 2_774_980_608  # 3.1 B with a 151 k vocabulary
    models.load_model("builtin:tiny-s", 101, torch.float32, 0, "sdpa")
    assert seen[1:] == [torch.device("cpu")]  # no device: the CPU, as always


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_a_builtin_repeats_with_its_seed_and_leaves_the_gpus_stream_seeded_as_a_cpu_build_does():
    device = torch.device("cuda:0")
    torch.cuda.manual_seed(11)
    after = torch.rand(4, device=device)
    torch.cuda.manual_seed(11)
    first = models.load_model("builtin:tiny-m", 101, torch.float32, 3, "sdpa", device).state_dict()
    drawn = torch.rand(4, device=device)
    torch.cuda.manual_seed(3)  # as torch.manual_seed(seed) in a CPU build always left it: the GPU stream from the seed
    assert torch.equal(drawn, torch.rand(4, device=device)) and not torch.equal(drawn, after)
    again = models.load_model("builtin:tiny-m", 101, torch.float32, 3, "sdpa", device).state_dict()
    assert all(t.device == device and torch.equal(t, again[k]) for k, t in first.items())
