"""Members with different tokenizers: a foreign peer's text re-encoded by the receiver, its sequence log-prob
carried to the op's sequence-level path, refusal, and runs in one and in two processes (sync and async)."""

from __future__ import annotations

import math

import subprocess
import sys
import time

import pytest
import torch

from ftis_engine.model.batch import TrainItem, pack
from ftis_engine.exchange import Parcel
from ftis_engine.exchange.admission import Admission
from ftis_engine.exchange.verify import RolloutChecker
from ftis_engine.model.models import load_tokenizer
from ftis_engine.data.rollouts import Rollout, encode
from ftis_engine.topology.schedule import Schedule
from ftis_engine.data.tasks import load_task

from .helpers import run_records, short_config
from .test_swarm import _args, _env

CHAR, BPE = load_tokenizer("builtin:tiny-s"), load_tokenizer("builtin:tiny-m-bpe")
CONFIG = short_config("members.1.model=builtin:tiny-m-bpe", "rollout.max_new_tokens=8")
TASK = load_task(CONFIG.data, CONFIG.seed)


def _sender_rollouts(texts: list[str], prompt: int, stop: bool = True, member: int = 1) -> list[Rollout]:
    """Honest rollouts of member 1 (BPE) for one prompt: its tokens of each text (+ EOS when stopped)."""
    out = []
    for text in texts:
        ids = BPE(text, add_special_tokens=False)["input_ids"] + ([BPE.eos_token_id] if stop else [])
        logprobs = -torch.linspace(0.1, 1.0, len(ids)) - math.log(len(texts) + 1)  # branches' claims sum below 1
        reward = TASK.score(BPE, [ids], [TASK.train[prompt]])[0]
        out.append(Rollout(member, prompt, torch.tensor(ids, dtype=torch.int32), logprobs, reward,
                           "stop" if stop else "length", 0, time.time()))
    return out


def _checker() -> RolloutChecker:
    return RolloutChecker(TASK, CHAR, len(CHAR), 8, foreign={1: BPE})


def test_a_foreign_peers_text_is_re_encoded_with_the_sequence_log_prob_and_eos():
    gold = TASK.train[3].answer
    texts = [gold, "7+5=12,", "="]
    rollouts = _sender_rollouts(texts, prompt=3)
    checked, timeouts, unscored = _checker().check(rollouts, 1, {3: 3})
    adopted, lost = _checker().adopt(checked, 1)
    assert timeouts == unscored == 0 and lost == 0 and len(adopted) == 3
    for before, after in zip(rollouts, adopted):
        text = BPE.decode(before.completion_ids[:-1].tolist())
        assert after.completion_ids.tolist() == CHAR(text, add_special_tokens=False)["input_ids"] + [CHAR.eos_token_id]
        assert after.seq_logprob == pytest.approx(float(before.gen_logprobs.sum()))
        assert after.reward == before.reward and after.member == 1 and after.policy_version == 0
        assert after.gen_logprobs.numel() == after.num_tokens
    assert [r.reward for r in adopted] == [TASK.reward(t, gold) for t in texts]  # scored from the text
    assert adopted[0].reward == 1.0
    assert rollouts[1].num_tokens < adopted[1].num_tokens  # really another tokenisation: merges undone


def test_a_completion_cut_at_the_length_limit_gets_no_eos():
    adopted, _ = _checker().adopt(_sender_rollouts(["12+3"], prompt=0, stop=False), 1)
    assert CHAR.decode(adopted[0].completion_ids.tolist()) == "12+3"


def test_text_that_does_not_survive_the_round_trip_leaves_its_whole_group_out():
    other = load_tokenizer("builtin:tiny-m-bpe")
    other.add_tokens(["é"])  # a symbol the character tokenizer lacks: it comes back as <unk>
    checker = RolloutChecker(TASK, CHAR, len(CHAR), 8, foreign={1: other})
    ids = other("1é", add_special_tokens=False)["input_ids"]
    bad = Rollout(1, 5, torch.tensor(ids, dtype=torch.int32), -torch.ones(len(ids)), 0.0, "length", 0, time.time())
    good = _sender_rollouts(["1", "2"], prompt=5, stop=False) + _sender_rollouts(["3"], prompt=6, stop=False)
    adopted, lost = checker.adopt([bad] + good, 1)
    assert lost == 3 and [r.prompt_index for r in adopted] == [6]


def test_what_an_honest_foreign_peer_never_sends_rejects_its_parcel():
    fake_stop = _sender_rollouts(["12"], prompt=0, stop=False)
    fake_stop[0].finish_reason = "stop"  # its last token, "2", is no special token: scored "12", trained "1"
    with pytest.raises(ValueError, match="claims it stopped"):
        _checker().adopt(fake_stop, 1)
    huge = _sender_rollouts(["12"], prompt=0, stop=False)
    huge[0].gen_logprobs = torch.full((huge[0].num_tokens,), -3e38)  # each finite; their sum is not in float32
    with pytest.raises(ValueError, match="float32"):
        _checker().adopt(huge, 1)


