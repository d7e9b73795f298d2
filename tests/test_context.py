"""The context budget (context.py): prompts measured with every member's tokenizer, what a completion, a vLLM
engine and a peer's re-encoded completion may take."""

from __future__ import annotations

import pytest

from ftis_engine.config import ConfigError
from ftis_engine.data.context import FOREIGN_EXPANSION, check_context, engine_length, foreign_limit, usable_prompts
from ftis_engine.model.models import model_context

from .helpers import short_config


def test_prompts_are_measured_with_every_members_tokenizer_the_longest_counting():
    """A prompt that fits data.max_prompt_tokens in member 1's BPE tokens but not in member 0's characters is left
    out (member 0 would exceed its context and its engine's max_model_len with it), whichever member comes first."""
    from ftis_engine.exchange.sync import LocalCollectives
    from ftis_engine.model.models import load_tokenizer
    from ftis_engine.data.tasks import load_task, prompt_ids

    char, bpe = load_tokenizer("builtin:tiny-s"), load_tokenizer("builtin:tiny-m-bpe")
    config = short_config("members.1.model=builtin:tiny-m-bpe")
    task = load_task(config.data, config.seed)
    lengths = {name: [len(prompt_ids(t, task, ex.question)) for ex in task.train] for name, t in
               (("char", char), ("bpe", bpe))}
    limit = sorted(lengths["char"])[len(lengths["char"]) // 2]  # about half the prompts fit in characters
    assert sum(b <= limit < c for b, c in zip(lengths["bpe"], lengths["char"])) > 0  # some fit only in BPE
    limited = short_config("members.1.model=builtin:tiny-m-bpe", f"data.max_prompt_tokens={limit}")
    for order in ([bpe, char], [char, bpe]):
        fits, longest = usable_prompts(limited, load_task(limited.data, limited.seed), order, LocalCollectives())
        assert fits == [i for i, n in enumerate(lengths["char"]) if n <= limit]
        assert longest <= limit


def test_an_engine_is_sized_for_the_longest_allowed_prompt_and_the_longest_completion_unless_set():
    config = short_config("data.max_prompt_tokens=100", "rollout.max_new_tokens=30", "eval.max_new_tokens=50")
    assert engine_length(config, config.members[0]) == 150
    config = short_config("data.max_prompt_tokens=100", "rollout.max_new_tokens=30")
    assert engine_length(config, config.members[0]) == 100 + max(30, config.eval.max_new_tokens or 0)
    config = short_config("members.0.vllm.max_model_len=4096")
    assert engine_length(config, config.members[0]) == 4096


def test_a_foreign_completion_may_take_what_fits_after_the_longest_prompt_and_at_most_the_expansion():
    config = short_config("rollout.max_new_tokens=8")
    assert foreign_limit(config, None, 50) == FOREIGN_EXPANSION * 8  # the model does not say its context
    assert foreign_limit(config, 1024, 50) == FOREIGN_EXPANSION * 8
    assert foreign_limit(config, 100, 50) == 50  # the context binds first
    assert model_context(type("C", (), {"max_position_embeddings": 2048})()) == 2048
    assert model_context(object()) is None


def test_a_completion_after_the_longest_prompt_must_fit_the_context():
    config = short_config("rollout.max_new_tokens=24")
    check_context(config, 0, 1024, longest_prompt=1000)  # 1000 + 24 = the whole context: fits
    with pytest.raises(ConfigError, match=r"^rollout.max_new_tokens: 24 new tokens after the longest prompt of 1001 "
                                          r"tokens .* exceed members.1.model's context of 1024 tokens"):
        check_context(config, 1, 1024, longest_prompt=1001)
    check_context(config, 0, None, longest_prompt=10**6)  # no context known: nothing to check
