"""Members: the start-up model checks, and checkpoints of models whose weights transformers renames on load."""

from __future__ import annotations

import pytest
import torch

from ftis_engine.checkpoint import restore_member, save_member
from ftis_engine.config import ConfigError
from ftis_engine.update import check_model

from .helpers import member


def test_a_model_whose_logits_are_not_the_lm_head_of_its_hidden_states_is_refused():
    m, _ = member(0)
    check_model(m)  # a plain Qwen2 passes
    # soft-capping / logit scaling, as Gemma2, Cohere or Granite apply after the head
    m.causal_lm.lm_head.register_forward_hook(lambda module, inputs, output: 30.0 * torch.tanh(output / 30.0) * 2)
    with pytest.raises(ConfigError, match=r"members\.0\.model: its logits are not lm_head"):
        check_model(m)


def _tiny_local_model(tmp_path, architecture: str):
    import transformers

    from ftis_engine.models import load_tokenizer

    tokenizer = load_tokenizer("builtin:tiny-s")
    common = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if architecture == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
        model = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(config)
    model.save_pretrained(str(tmp_path / architecture))
    tokenizer.save_pretrained(str(tmp_path / architecture))
    return str(tmp_path / architecture)


@pytest.mark.parametrize("architecture", ["qwen2", "mixtral"])
def test_a_checkpoint_restores_every_weight_exactly(tmp_path, architecture):
    """transformers 5 saves some families (MoE experts) under their original names; resume must map them back."""
    path = _tiny_local_model(tmp_path, architecture)
    m, _ = member(1, f"members.1.model={path}", "members.1.lora=null")
    before = {k: v.clone() for k, v in m.model.state_dict().items()}
    save_member(m, tmp_path / "ckpt" / "members" / m.name, save_optimizer=False)
    with torch.no_grad():
        for p in m.model.parameters():
            p.add_(1.0)
    restore_member(m, tmp_path / "ckpt", load_optimizer=False)
    after = m.model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
