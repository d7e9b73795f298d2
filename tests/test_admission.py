"""The one receiver (exchange/admission.py): every check a peer's parcel passes, in both modes, and the intake an
update takes (its budget, each peer's share, freshest first, what waits and what is dropped)."""

from __future__ import annotations

import logging
import math
import time

import pytest
import torch

from ftis_engine.config import ConfigError, load_config
from ftis_engine.exchange import Parcel
from ftis_engine.exchange.admission import Admission
from ftis_engine.exchange.verify import RolloutChecker, validate
from ftis_engine.data.rollouts import Rollout, RolloutError, decode, encode
from ftis_engine.topology.schedule import Schedule
from ftis_engine.data.tasks import Example, Task

from .helpers import SHORT, TINY, short_config


class DigitTokenizer:
    """Token id i decodes to the digit i % 10."""

    def batch_decode(self, sequences, skip_special_tokens=True):
        return ["".join(str(i % 10) for i in ids) for ids in sequences]


TASK = Task(name="digits", train=[Example(question=f"q{i}", answer="7") for i in range(100)], evals={},
            reward=lambda text, gold: float(text.endswith(gold)))


def _checker() -> RolloutChecker:
    return RolloutChecker(TASK, DigitTokenizer(), vocab_size=100, max_new_tokens=8)


def _check(checker: RolloutChecker, rollouts: list[Rollout], sender: int = 1, dealt=None):
    """What admission does with a parcel's values: its buffer decoded, then checked (kept, timeouts, unscored)."""
    return checker.check(decode(encode(rollouts)), sender, dealt)


def _rollouts(sender: int, dealt: dict[int, int], version: int = 0, seed: int = 0) -> list[Rollout]:
    """Honest rollouts of a deal: ids drawn uniformly from 50 (each claimed at log(1/50), as such a sampler would),
    rewards as the receiver scores them."""
    g = torch.Generator().manual_seed(seed * 1000 + sender)
    out = []
    for prompt, n in dealt.items():
        for _ in range(n):
            ids = torch.randint(0, 50, (3,), generator=g, dtype=torch.int32)
            reward = TASK.score(DigitTokenizer(), [ids], [TASK.train[prompt]])[0]
            out.append(Rollout(sender, prompt, ids, torch.full((3,), -math.log(50)), reward, "stop", version,
                               time.time()))
    return out


def _admission(*overrides: str, receiver: int = 0, config=None) -> Admission:
    config = config or short_config("swarm.mode=async", "train.steps=100", *overrides)  # 2 members, 4 prompts of 4
    return Admission(config, Schedule(config, tuple(range(100))), _checker(), receiver, logprobs=_no_model)


def _no_model(rollouts):
    """The log-prob function of a receiver without a model: where a defense reads one, the test puts a stand-in
    screen in its place (_screened_by)."""
    pytest.fail("a screen with a stand-in reads no model")


def _parcel(admission: Admission, sender: int, step: int) -> Parcel:
    """The honest parcel of a learner's step."""
    rollouts = _rollouts(sender, admission.schedule.deal(step)[sender], step - 1, seed=step)
    return Parcel(sender, step, step - 1, encode(rollouts))


def _steps(rollouts: list[Rollout]) -> list[int]:
    """The sender steps of rollouts, one entry per group (prompt) in order."""
    seen = []
    for r in rollouts:
        key = (r.member, r.policy_version + 1, r.prompt_index)
        if key not in seen:
            seen.append(key)
    return [step for _, step, _ in seen]


# ----------------------------------------------------------------------------------------------- the checks


@pytest.mark.parametrize("mutate, reason", [
    (lambda r: setattr(r, "completion_ids", torch.tensor([999], dtype=torch.int32)), "vocabulary"),
    (lambda r: setattr(r, "completion_ids", torch.tensor([1, 2], dtype=torch.int32)), "log-probs for"),
    (lambda r: (setattr(r, "completion_ids", torch.ones(9, dtype=torch.int32)),
                setattr(r, "gen_logprobs", -torch.ones(9))), "max_new_tokens"),
    (lambda r: setattr(r, "gen_logprobs", torch.tensor([float("nan")])), "NaN"),
    (lambda r: setattr(r, "gen_logprobs", torch.tensor([0.5])), "positive"),
    (lambda r: setattr(r, "prompt_index", 10_000), "outside the dataset"),
    (lambda r: setattr(r, "member", 0), "claims member"),
    (lambda r: setattr(r, "reward", float("inf")), "reward is infinite"),
])
def test_validation_names_the_problem(mutate, reason):
    rollouts = [Rollout(1, 10, torch.tensor([4], dtype=torch.int32), torch.tensor([-0.5]), 0.0, "stop", 7)]
    mutate(rollouts[0])
    with pytest.raises(RolloutError, match=reason):
        validate(rollouts, sender=1, vocab_size=100, max_new_tokens=8, expected=None, num_prompts=100)


