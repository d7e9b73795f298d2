"""Property tests (hypothesis): untrusted input either parses or is refused in the one way that names the problem;
nothing else escapes. A peer's wire buffer goes through the receiver production runs (Admission.receive: decode,
the checks, the re-score and a foreign peer's adoption): admitted whole or rejected with a reason, never raising.
A user's overrides give a config or one line naming the field."""

from __future__ import annotations

import math
import time

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftis_engine.config import ConfigError, RunConfig, load_config
from ftis_engine.exchange import Parcel
from ftis_engine.exchange.admission import Admission
from ftis_engine.exchange.verify import RolloutChecker
from ftis_engine.model.models import load_tokenizer
from ftis_engine.data.rollouts import HEADER_WORDS, Rollout, RolloutError, decode, encode
from ftis_engine.topology.schedule import Schedule
from ftis_engine.data.tasks import load_task

from .helpers import TINY, short_config

INT32 = st.integers(-(2**31), 2**31 - 1)


# The production path a peer's parcel takes (exchange/admission.py: Admission.receive -> _admit -> decode, the
# checks, RolloutChecker.check and .adopt), with a same-tokenizer peer and a foreign one (member 1 speaks BPE).
CONFIG = short_config("members.1.model=builtin:tiny-m-bpe", "rollout.max_new_tokens=6")
TASK = load_task(CONFIG.data, CONFIG.seed)
SCHEDULE = Schedule(CONFIG, tuple(range(len(TASK.train))))
CHAR, BPE = load_tokenizer("builtin:tiny-s"), load_tokenizer("builtin:tiny-m-bpe")


def _admission(foreign: bool) -> Admission:
    checker = RolloutChecker(TASK, CHAR, len(CHAR), CONFIG.rollout.max_new_tokens, foreign={1: BPE} if foreign else {})
    return Admission(CONFIG, SCHEDULE, checker, receiver=0)


def _honest(foreign: bool, texts: list[str]) -> Parcel:
    """Member 1's honest parcel of step 1: each dealt completion one of `texts` in its tokenizer (+ EOS), each
    token claimed below 1/8 (at most 4 texts branch: the claims of one prefix's branches sum below 1)."""
    tokenizer = BPE if foreign else CHAR
    rollouts = []
    for k, (prompt, n) in enumerate(sorted(SCHEDULE.deal(1)[1].items())):
        for j in range(n):
            ids = tokenizer(texts[(k + j) % len(texts)], add_special_tokens=False)["input_ids"][:5]
            ids = ids + [tokenizer.eos_token_id]
            reward = TASK.score(tokenizer, [ids], [TASK.train[prompt]])[0]
            rollouts.append(Rollout(1, prompt, torch.tensor(ids, dtype=torch.int32), -torch.rand(len(ids)) - math.log(8),
                                    reward, "stop", 0, time.time()))
    return Parcel(1, 1, 0, encode(rollouts))


def _receive(foreign: bool, buffer: torch.Tensor):
    """What receiver 0 makes of member 1's parcel: it never raises; admitted rollouts are whole, valid groups."""
    out = _admission(foreign).receive([Parcel(1, 1, 0, buffer)], step=1)
    assert len(out.rejected) <= 1 and not (out.rejected and out.rollouts)
    for r in out.rollouts:
        assert r.member == 1 and 1 <= r.num_tokens and bool(((r.completion_ids >= 0) &
                                                             (r.completion_ids < len(CHAR))).all())
        assert (r.seq_logprob is not None) == foreign
    return out


TEXTS = st.lists(st.text(alphabet="0123456789=+,ab ", min_size=1, max_size=6), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(st.lists(INT32, max_size=64), st.booleans())
def test_any_buffer_is_admitted_or_rejected_by_the_receiver_never_raising(words, foreign):
    buffer = torch.tensor(words, dtype=torch.int32)
    try:
        rollouts = decode(buffer)
    except RolloutError:
        rollouts = None
    if rollouts is not None:
        assert sum(r.num_tokens for r in rollouts) * 2 + 1 + HEADER_WORDS * len(rollouts) == len(words)
    _receive(foreign, buffer)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(TEXTS, st.booleans(), st.data())
def test_an_honest_parcel_is_admitted_and_with_any_word_changed_is_admitted_or_rejected_cleanly(texts, foreign,
                                                                                               data):
    buffer = _honest(foreign, texts).buffer
    out = _receive(foreign, buffer)
    dealt = sum(SCHEDULE.deal(1)[1].values())
    assert not out.rejected and len(out.rollouts) + out.foreign_dropped == dealt
    i = data.draw(st.integers(0, buffer.numel() - 1))
    buffer[i] = data.draw(INT32)
    _receive(foreign, buffer)


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
