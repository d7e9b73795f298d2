"""The receiver's model-reading defenses (exchange/screen.py): the likelihood check and the claims monitor, on
hand-made rollouts with the receiver's log-probs given, and the monitor's false-alarm bound against honest
samplers drawn at random."""

from __future__ import annotations

import math
import time

import pytest
import torch

from ftis_engine.config import DefenseSettings
from ftis_engine.exchange.screen import (MONITOR_BOUND, RELEASE_TOKENS, PeerTest, Screen, looks_honest,
                                         lowest_window_mean, monitor_weights)
from ftis_engine.data.rollouts import Rollout


def _rollout(member: int, prompt: int, claims: list[float], version: int = 0) -> Rollout:
    n = len(claims)
    return Rollout(member, prompt, torch.arange(n, dtype=torch.int32), torch.tensor(claims), 1.0, "stop", version,
                   time.time())


def test_the_lowest_window_mean_is_the_least_mean_of_consecutive_tokens():
    values = torch.tensor([-1.0, -2.0, -9.0, -9.0, -1.0, -0.5])
    assert lowest_window_mean(values, 2) == pytest.approx(-9.0)
    assert lowest_window_mean(values, 3) == pytest.approx(min((-1 - 2 - 9) / 3, (-2 - 9 - 9) / 3, (-9 - 9 - 1) / 3,
                                                              (-9 - 1 - 0.5) / 3))
    assert lowest_window_mean(values, 10) == pytest.approx(float(values.mean()))  # shorter than a window: its mean
    assert lowest_window_mean(values, 1) == pytest.approx(-9.0)


def test_the_likelihood_check_leaves_out_the_whole_group_of_an_implausible_completion_whatever_its_advantage():
    screen = Screen(DefenseSettings(likelihood_floor=-5.0, likelihood_window=2), "receiver")
    rollouts = [_rollout(1, 0, [-1.0] * 4), _rollout(1, 0, [-1.0] * 4),  # group (peer 1, prompt 0)
                _rollout(1, 1, [-1.0] * 4), _rollout(2, 0, [-1.0] * 4)]
    own = [torch.tensor([-1.0, -2.0, -1.0, -1.0]), torch.tensor([-1.0, -9.0, -9.0, -1.0]),  # a planted pair
           torch.tensor([-4.0, -5.5, -1.0, -1.0]), torch.tensor([-6.0, -1.0, -6.0, -1.0])]  # windows -4.75, -3.5
    drop, out = screen.verdicts(rollouts, own, ["a", "a", "a", "b"])
    assert drop == {0, 1}  # the plausible completion of the planted one's group goes with it
    assert out.likelihood_dropped == {"a": 2}
    assert out.metrics()["likelihood_dropped"] == 2 and out.metrics()["quarantined"] == 0


def test_the_monitor_weights_are_the_receivers_ratio_truncated_at_the_bound():
    own, claims = torch.tensor([-1.0, -3.0, -2.0, 0.0]), torch.tensor([-2.0, -1.0, -2.0, -30.0])
    expected = [min(math.exp(a - b), MONITOR_BOUND) for a, b in zip(own.tolist(), claims.tolist())]
    assert monitor_weights(own, claims).tolist() == pytest.approx(expected)


def _honest_step(g: torch.Generator, vocab: int, tokens: int, sharpness: float, distance: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The receiver's and the claimed log-probs of `tokens` tokens an honest peer samples: at each, a random
    generator distribution over `vocab` ids and a receiver's at `distance` from it (0: the same model, 1: an
    unrelated one)."""
    logits = torch.randn(tokens, vocab, generator=g) * sharpness
    gen = torch.log_softmax(logits, -1)
    other = torch.randn(tokens, vocab, generator=g) * sharpness
    rec = torch.log_softmax((1 - distance) * logits + distance * other, -1)
    ids = torch.multinomial(gen.exp(), 1, generator=g)[:, 0]
    rows = torch.arange(tokens)
    return rec[rows, ids], gen[rows, ids]


@pytest.mark.parametrize("sharpness, distance", [(0.5, 1.0), (2.0, 1.0), (4.0, 1.0), (2.0, 0.0), (4.0, 0.2)])
def test_honest_peers_are_never_quarantined(sharpness, distance):
    """300 steps of 400 tokens each from honest samplers (flat to peaked; the receiver the same model, close or
    unrelated): the test's evidence stays far below its threshold (Ville: a false alarm over the run < 1e-6)."""
    g = torch.Generator().manual_seed(int(sharpness * 10 + distance * 100))
    screen = Screen(DefenseSettings(claims_monitor=True), "receiver")
    worst = -math.inf
    for step in range(300):
        own, claims = _honest_step(g, 50, 400, sharpness, distance)
        rollouts = [_rollout(1, k, claims[k * 20:(k + 1) * 20].tolist(), step) for k in range(20)]
        drop, out = screen.verdicts(rollouts, [own[k * 20:(k + 1) * 20] for k in range(20)], ["peer"] * 20)
        assert not drop and out.quarantined == {}
        worst = max(worst, screen.tests["peer"].log_evidence())
    assert worst < math.log(1e6) - 5