def test_a_peer_cannot_inflate_a_group_with_extra_or_missing_completions():
    rollouts = _rollouts(1, {10: 1, 11: 1, 12: 1})
    checker, dealt = _checker(), {10: 1, 11: 1, 12: 1}
    kept, timeouts, unscored = _check(checker, rollouts, dealt=dealt)
    assert (len(kept), timeouts, unscored) == (3, 0, 0)
    with pytest.raises(RolloutError, match="completions of prompt 10"):
        _check(checker, rollouts + [rollouts[0]] * 40, dealt=dealt)
    with pytest.raises(RolloutError, match="no completions of dealt prompt 12"):
        _check(checker, rollouts[:2], dealt=dealt)


def test_a_claimed_reward_that_the_receiver_does_not_reproduce_is_rejected():
    rollouts = _rollouts(1, {10: 1, 11: 1})
    rollouts[1].reward = 1.0 - rollouts[1].reward
    with pytest.raises(RolloutError, match="sequence 1: claims reward"):
        _check(_checker(), rollouts)


def test_a_re_score_that_times_out_leaves_out_its_group_not_the_batch():
    from ftis_engine.data.rewards import RewardTimeout

    def reward(text, gold):  # math-verify runs out of time on one answer (the text of token ids 3 3 3)
        if text == "333":
            raise RewardTimeout("parsing timed out")
        return float(text.endswith(gold))

    task = Task(name="digits", train=TASK.train, evals={}, reward=reward)
    checker = RolloutChecker(task, DigitTokenizer(), vocab_size=100, max_new_tokens=8)
    rollouts = _rollouts(1, {10: 2, 11: 2})
    rollouts[1].completion_ids = torch.tensor([3, 3, 3], dtype=torch.int32)  # its claim cannot be checked
    kept, unverified, unscored = _check(checker, rollouts, dealt={10: 2, 11: 2})
    assert [r.prompt_index for r in kept] == [11, 11] and (unverified, unscored) == (2, 0)  # prompt 10's, whole
    rollouts[2].reward = 1.0 - rollouts[2].reward  # a real mismatch still drops the batch
    with pytest.raises(RolloutError, match="sequence 2: claims reward"):
        _check(checker, rollouts, dealt={10: 2, 11: 2})
    assert task.score(DigitTokenizer(), [rollouts[1].completion_ids], [TASK.train[10]]) == [0.0]  # eval's: 0


def test_a_re_score_that_fails_refuses_the_parcel_in_one_line_with_the_rewards_error_as_its_cause():
    """The reward raising on a peer's text (its own bug, or text it cannot take) refuses the parcel with one line; what
    it raised stays the refusal's cause, for whoever reads the traceback."""
    from ftis_engine.data.tasks.base import RewardError

    def reward(text, gold):
        raise ZeroDivisionError("the reward's own bug")

    task = Task(name="digits", train=TASK.train, evals={}, reward=reward)
    checker = RolloutChecker(task, DigitTokenizer(), vocab_size=100, max_new_tokens=8)
    with pytest.raises(RolloutError, match=r"^cannot score the completions: data.reward: .* raised ZeroDivisionError: "
                                           r"the reward's own bug$") as caught:
        _check(checker, _rollouts(1, {10: 1}))
    assert isinstance(caught.value.__cause__, RewardError)


