"""Models: built-in models and tokenizers; without a reachable hub the run goes offline at once (one warning)."""

from __future__ import annotations

import logging

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