def _forged_step(g, vocab, tokens, rate):
    """A forge-filter peer's step: a `rate` share of its tokens claim 1/(2V); the receiver is close to it (a peer
    of the same model, where the forgery pays: every token the receiver gives 2/(2V) or more weighs the bound)."""
    own, claims = _honest_step(g, vocab, tokens, 2.0, 0.2)
    forged = torch.rand(tokens, generator=g) < rate
    return own, torch.where(forged, torch.full_like(claims, -math.log(2 * vocab)), claims)


def test_a_forger_is_quarantined_refused_and_released_once_its_claims_look_honest():
    g = torch.Generator().manual_seed(0)
    screen = Screen(DefenseSettings(claims_monitor=True), "receiver")
    names = ["liar"] * 10 + ["honest"] * 10
    verdicts = []
    for step in range(24):
        own_l, claims_l = _forged_step(g, 50, 200, 1.0 if step < 6 else 0.0)  # forges 6 steps, then honest
        own_h, claims_h = _honest_step(g, 50, 200, 2.0, 0.2)
        rollouts = [_rollout(1, k, claims_l[k * 20:(k + 1) * 20].tolist(), step) for k in range(10)] + \
                   [_rollout(2, k, claims_h[k * 20:(k + 1) * 20].tolist(), step) for k in range(10)]
        own = [own_l[k * 20:(k + 1) * 20] for k in range(10)] + [own_h[k * 20:(k + 1) * 20] for k in range(10)]
        drop, out = screen.verdicts(rollouts, own, names)
        assert not drop & set(range(10, 20))  # the honest peer is never touched
        verdicts.append(drop == set(range(10)))
        if verdicts[-1]:
            assert out.quarantined == {"liar": 10}
        assert out.weight_mean["liar"] > 1.5 if step < 6 else out.weight_mean["liar"] < 1.2
    # refused from its first forged step (a claim of 1/(2V) for every token: weights at the bound) and every forged
    # step; then until its latest steps in quarantine hold RELEASE_TOKENS tokens of honest-looking claims (10
    # steps of 200: released within a step of that, as the window's oldest step may still be a forged one);
    # taken from then on
    released = verdicts.index(False)
    assert all(verdicts[:6]) and 6 + RELEASE_TOKENS // 200 - 2 <= released <= 6 + RELEASE_TOKENS // 200
    assert not any(verdicts[released:])


def test_a_forger_of_a_fifth_of_its_tokens_is_caught_by_its_history_and_kept_out():
    """Forging 20% of its tokens moves one step's mean weight by less than one step's bound, but the run-long
    test adds the steps up; in quarantine its last three steps together are judged, so it is not released."""
    g = torch.Generator().manual_seed(1)
    screen = Screen(DefenseSettings(claims_monitor=True), "receiver")
    caught, admitted = None, []
    for step in range(60):
        own, claims = _forged_step(g, 50, 200, 0.2)
        if step == 0:
            weights = monitor_weights(own, claims)
            assert looks_honest(float(weights.sum()), weights.numel())  # one step alone says little
        drop, _ = screen.verdicts([_rollout(1, 0, claims.tolist(), step)], [own], ["liar"])
        if drop and caught is None:
            caught = step
        if caught is not None and step > caught:
            admitted.append(not drop)
    assert caught is not None and caught >= 1
    # once caught it stays out nearly always: three steps together show what one does not, and one let out starts
    # its new test halfway to the threshold (before: admitted about N/(N+3) of the time, caught every N steps)
    assert sum(admitted) <= 0.2 * len(admitted), admitted