def test_an_honest_sender_whose_scoring_timed_out_is_no_liar_and_both_sides_leave_that_group_out():
    """The sender's math-verify ran out of time under its load (a receiver's would not): it sends the completion
    unscored (NaN on the wire) instead of a 0 the receiver would contradict. The receiver keeps the parcel, leaves
    that prompt's group out, and counts it; the sender leaves the same group out of its own update."""
    from ftis_engine.run.sampling import generate_rollouts
    from ftis_engine.data.rewards import RewardTimeout
    from ftis_engine.run.step import drop_unscored

    def loaded(text, gold):  # the sender, under load: math-verify times out on the text "333"
        if text == "333":
            raise RewardTimeout("parsing timed out")
        return float(text.endswith(gold))

    class Generator:
        def generate(self, prompts, sampling, on_batch=None):
            from ftis_engine.generation import Completion

            ids = {10: [[3, 3, 3], [4, 5, 7]], 11: [[1, 7], [2, 2]]}
            return [[Completion(torch.tensor(x, dtype=torch.int32), -torch.ones(len(x)), "stop") for x in ids[p]]
                    for p in prompts]

    class Swarm:
        config = short_config()
        task = Task(name="digits", train=TASK.train, evals={}, reward=loaded)
        progress = type("P", (), {"start": lambda *a: None, "advance": lambda *a: None,
                                  "finish": lambda *a: None})()

        def prompt(self, member, index):
            return index

    member = type("M", (), {"index": 1, "generator": Generator(), "tokenizer": DigitTokenizer(), "name": "m"})()
    sent = generate_rollouts(Swarm(), member, {10: 2, 11: 2}, 0, seed=0)
    assert [r.reward for r in sent][1:] == [1.0, 1.0, 0.0] and sent[0].reward != sent[0].reward  # NaN: unscored
    arrived = decode(encode(sent))
    assert arrived[0].reward != arrived[0].reward  # NaN survives the wire
    kept, timeouts, unscored = _checker().check(arrived, 1, {10: 2, 11: 2})  # an unloaded receiver
    assert [r.prompt_index for r in kept] == [11, 11] and (timeouts, unscored) == (0, 2)
    own, dropped = drop_unscored(sent)
    assert [r.prompt_index for r in own] == [11, 11] and dropped == 2


def test_an_unscored_claim_is_never_re_scored_and_an_infinite_reward_is_still_a_lie():
    calls = []
    task = Task(name="digits", train=TASK.train, evals={}, reward=lambda text, gold: calls.append(text) or 0.0)
    checker = RolloutChecker(task, DigitTokenizer(), vocab_size=100, max_new_tokens=8)
    rollouts = _rollouts(1, {10: 1, 11: 1})
    for r in rollouts:
        r.reward = 0.0
    rollouts[0].reward = float("nan")
    kept, _, unscored = _check(checker, rollouts)
    assert [r.prompt_index for r in kept] == [11] and unscored == 1 and len(calls) == 1
    rollouts[0].reward = float("-inf")
    with pytest.raises(RolloutError, match="sequence 0: reward is infinite"):
        _check(checker, rollouts)


def test_sync_mode_trains_on_every_good_peer_and_drops_a_bad_batch_whole(tmp_path, caplog):
    config = tmp_path / "three.yaml"
    config.write_text(TINY.read_text().replace(
        "algorithm:", "  - name: tiny-l\n    model: builtin:tiny-l\n    lr: 1.0e-3\nalgorithm:"))
    admission = _admission(config=load_config(config, [*SHORT, "rollout.prompts_per_step=6", "train.steps=100"]))
    good, bad = _parcel(admission, 1, 3), _parcel(admission, 2, 3)
    words = bad.buffer.clone()
    words[1 + 8 * 8] = 999  # the first token id, outside the vocabulary
    with caplog.at_level(logging.WARNING, logger="ftis_engine.exchange"):
        got = admission.receive([good, Parcel(2, 3, 2, words)], step=3)
    assert [r.member for r in got.rollouts] == [1] * 8 and got.staleness == [0] * 8
    assert len(got.rejected) == 1 and got.rejected[0][0] == 2 and "vocabulary" in got.rejected[0][1]
    assert "tiny-s: dropped the rollouts of peer tiny-l of its step 3" in caplog.text
    assert list(got.digests) == ["tiny-m-lora@3"] and got.waiting == 0


