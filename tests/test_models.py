"""Models: built-in models and tokenizers; without a reachable hub the run goes offline at once (one warning)."""

from __future__ import annotations

import logging

import pytest
import torch

import huggingface_hub.constants as hub

from ftis_engine.core import hub as probe
from ftis_engine.model import models


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
    """A process imported huggingface_hub before a probe found the hub unreachable and set HF_HUB_OFFLINE: the
    environment's value counts, unprobed, and the library follows."""
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
    from ftis_engine.model.models import bpe_corpus, load_model, load_tokenizer, vocabulary_hash

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
    from ftis_engine.model.models import build_bpe_tokenizer, load_tokenizer

    assert load_tokenizer("builtin:tiny-m-bpe").get_vocab() == build_bpe_tokenizer().get_vocab()


def test_the_3b_shape_has_qwen2_5_3b_layers():
    from ftis_engine.model.models import CONTEXT, TINY_MODELS

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


def test_a_qwen_vocabulary_shape_has_the_real_models_embedding_head_and_special_ids():
    """builtin:shape-1.5b-qwen is Qwen2.5-1.5B at its real size: 1,543,714,304 parameters, of which the tied embedding
    and head are 151,936 x 1,536; it ends a turn at <|im_end|> and pads with <|endoftext|> as Qwen2.5 does. Its
    shipped-tokenizer twin keeps an embedding of the 101 ids it is given."""
    model = models.load_model("builtin:shape-1.5b-qwen", 151_936, torch.bfloat16, 0, "sdpa", torch.device("meta"))
    assert model.get_input_embeddings().weight.shape == model.get_output_embeddings().weight.shape == (151_936, 1536)
    assert sum(p.numel() for p in model.parameters()) == 1_543_714_304
    assert (model.config.eos_token_id, model.config.pad_token_id) == (151_645, 151_643)
    small = models.load_model("builtin:shape-1.5b", 101, torch.bfloat16, 0, "sdpa", torch.device("meta"))
    assert small.get_input_embeddings().weight.shape == (101, 1536) and small.config.eos_token_id == 0
    assert models.check_model_spec("builtin:shape-3b-qwen") == 32768


@pytest.mark.parametrize("load, loader", [
    (lambda path: models.load_tokenizer(path), "AutoTokenizer"),
    (lambda path: models.check_model_spec(path), "AutoConfig"),
    (lambda path: models.load_model(path, 101, torch.float32, 0, "sdpa"), "AutoModelForCausalLM")])
def test_a_model_that_cannot_be_loaded_is_one_line_and_a_programming_error_is_itself(tmp_path, monkeypatch, load,
                                                                                      loader):
    """What from_pretrained raises for a model or tokenizer that is not there or not readable (LOAD_ERRORS: an
    OSError, an ImportError for a missing tokenizer library) is a ModelSpecError naming it; an AttributeError is
    the code's own and propagates as itself."""
    import transformers

    for error, caught in [(OSError("no config.json in it"), models.ModelSpecError),
                          (ImportError("this tokenizer needs sentencepiece"), models.ModelSpecError),
                          (AttributeError("'NoneType' object has no attribute 'vocab'"), AttributeError)]:
        def raising(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(getattr(transformers, loader), "from_pretrained", raising)
        with pytest.raises(caught) as raised:
            load(str(tmp_path))
        assert str(raised.value) == (f"cannot load {'tokenizer' if loader == 'AutoTokenizer' else 'model'} "
                                     f"{str(tmp_path)!r}: {error}" if caught is models.ModelSpecError else str(error))


def test_a_qwen_vocabulary_shape_refuses_a_tokenizer_of_another_size():
    with pytest.raises(models.ModelSpecError, match="builtin:shape-0.5b-qwen takes Qwen2.5's vocabulary of 151,936"):
        models.load_model("builtin:shape-0.5b-qwen", 101, torch.float32, 0, "sdpa", torch.device("meta"))


def test_a_qwen_vocabulary_shape_reads_the_packaged_qwen_tokenizer_and_names_its_fetch(tmp_path, monkeypatch):
    """Its tokenizer is the fetched packaged Qwen2.5-Coder's (a stand-in folder here: the real one is half a
    gigabyte to fetch); before the fetch, the error names the command."""
    from ftis_engine.model import packaged

    monkeypatch.setenv("FTIS_CACHE_DIR", str(tmp_path))
    with pytest.raises(models.ModelSpecError, match="run `ftis-engine models fetch qwen2.5-coder-0.5b-instruct`"):
        models.load_tokenizer("builtin:shape-1.5b-qwen")
    folder = packaged.model_dir("qwen2.5-coder-0.5b-instruct")
    models.build_bpe_tokenizer().save_pretrained(str(folder))  # a tokenizer that is not the built-ins' own
    (folder / packaged.MARKER).write_text("{}")  # a fetched folder: its tokenizer is all a built-in reads
    assert models.builtin_tokenizer_dir("builtin:shape-1.5b-qwen") == folder
    tokenizer = models.load_tokenizer("builtin:shape-1.5b-qwen")
    assert tokenizer.get_vocab() == models.load_tokenizer("builtin:tiny-s-bpe").get_vocab()
    assert models.load_tokenizer("builtin:shape-1.5b").get_vocab() == models.build_tiny_tokenizer().get_vocab()


def test_the_fetched_qwen_tokenizer_has_the_vocabulary_and_special_ids_the_qwen_shapes_assume():
    """Runs where the packaged model is fetched into FTIS_CACHE_DIR (a test session's own cache never holds it: set
    FTIS_CACHE_DIR to a cache that does); checked by hand on 2026-11-28 against the fetched model."""
    from ftis_engine.model import packaged

    if not (packaged.model_dir("qwen2.5-coder-0.5b-instruct") / packaged.MARKER).is_file():
        pytest.skip("qwen2.5-coder-0.5b-instruct is not fetched into FTIS_CACHE_DIR")
    tokenizer = models.load_tokenizer("builtin:shape-0.5b-qwen")
    assert len(tokenizer) == models.QWEN_VOCAB_SIZE
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", models.SPECIAL_IDS["qwen"]["eos_token_id"])
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", models.SPECIAL_IDS["qwen"]["pad_token_id"])
