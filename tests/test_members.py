"""Members: the start-up model checks, and gradient checkpointing."""

from __future__ import annotations

import pytest
import torch

from ftis_engine.config import ConfigError
from ftis_engine.run.preflight import check_model

from .helpers import member


def test_a_model_whose_logits_are_not_the_lm_head_of_its_hidden_states_is_refused():
    m, _ = member(0)
    check_model(m)  # a plain Qwen2 passes
    # soft-capping / logit scaling, as Gemma2, Cohere or Granite apply after the head
    m.causal_lm.lm_head.register_forward_hook(lambda module, inputs, output: 30.0 * torch.tanh(output / 30.0) * 2)
    with pytest.raises(ConfigError, match=r"members\.0\.model: its logits are not lm_head"):
        check_model(m)


@pytest.mark.parametrize("index", [0, 1], ids=["full", "lora"])
def test_gradient_checkpointing_leaves_the_gradient_unchanged(index):
    """train.gradient_checkpointing recomputes activations in backward; the update's gradient must not move."""
    from ftis_engine.model.update import accumulate_gradients
    from ftis_kernels import LossConfig

    from .helpers import random_items

    grads = []
    for checkpointing in ("false", "true"):
        m, _ = member(index, f"train.gradient_checkpointing={checkpointing}")
        engaged = getattr(m.causal_lm, "is_activation_checkpointing", None)  # transformers >= 5.2x
        engaged = m.causal_lm.is_gradient_checkpointing if engaged is None else engaged
        assert engaged == (checkpointing == "true")
        m.model.train()
        accumulate_gradients(m, random_items(m.vocab_size), LossConfig(method="tis"), 4096, "torch")
        grads.append({name: p.grad.clone() for name, p in m.model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("targets", ["[lm_head]", "[q_proj,lm_head]"])
def test_a_lora_adapter_on_the_output_head_is_refused_naming_the_field(targets):
    """The fused loss takes the head as one plain weight: an adapter on it would stay at zero, so it is refused."""
    with pytest.raises(ConfigError, match=r"members\.1\.lora\.target_modules: 'lm_head' is the output head"):
        member(1, f"members.1.lora.target_modules={targets}")
    m, _ = member(1, "members.1.lora.target_modules=[q_proj,v_proj]")  # the body's modules still train
    assert any("lora_B" in name for name, p in m.model.named_parameters() if p.requires_grad)


def test_a_model_whose_config_sets_dropout_trains_without_it_so_its_log_probs_are_the_generators(tmp_path):
    """The trainer's forward runs in train mode (recompute needs it); a config with attention dropout 0.5 would draw
    a new mask every forward, so two forwards of one batch would disagree with each other and with generation.
    Dropout is off: they agree exactly."""
    import transformers

    from ftis_engine.model.batch import pack
    from ftis_engine.model.models import load_tokenizer
    from ftis_engine.model.update import batch_loss
    from ftis_kernels import LossConfig

    from .helpers import random_items

    tokenizer = load_tokenizer("builtin:tiny-s")
    config = transformers.Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      attention_dropout=0.5, eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id)
    transformers.Qwen2ForCausalLM(config).save_pretrained(str(tmp_path / "m"))
    tokenizer.save_pretrained(str(tmp_path / "m"))
    m, _ = member(1, f"members.1.model={tmp_path / 'm'}", "members.1.lora=null", "train.attn_implementation=eager")
    m.model.train()
    batch = pack(random_items(m.vocab_size, seed=3))
    with torch.no_grad():
        first, second = (batch_loss(m, batch, LossConfig(), "torch").logprobs for _ in range(2))
    assert torch.equal(first, second)


def test_lora_dropout_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"members\.1\.lora\.dropout: .*the trainer runs without dropout"):
        member(1, "members.1.lora.dropout=0.05")


@pytest.mark.parametrize("index, overrides, drawn_on", [
    (0, (), "cpu"),  # its own device (a GPU in a real run: seconds instead of the CPU's minute for shape-3b)
    (0, ("swarm.mode=async", "members.0.samplers=1"), None),  # a sampler's first weights are its learner's bits
    (1, (), None),  # LoRA: the base is drawn again at every resume and eval (checkpoints hold the adapter)
    (0, ("algorithm.beta=0.01",), None),  # the KL reference is the draw, never saved
])
def test_a_builtin_is_drawn_on_its_device_only_where_that_draw_is_never_made_again(monkeypatch, index, overrides,
                                                                                   drawn_on):
    """A GPU's draws differ from the CPU's and between GPU models: where the same weights must be drawn again (a
    resume, an eval, a sampler rank, perhaps elsewhere), they are drawn on the CPU."""
    from ftis_engine.member import members

    seen = []
    real = members.load_model

    def load_model(spec, vocab_size, dtype, seed, attn, device=None):
        seen.append(device)
        return real(spec, vocab_size, dtype, seed, attn)

    monkeypatch.setattr(members, "load_model", load_model)
    member(index, *overrides)
    assert [None if d is None else d.type for d in seen] == [drawn_on]