def test_every_parcel_is_checked_against_the_step_it_claims_in_the_order_of_the_checks():
    admission = _admission()
    honest = _parcel(admission, 1, 3)
    ok = admission.receive([honest], step=4)
    assert len(ok.rollouts) == 8 and ok.rejected == [] and ok.staleness == [1] * 8
    other = _rollouts(1, admission.schedule.deal(3)[1], version=2)
    bad = admission.receive([
        Parcel(1, 2, 1, honest.buffer),  # claims step 2: its rollouts' versions disagree
        Parcel(1, 3, 1, encode(other)),  # declares version 1 for step 3
        Parcel(1, 999, 998, honest.buffer),  # a step the run never has
        Parcel(1, 4, 3, torch.zeros(0, dtype=torch.int32), refused="9999 words announced"),  # refused unread
        Parcel(1, 4, 3, encode(_rollouts(1, admission.schedule.deal(3)[1], version=3))),  # step 3's deal
        Parcel(7, 4, 3, honest.buffer),  # no such rank
    ], step=4)
    reasons = [reason for _, reason in bad.rejected]
    assert bad.rollouts == [] and len(reasons) == 6
    for reason, expected in zip(reasons, ["differs from its parcel's", "declared for step 3", "outside 1..train.steps",
                                          "refused unread: 9999 words", "was not dealt to member 1",
                                          "not a rank of this run"]):
        assert expected in reason, (reason, expected)
    # step 3 again (a copy, or a resumed member's redo): dropped, no fault, never trained on twice
    again = admission.receive([Parcel(1, 3, 2, honest.buffer), Parcel(1, 3, 2, encode(other))], step=4)
    assert again.rollouts == [] and again.rejected == [] and again.duplicate_dropped == 16
    future = [Rollout(**{**vars(r), "made_at": time.time() + 3600}) for r in _rollouts(1, admission.schedule.deal(5)[1],
                                                                                        version=4)]
    ahead = admission.receive([Parcel(1, 5, 4, encode(future))], step=5)
    assert ahead.rollouts == [] and "in the future" in ahead.rejected[0][1]


def test_a_parcel_older_than_max_staleness_or_max_delay_is_dropped_as_stale_not_rejected():
    admission = _admission("swarm.max_staleness=1")
    old, fresh = _parcel(admission, 1, 2), _parcel(admission, 1, 3)
    got = admission.receive([old, fresh], step=4)  # staleness 2 and 1
    assert got.stale_dropped == 8 and got.rejected == [] and _steps(got.rollouts) == [3, 3]
    late = _admission("swarm.max_delay_s=1")
    parcel = _parcel(late, 1, 1)
    rollouts = [Rollout(**{**vars(r), "made_at": time.time() - 5}) for r in _rollouts(1, late.schedule.deal(1)[1])]
    got = late.receive([Parcel(1, 1, 0, encode(rollouts)), _parcel(late, 1, 2)], step=2)
    assert got.stale_dropped == 8 and len(got.rollouts) == 8 and parcel.step == 1


def test_the_replay_memory_stays_within_the_staleness_window():
    admission = _admission("swarm.max_staleness=3")
    for step in range(1, 60):
        admission.receive([_parcel(admission, 1, step)], step=step)
    assert len(admission._seen) <= 4


# ----------------------------------------------------------------------------------------------- the intake


def test_the_intake_takes_the_freshest_within_its_budget_and_keeps_the_rest_while_it_stays_fresh():
    admission = _admission("swarm.max_staleness=2")  # the budget: one step of the peer, 2 groups of 4
    assert admission.budget == 8
    got = admission.receive([_parcel(admission, 1, s) for s in (3, 4, 5)], step=5)  # versions 2, 3, 4
    assert _steps(got.rollouts) == [5, 5] and got.staleness == [0] * 8
    # step 4's rollouts (version 3) can still be used at step 6; step 3's (version 2) would be 3 versions old
    assert got.waiting == 8 and got.surplus_dropped == 8
    got = admission.receive([], step=6)  # what waited
    assert _steps(got.rollouts) == [4, 4] and got.staleness == [2] * 8 and got.waiting == 0
    assert admission.receive([], step=7).rollouts == []


def test_a_smaller_budget_takes_whole_groups_and_sync_mode_takes_everything():
    small = _admission("swarm.max_peer_sequences=6")  # one group of 4 fits, a second does not
    got = small.receive([_parcel(small, 1, 2)], step=2)
    assert len(got.rollouts) == 4 and len({r.prompt_index for r in got.rollouts}) == 1 and got.waiting == 4
    sync = Admission(short_config(), Schedule(short_config(), tuple(range(100))), _checker(), 0)
    assert sync.budget is None
    got = sync.receive([Parcel(1, 2, 1, _parcel(small, 1, 2).buffer)], step=2)
    assert len(got.rollouts) == 8 and got.waiting == 0