def test_a_screens_state_goes_through_json_and_the_loaded_screen_goes_on_exactly_as_the_original():
    """The checkpoint's screen.json: a screen loaded from the state of one that quarantined a forger (and holds
    evidence on a partial forger) gives the same verdicts on the next steps as the original going on; a fresh one
    would take the forger's first steps. A malformed state is refused naming where it came from."""
    import json

    g = torch.Generator().manual_seed(3)
    original = Screen(DefenseSettings(claims_monitor=True), "receiver")

    def step(screen, claims_and_own):
        rollouts = [_rollout(1 + k, 0, c.tolist()) for k, (c, _) in enumerate(claims_and_own)]
        return screen.verdicts(rollouts, [o for _, o in claims_and_own], ["liar", "partial"])[0]

    for _ in range(3):
        step(original, [_forged_step(g, 50, 200, 1.0)[::-1], _forged_step(g, 50, 200, 0.2)[::-1]])
    assert original.tests["liar"].quarantined and original.tests["partial"].tokens > 0
    loaded = Screen(DefenseSettings(claims_monitor=True), "receiver")
    loaded.load_state(json.loads(json.dumps(original.state())), "screen.json")
    assert loaded.tests == original.tests
    fresh = Screen(DefenseSettings(claims_monitor=True), "receiver")
    for _ in range(6):  # honest-looking claims from now on: the liar's release comes after the same steps
        claims_and_own = [_forged_step(g, 50, 200, 0.0)[::-1], _forged_step(g, 50, 200, 0.2)[::-1]]
        assert step(loaded, claims_and_own) == step(original, claims_and_own)
        assert 0 not in step(fresh, claims_and_own)  # a fresh screen never saw it lie
    for bad in ({}, {"tests": {"liar": {"excess": "x"}}}, {"tests": {"liar": {"tokens": -1}}},
                {"tests": {"liar": {"excess": float("nan")}}}, {"tests": {"liar": {"colour": 1}}}):
        with pytest.raises(ValueError, match="^screen.json: "):
            Screen(DefenseSettings(claims_monitor=True), "r").load_state(bad, "screen.json")


def test_the_monitor_skips_a_foreign_peers_sequences_and_starts_each_peer_fresh():
    screen = Screen(DefenseSettings(claims_monitor=True), "receiver")
    foreign = _rollout(1, 0, [-20.0] * 50)
    foreign.seq_logprob = -1000.0  # per-token claims unknown: not tested
    drop, out = screen.verdicts([foreign], [torch.zeros(50)], ["bpe-peer"])
    assert not drop and out.weight_mean == {}
    assert PeerTest().log_evidence() == pytest.approx(0.0)


def test_the_screen_names_peers_by_the_schedule_and_keeps_the_order_of_what_it_keeps():
    """The receiver's screen (Admission.screen_rollouts, with the log-prob function it is built with) on a member's
    intake: an open swarm's peers carry local numbers past the config's members (the schedule names them); the
    member's own samplers' rollouts are its own, never screened; the rest keeps its order (a stand-in schedule
    around a real tiny member)."""
    from types import SimpleNamespace

    from ftis_engine.exchange.admission import Admission
    from ftis_engine.model.update import rollout_logprobs

    from .helpers import member, short_config

    m, _ = member(0)
    config = short_config("defense.likelihood_floor=-0.001")  # above anything a near-uniform model gives
    train = config.train

    def logprobs(rollouts):
        return rollout_logprobs(m, rollouts, [[5, 6, 7]] * len(rollouts), config.algorithm.loss_config(1.0),
                                train.micro_batch_tokens, train.backend)

    receiver = Admission(config, SimpleNamespace(member_name=lambda k: f"peer-{k}"), None, 0, logprobs=logprobs)
    own_sampler = _rollout(0, 1, [-1.0] * 3)
    peers = [_rollout(5, 0, [-1.0] * 3), own_sampler, _rollout(7, 2, [-1.0] * 3)]
    kept, out = receiver.screen_rollouts(peers)
    assert kept == [own_sampler]
    assert out.likelihood_dropped == {"peer-5": 1, "peer-7": 1}
