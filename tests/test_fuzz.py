"""Property tests (hypothesis): untrusted input — a peer's wire buffer, a user's overrides — either parses or
raises the one error type that names the problem; nothing else escapes."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftis_engine.config import ConfigError, RunConfig, load_config
from ftis_engine.exchange.admission import RolloutChecker
from ftis_engine.rollouts import HEADER_WORDS, Rollout, RolloutError, decode, encode
from ftis_engine.tasks import Example, Task

from .helpers import TINY

INT32 = st.integers(-(2**31), 2**31 - 1)


class _Digits:
    def batch_decode(self, sequences, skip_special_tokens=True):
        return ["".join(str(i % 10) for i in ids) for ids in sequences]


TASK = Task("digits", [Example(f"q{i}", "7") for i in range(20)], {}, lambda text, gold: float(text.endswith(gold)))
CHECKER = RolloutChecker(TASK, _Digits(), vocab_size=100, max_new_tokens=8)


def _honest(lengths: list[int]) -> torch.Tensor:
    rollouts = [Rollout(1, i % 20, torch.arange(n, dtype=torch.int32) % 100, -torch.ones(n) / (i + 1), 0.0, "length", 3)
                for i, n in enumerate(lengths)]
    for r in rollouts:
        r.reward = TASK.score(_Digits(), [r.completion_ids], [TASK.train[r.prompt_index]])[0]
    return encode(rollouts)


@settings(max_examples=300, deadline=None)
@given(st.lists(INT32, max_size=64))
def test_any_buffer_decodes_or_is_a_rollout_error(words):
    buffer = torch.tensor(words, dtype=torch.int32)
    try:
        rollouts = decode(buffer)
    except RolloutError:
        return
    assert sum(r.num_tokens for r in rollouts) * 2 + 1 + HEADER_WORDS * len(rollouts) == len(words)
    try:
        CHECKER.accept(buffer, sender=1, dealt=None)
    except RolloutError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 8), min_size=1, max_size=4), st.data())
def test_an_honest_buffer_with_any_word_changed_is_accepted_or_rejected_cleanly(lengths, data):
    buffer = _honest(lengths)
    kept, unverified = CHECKER.accept(buffer, sender=1, dealt=None)
    assert len(kept) == len(lengths) and unverified == 0
    i = data.draw(st.integers(0, buffer.numel() - 1))
    buffer[i] = data.draw(INT32)
    try:
        CHECKER.accept(buffer, sender=1, dealt=None)
    except RolloutError:
        pass


KEYS = ["seed", "members.0.lr", "members.0.betas", "members.1.lora.r", "members.5.lr", "algorithm.method",
        "algorithm.kl_threshold", "algorithm.is_cap", "rollout.group_size", "rollout.temperature", "train.steps",
        "train.backend", "eval.every", "data.task", "checkpoint.keep_last", "nope", "members.0", "algorithm",
        "members.x.lr", "rollout..group_size"]
VALUES = st.one_of(
    st.sampled_from(["", "null", "true", "[]", "{}", "[1, 2]", ".inf", "-.inf", ".nan", "1e400", "-1", "0", "f-tis",
                     "gepo", "abc", "[1.5, 0.9]", "99999999999999999999", "{a: 1}", ":", "- x"]),
    st.integers(-(2**70), 2**70).map(str), st.floats(allow_nan=True).map(repr), st.text(max_size=8),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(KEYS), VALUES), max_size=3))
def test_any_overrides_give_a_config_or_one_line_naming_the_field(pairs):
    overrides = [f"{k}={v}" for k, v in pairs]
    try:
        config = load_config(TINY, overrides)
    except ConfigError as exc:
        message = str(exc)
        assert message and "\n" not in message
        return
    assert isinstance(config, RunConfig)