def test_each_peer_gets_its_share_before_a_fast_peer_fills_the_budget(tmp_path):
    config = tmp_path / "three.yaml"
    config.write_text(TINY.read_text().replace(
        "algorithm:", "  - name: tiny-l\n    model: builtin:tiny-l\n    lr: 1.0e-3\nalgorithm:"))
    admission = _admission(config=load_config(config, [*SHORT, "rollout.prompts_per_step=6", "swarm.mode=async",
                                                            "train.steps=100"]))
    assert admission.budget == 16 and admission.shares == {1: 8, 2: 8}
    # the fast peer (1) has sent three steps, all fresher than the slow peer's (2) one
    got = admission.receive([_parcel(admission, 1, s) for s in (3, 4, 5)] + [_parcel(admission, 2, 1)], step=3)
    assert [(r.member, r.policy_version) for r in got.rollouts][::4] == [(2, 0), (2, 0), (1, 4), (1, 4)]
    assert got.staleness == [2] * 8 + [-2] * 8 and got.waiting == 16


def test_a_budget_tighter_than_the_shares_goes_to_the_freshest_sender_not_the_lowest_numbered(tmp_path):
    """swarm.max_peer_sequences of one group: peer 1 offers a version-0 group, peer 2 a version-2 one; the budget
    takes the freshest (SPEC 3b), whatever the senders' numbers (the round-robin visited peer 1 first)."""
    config = tmp_path / "three.yaml"
    config.write_text(TINY.read_text().replace(
        "algorithm:", "  - name: tiny-l\n    model: builtin:tiny-l\n    lr: 1.0e-3\nalgorithm:"))
    admission = _admission(config=load_config(config, [*SHORT, "rollout.prompts_per_step=6", "swarm.mode=async",
                                                            "train.steps=100", "swarm.max_peer_sequences=4"]))
    got = admission.receive([_parcel(admission, 1, 1), _parcel(admission, 2, 3)], step=3)
    assert {(r.member, r.policy_version) for r in got.rollouts} == {(2, 2)} and len(got.rollouts) == 4


def test_at_most_max_staleness_plus_one_budgets_wait():
    admission = _admission("swarm.max_staleness=2")
    got = admission.receive([_parcel(admission, 1, s) for s in range(3, 10)], step=4)  # a peer far ahead
    assert got.waiting == 8 * 3 and got.surplus_dropped == 8 * 7 - 8 - 24  # taken, kept, dropped: all counted
    assert _steps(got.rollouts) == [9, 9]


def test_a_budget_smaller_than_one_group_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"^swarm.max_peer_sequences: 3 is less than one group"):
        short_config("swarm.mode=async", "swarm.max_peer_sequences=3")


# ----------------------------------------------------------------------------------------------- defenses


def test_max_peer_share_leaves_out_a_peers_stalest_groups_beyond_its_share_of_the_update(tmp_path):
    """Oracle by hand: own 8 sequences; peer 1 sends two steps (4 groups of 4), peer 2 one (2 groups); sync takes
    all 24 peer sequences, 32 in the update. A share of 0.4: peer 1's 16 is over 0.4 * 32; it loses its stalest
    group (16 of 28: 12 > 11.2 still over), then another (8 of 24: within 9.6); peer 2's 8 of 24 is within."""
    config = tmp_path / "three.yaml"
    config.write_text(TINY.read_text().replace(
        "algorithm:", "  - name: tiny-l\n    model: builtin:tiny-l\n    lr: 1.0e-3\nalgorithm:"))
    cfg = load_config(config, [*SHORT, "rollout.prompts_per_step=6", "swarm.max_staleness=4",
                               "defense.max_peer_share=0.4"])
    admission = Admission(cfg, Schedule(cfg, tuple(range(100))), _checker(), 0)
    parcels = [_parcel(admission, 1, 2), _parcel(admission, 1, 3), _parcel(admission, 2, 3)]
    got = admission.receive(parcels, step=3, own_sequences=8)
    by_sender = {s: [r.policy_version for r in got.rollouts if r.member == s] for s in (1, 2)}
    assert by_sender[1] == [2] * 8 and by_sender[2] == [2] * 8  # peer 1 kept its fresher step's two groups
    assert got.share_capped == {"tiny-m-lora": 8} and got.metrics()["share_capped"] == 8
    assert got.waiting == 0 and got.surplus_dropped == 0  # capped groups are left out for good, counted once
    # without the cap everything is taken
    plain = load_config(config, [*SHORT, "rollout.prompts_per_step=6", "swarm.max_staleness=4"])
    admission = Admission(plain, Schedule(plain, tuple(range(100))), _checker(), 0)
    got = admission.receive(parcels, step=3, own_sequences=8)
    assert len(got.rollouts) == 24 and got.share_capped == {}