def test_a_completion_that_re_encodes_longer_than_the_limit_leaves_its_group_out():
    rollouts = _sender_rollouts(["7+5=12,", "1"], prompt=2, stop=False)
    checker = RolloutChecker(TASK, CHAR, len(CHAR), 8, foreign={1: BPE}, foreign_limit=6)
    adopted, lost = checker.adopt(rollouts + _sender_rollouts(["3"], prompt=4, stop=False), 1)
    assert lost == 2 and [r.prompt_index for r in adopted] == [4]  # "7+5=12," is 2 BPE tokens, 7 characters


def test_same_tokenizer_rollouts_are_untouched():
    rollouts = _sender_rollouts(["1"], prompt=0)
    adopted, lost = RolloutChecker(TASK, CHAR, len(CHAR), 8, foreign={}).adopt(rollouts, 1)
    assert adopted is rollouts and lost == 0 and adopted[0].seq_logprob is None


def test_foreign_ids_are_checked_against_the_senders_vocabulary():
    rollouts = _sender_rollouts(["7+5=12,"], prompt=0, stop=False)
    assert int(rollouts[0].completion_ids.max()) >= len(CHAR)  # a merge: no character id
    _checker().check(rollouts, 1, {0: 1})  # fine for the sender's 256 ids
    rollouts[0].completion_ids[0] = 256
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 256\)"):
        _checker().check(rollouts, 1, {0: 1})


@pytest.mark.parametrize("accept", [True, False])
def test_a_member_that_refuses_foreign_rollouts_counts_them_and_trains_on_none(accept):
    config = short_config("members.1.model=builtin:tiny-m-bpe", "rollout.max_new_tokens=8",
                          f"members.0.accept_foreign={str(accept).lower()}")
    schedule = Schedule(config, tuple(range(len(TASK.train))))
    admission = Admission(config, schedule, _checker(), 0)
    dealt = schedule.deal(1)[1]
    rollouts = [r for p, n in dealt.items() for r in _sender_rollouts([TASK.train[p].answer] * n, prompt=p)]
    got = admission.receive([Parcel(1, 1, 0, encode(rollouts))], 1)
    metrics = got.metrics()
    assert metrics["foreign_refused"] == (0 if accept else len(rollouts))
    assert metrics["foreign_sequences"] == metrics["peer_sequences"] == (len(rollouts) if accept else 0)
    assert metrics["rejected_batches"] == 0


def test_a_packed_batch_carries_the_foreign_sequence_log_probs():
    own = _sender_rollouts(["1"], prompt=0, member=0)
    foreign, _ = _checker().adopt(_sender_rollouts(["2"], prompt=0), 1)
    batch = pack([TrainItem(r, [5, 6], 1.0, 0) for r in own + foreign])
    assert torch.isnan(batch.gen_seq_logprobs[0]) and batch.gen_seq_logprobs[1] == pytest.approx(foreign[0].seq_logprob)
    assert pack([TrainItem(own[0], [5, 6], 1.0, 0)]).gen_seq_logprobs is None  # no foreign: the token-level path


@pytest.mark.slow
def test_two_families_train_on_each_others_rollouts_in_one_process(tmp_path):
    result = subprocess.run([sys.executable, "-m", "ftis_engine", *_args(
        tmp_path, "members.1.model=builtin:tiny-m-bpe", "train.steps=2", "checkpoint.every=0")],
        capture_output=True, text=True, timeout=300, env=_env())
    assert result.returncode == 0, result.stderr
    for r in run_records(tmp_path / "swarm", "train"):
        assert r["foreign_sequences"] == r["peer_sequences"] > 0 and r["foreign_dropped"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_families_train_on_each_others_rollouts_in_two_processes(tmp_path, mode):
    result = subprocess.run([sys.executable, "-m", "ftis_engine", *_args(
        tmp_path, "members.1.model=builtin:tiny-m-bpe", f"swarm.mode={mode}", "train.steps=4", "checkpoint.every=0"),
        "--nproc", "2"], capture_output=True, text=True, timeout=300, env=_env())
    assert result.returncode == 0, result.stderr
    train = run_records(tmp_path / "swarm", "train")
    for name in ("tiny-s", "tiny-m-lora"):
        mine = [r for r in train if r["member"] == name]
        assert sum(r["foreign_sequences"] for r in mine) > 0 and all(r["foreign_dropped"] == 0 for r in mine), name