def test_max_peer_share_holds_in_async_mode_within_the_budget():
    admission = _admission("defense.max_peer_share=0.25")  # own 8; one peer, budget 8
    got = admission.receive([_parcel(admission, 1, 2)], step=2, own_sequences=8)
    # 8 of 16 is over 0.25; one group of 4 is left: 4 of 12 is 0.33, still over; none: 0 of 8
    assert got.rollouts == [] and got.share_capped == {"tiny-m-lora": 8}
    # own 20: 8 of 28 is over; one group left, 4 of 24, is within
    assert admission.receive([_parcel(admission, 1, 3)], step=3, own_sequences=20).share_capped == {"tiny-m-lora": 4}


def test_a_share_outside_0_1_is_refused_naming_the_field():
    for value in ("0", "1.5"):
        with pytest.raises(ConfigError, match=r"^defense.max_peer_share"):
            short_config(f"defense.max_peer_share={value}")


def _claimed(prompt, ids, logprobs):
    return Rollout(1, prompt, torch.tensor(ids, dtype=torch.int32), torch.tensor(logprobs, dtype=torch.float32),
                   0.0, "stop", 0, time.time())


def test_the_surprisal_limit_is_chernoffs_bound_at_the_false_alarm_rate():
    from ftis_engine.exchange.verify import CLAIM_FALSE_ALARM, surprisal_limit

    for n in (1, 2, 16, 1000):
        c = surprisal_limit(n)
        assert c > 1 and math.exp(-n * (c - 1 - math.log(c))) == pytest.approx(CLAIM_FALSE_ALARM, rel=1e-6)


def test_claims_an_honest_sampler_makes_pass_whatever_its_distribution():
    """Samplers over 50 ids with random distributions (flat to very peaked) whose claims are the exact log-probs
    of what they drew: 2,000 groups of 4 completions, never refused."""
    from ftis_engine.exchange.verify import implausible_claims

    g = torch.Generator().manual_seed(0)
    for trial in range(2000):
        peak = [0.1, 1.0, 5.0][trial % 3]
        rollouts = []
        for j in range(4):
            ids, claims = [], []
            for position in range(3):  # each prefix's distribution: a function of the prefix (one sampler)
                prefix_seed = hash((trial, tuple(ids))) % (1 << 31)
                logits = torch.randn(50, generator=torch.Generator().manual_seed(prefix_seed)) * peak
                logp = torch.log_softmax(logits.double(), 0)
                token = int(torch.multinomial(logp.exp(), 1, generator=g))
                ids.append(token)
                claims.append(float(logp[token]))
            rollouts.append(_claimed(trial % 100, ids, claims))
        assert implausible_claims(rollouts, 50) is None, trial


def test_claims_no_sampler_can_make_are_refused_naming_what_is_wrong():
    from ftis_engine.exchange.verify import implausible_claims

    # every token claimed at e^-20 over 50 ids: one sequence of 2 tokens already, or a parcel of 1-token ones
    assert "sequence 0" in implausible_claims([_claimed(0, [1, 2], [-20.0, -20.0])], 50)
    many = [_claimed(k, [k], [-20.0]) for k in range(16)]
    assert "its 16 tokens'" in implausible_claims(many, 50)
    assert implausible_claims([_claimed(0, [1], [-20.0])], 50) is None  # one token: a rare draw, not a proof
    # branches: after token 1, tokens 2 and 3 claimed at e^-0.1 and e^-0.2 (sum 1.72)
    said = implausible_claims([_claimed(0, [1, 2], [-0.1, -0.1]), _claimed(0, [1, 3], [-0.1, -0.2])], 50)
    assert said.startswith("completions of prompt 0 branch into 2 tokens") and "1.72" in said
    branching = [_claimed(0, [1, 2], [-0.1, -0.1]), _claimed(0, [1, 3], [-0.1, -0.2])]
    assert implausible_claims(branching, 50, branches=False) is None  # top-k / top-p: no branch test
    # the same branches claimed at 0.37 and 0.30, or identical completions at probability 1: possible
    assert implausible_claims([_claimed(0, [1, 2], [-0.1, -1.0]), _claimed(0, [1, 3], [-0.1, -1.2])], 50) is None
    assert implausible_claims([_claimed(0, [1, 2], [0.0, 0.0]), _claimed(0, [1, 2], [0.0, 0.0])], 50) is None
    # different prompts never branch from each other
    assert implausible_claims([_claimed(0, [1], [0.0]), _claimed(1, [2], [0.0])], 50) is None


def test_the_length_guards_own_lengths_go_into_the_checkpoint_and_a_resume_measures_against_them(tmp_path, caplog):
    """defense.max_length_ratio measures peers against the median of the receiver's recent own lengths: a resume
    started that history empty (one step's lengths after it), so an interrupted run could admit what an
    uninterrupted one left out. The checkpoint holds it (admission.json); a resume loads it; one written without it
    warns; a malformed one stops the resume with one line naming the file."""
    import json

    from ftis_engine.run.loop import train
    from ftis_engine.run.rundir import RunDirError
    from ftis_engine.run.session import Start, open_run

    size = ("rollout.max_new_tokens=6", "eval.every=0", "eval.at_start=false", "checkpoint.every=2",
            "defense.max_length_ratio=1.5")
    swarm, start = open_run(short_config("train.steps=2", *size), Start(tmp_path / "run"))
    train(swarm, start)
    kept = {i: r.state() for i, r in swarm.receivers.items()}
    assert all(len(state["own_lengths"]) > 0 for state in kept.values())
    file = tmp_path / "run/checkpoints/step-2/members/tiny-s/admission.json"
    assert json.loads(file.read_text()) == kept[0]
    swarm, start = open_run(short_config("train.steps=3", *size), Start(tmp_path / "run", resume=True))
    assert start == 2 and {i: r.state() for i, r in swarm.receivers.items()} == kept
    assert not any("length-guard state" in r.getMessage() for r in caplog.records)
    saved = file.read_text()
    file.unlink()  # as a checkpoint written before the state was kept
    open_run(short_config("train.steps=3", *size), Start(tmp_path / "run", resume=True))
    assert any("holds no length-guard state" in r.getMessage() for r in caplog.records)
    for bad in ('{"own_lengths": [3, -1]}', '{"own_lengths": "3"}', "[]", "{"):
        file.write_text(bad)
        with pytest.raises(RunDirError, match=r"^--resume: .*step-2/members/tiny-s/admission.json"):
            open_run(short_config("train.steps=3", *size), Start(tmp_path / "run", resume=True))
    file.write_text(saved)
    plain = tmp_path / "plain"  # without the guard nothing is written
    swarm, start = open_run(short_config("train.steps=2", *size[:-1]), Start(plain))
    train(swarm, start)
    assert not list(plain.glob("checkpoints/step-2/members/*/admission.json"))


def test_max_length_ratio_leaves_out_a_peers_groups_far_longer_than_the_receivers_own():
    """The receiver's own completions have 3 tokens; a peer's honest 3-token groups pass a ratio of 1.5 and its
    8-token groups (the `long` attack) are left out whole, counted per peer; without the guard all pass."""
    admission = _admission("defense.max_length_ratio=1.5")
    deal = admission.schedule.deal(2)[1]
    g = torch.Generator().manual_seed(5)
    long = [Rollout(1, p, torch.randint(0, 50, (8,), generator=g, dtype=torch.int32), torch.full((8,), -math.log(50)),
                    0.0, "length", 1, time.time()) for p, n in deal.items() for _ in range(n)]
    for r in long:
        r.reward = TASK.score(DigitTokenizer(), [r.completion_ids], [TASK.train[r.prompt_index]])[0]
    got = admission.receive([_parcel(admission, 1, 1), Parcel(1, 2, 1, encode(long))], step=2,
                            own_lengths=[3] * 8)
    assert len(got.rollouts) == 8 and {r.num_tokens for r in got.rollouts} == {3}
    assert got.length_dropped == {"tiny-m-lora": 8} and got.metrics()["length_dropped"] == 8 and got.rejected == []
    plain = _admission()
    got = plain.receive([_parcel(plain, 1, 1), Parcel(1, 2, 1, encode(long))], step=2, own_lengths=[3] * 8)
    assert len(got.rollouts) + got.waiting == 16 and got.length_dropped == {}  # all admitted (budget 8)
    with pytest.raises(ConfigError, match=r"^defense.max_length_ratio"):
        short_config("defense.max_length_ratio=1")


def _screened_by(admission: Admission, screen) -> None:
    """A stand-in for the receiver's screen (screen_rollouts: rollouts -> (those kept, Screened)), where the real one
    runs the log-prob function it is built with through the defenses (test_screen)."""
    admission.logprobs = lambda rollouts: pytest.fail("the stand-in screen reads no model")
    admission.screen_rollouts = screen


def test_the_screen_reads_each_new_group_once_before_the_take_so_a_dropped_group_frees_its_place():
    """The model-reading defenses run on a step's newly admitted groups before the budget is taken: a group they
    leave out is replaced in the intake by one that waited (the freshest after it), each group is screened once
    (on arrival), and a peer they quarantine loses its groups still waiting (counted as quarantined)."""
    from ftis_engine.exchange.screen import PeerTest, Screened

    admission = _admission("swarm.max_staleness=2", "defense.claims_monitor=true")
    seen: list[list[tuple[int, int]]] = []

    def screen(rollouts, drop_version=None):
        seen.append(sorted({(r.prompt_index, r.policy_version) for r in rollouts}))
        kept = [r for r in rollouts if r.policy_version != drop_version]
        out = Screened(likelihood_dropped={"tiny-m-lora": len(rollouts) - len(kept)} if len(kept) < len(rollouts)
                       else {})
        return kept, out

    parcels = [_parcel(admission, 1, s) for s in (3, 4, 5)]  # versions 2, 3, 4; the budget: one step's 8
    # the freshest (version 4) dropped by the screen: version 3 takes its place, not nothing
    _screened_by(admission, lambda rs: screen(rs, drop_version=4))
    got = admission.receive(parcels, step=5)
    assert {r.policy_version for r in got.rollouts} == {3} and len(got.rollouts) == 8
    assert got.screened.likelihood_dropped == {"tiny-m-lora": 8} and len(seen[0]) == 6  # all three parcels read
    assert got.waiting == 0  # version 2 is too old for step 6 (staleness 3 > 2): dropped, counted as surplus
    _screened_by(admission, screen)
    got = admission.receive([_parcel(admission, 1, 6)], step=6)
    assert seen[1] == sorted({(r.prompt_index, 5) for r in got.rollouts})  # only the new parcel is read again
    # quarantine: a waiting group of the quarantined peer is left out with the new ones
    admission.receive([_parcel(admission, 1, s) for s in (7, 8)], step=8)  # version 6 waits
    assert admission.pool and all(g.version == 6 for g in admission.pool)
    admission.screen.tests["tiny-m-lora"] = PeerTest(quarantined=True)
    got = admission.receive([], step=9)
    assert got.rollouts == [] and got.screened.quarantined == {"tiny-m-lora": 8} and not admission.pool


def test_a_receiver_whose_defenses_read_its_model_is_refused_without_its_log_prob_function():
    """It would screen nothing, silently (a review's finding, issue 69): only tests build a receiver without one."""
    config = short_config("defense.likelihood_floor=-50")
    with pytest.raises(ValueError, match="build it with its log-prob function"):
        Admission(config, Schedule(config, tuple(range(100))), _checker(), 0)
    Admission(short_config(), Schedule(short_config(), tuple(range(100))), _checker(), 0)  # no such defense: fine


def test_a_quarantined_peer_loses_its_samplers_waiting_groups_too():
    """The screen judges a member's samplers' rollouts under the member's name: once it is quarantined, a group of
    its sampler still waiting in the pool is left out with its learner's, counted under the member's name."""
    from ftis_engine.exchange.admission import Group
    from ftis_engine.exchange.screen import PeerTest, Screened

    config = short_config("swarm.mode=async", "train.steps=100", "members.1.samplers=1", "defense.claims_monitor=true")
    admission = _admission(config=config)
    sampler = next(rank for rank, (member, k) in enumerate(admission.schedule.roles) if member == 1 and k is not None)
    learner = next(rank for rank, (member, k) in enumerate(admission.schedule.roles) if member == 1 and k is None)
    rollouts = _rollouts(1, {0: 4, 1: 4}, version=4, seed=1)
    admission.pool = [Group(sampler, 4, rollouts[:4], 0, f"{sampler}@5", "a"),
                      Group(learner, 4, rollouts[4:], 1, f"{learner}@5", "b")]
    admission._order = admission._screened_up_to = 2  # both screened on arrival already
    assert admission.sender_name(sampler) == "tiny-m-lora/sampler-0"
    admission.screen.tests["tiny-m-lora"] = PeerTest(quarantined=True)
    _screened_by(admission, lambda rs: (rs, Screened()))
    got = admission.receive([], step=5)
    assert got.rollouts == [] and not admission.pool and got.screened.quarantined == {"tiny-m-lora": 8}
