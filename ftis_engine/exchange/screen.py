"""The receiver's defenses that need its own model (defense.likelihood_floor, defense.claims_monitor): after
admission (exchange/admission.py, which needs no model), one no-grad forward of the receiver over its peers'
completions gives l_t, its own log-prob of each of their tokens at the sampling temperature, and two rules read it:

- **likelihood check** (the homogeneous defense of "Hail to the Thief", arXiv 2511.09780, generalised to peers
  of other models): a peer group holding a completion with a window of `defense.likelihood_window` consecutive
  tokens whose mean l_t is below `defense.likelihood_floor` is left out, whatever its advantage (a phrase planted
  in the reasoning is text the receiver would not write). Counted in likelihood_dropped(_by).
- **claims monitor**: a test that a peer's claimed generation log-probs g_t are honest, with a false-alarm bound
  that holds for any pair of models. A token an honest peer sampled from pi_gen has
  E[exp(l_t - g_t) | the past] = sum over pi_gen's support of pi_theta <= 1, so X_t = min(exp(l_t - g_t), B) lies
  in [0, B] with conditional mean <= 1 (whatever the temperature, top-p or top-k: the claims are the processed
  log-probs). By Hoeffding's lemma exp(lam * sum_t (X_t - 1) - n lam^2 B^2 / 8) is then a non-negative
  supermartingale for every lam > 0, and so is their mean over a grid of lam; by Ville's inequality it ever
  reaches 1/alpha with probability <= alpha over the whole run, however often it is looked at. A peer whose
  claims reach it (claims that make the receiver's model look likelier than its sampler can have been:
  forge-high, forge-filter, inflated weights of any kind) is quarantined: its rollouts are refused (counted in
  quarantined, a warning naming it) until its claims over its latest steps in quarantine (at least RELEASE_PARCELS
  steps and RELEASE_TOKENS tokens) look honest together (their mean weight within the Hoeffding bound at 5% for
  their token count: a peer that forges a share of its tokens too small for one step to show stays in), and its
  test starts over from half its threshold (a peer
  let out is caught again twice as fast; an honest one, falsely quarantined with probability 1e-6, is then
  quarantined again with probability at most 1e-3). Claims that shrink the weights (forge-low) are not what it
  tests: the claims check refuses those (admission, step 8b).

Both run only where set (off by default: docs/adversaries.md's study); a member's own samplers are its own. The likelihood check
reads every peer rollout, a foreign peer's too (its text re-encoded with the receiver's tokenizer); the monitor
reads only those of the receiver's tokenizer (a foreign peer's per-token claims are not known). A sharded member's
shards all run the forward; its leader decides and every shard applies its verdicts. Every peer's test goes into
the member's checkpoint (screen.json) and a resumed run goes on with it: a quarantined peer stays quarantined, and
the evidence gathered on each peer is kept. Each peer group is screened once, the step it is admitted, before the
async budget takes the intake (Admission.receive): a group left out frees its place for another, and a peer newly
quarantined loses its groups still waiting.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..data.rollouts import Rollout

# a receiver's own per-token log-probs of peer rollouts' completions (one tensor each), from one no-grad forward of
# its model: what the defenses below read (session builds it around update.rollout_logprobs)
LogProbs = Callable[[list[Rollout]], list[torch.Tensor]]

log = logging.getLogger("ftis_engine")

MONITOR_BOUND = 2.0  # B: the weights the monitor reads are truncated here (the paper's cap)
MONITOR_ALPHA = 1e-6  # the probability, over a whole run, that an honest peer is ever quarantined
MONITOR_TOLERANCE = 0.02  # how far above 1 an honest mean weight may sit: bf16 claims round by about 0.4%
MONITOR_LAMBDAS = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)  # the grid the test mixes over (small drifts to gross lies)
RELEASE_PARCELS = 3  # at least this many steps in quarantine, and
RELEASE_TOKENS = 2000  # at least this many tokens (the latest steps that hold them), whose claims together must
RELEASE_LEVEL = 0.05  # look honest: a mean weight within the Hoeffding bound at this level for their token count


def lowest_window_mean(logprobs: torch.Tensor, window: int) -> float:
    """The least mean of `window` consecutive entries of [L] log-probs (the whole sequence's mean if shorter)."""
    values = logprobs.double()
    if values.numel() <= window:
        return float(values.mean()) if values.numel() else 0.0
    sums = values.cumsum(0)
    sums = torch.cat([sums.new_zeros(1), sums])
    return float(((sums[window:] - sums[:-window]) / window).min())


def monitor_weights(own_logprobs: torch.Tensor, claimed: torch.Tensor) -> torch.Tensor:
    """X_t = min(exp(l_t - g_t), B) for the monitor, the log-ratio clamped to [-20, 20] as everywhere."""
    return torch.exp((own_logprobs.double() - claimed.double()).clamp(-20.0, 20.0)).clamp(max=MONITOR_BOUND)


@dataclass
class PeerTest:
    """One peer's running test: the sum of (X_t - 1 - tolerance) and the token count since it last started."""

    excess: float = 0.0
    tokens: int = 0
    head_start: float = 0.0  # log evidence carried over a release (half the threshold: a peer let out is re-caught sooner)
    quarantined: bool = False
    recent: list[tuple[float, int]] = field(default_factory=list)  # in quarantine: (weight sum, tokens) by step

    def log_evidence(self) -> float:
        """log of the mixture supermartingale's value (>= log(1/alpha): the claims are not honest)."""
        b2 = MONITOR_BOUND ** 2
        terms = [lam * self.excess - self.tokens * lam * lam * b2 / 8 for lam in MONITOR_LAMBDAS]
        top = max(terms)
        return self.head_start + top + math.log(sum(math.exp(t - top) for t in terms) / len(terms))


def looks_honest(total: float, n: int) -> bool:
    """Weights summing to `total` over n tokens: a mean within the Hoeffding bound an honest peer stays under with
    probability 1 - RELEASE_LEVEL."""
    if n == 0:
        return False
    margin = MONITOR_BOUND * math.sqrt(math.log(1 / RELEASE_LEVEL) / (2 * n))
    return total / n <= 1 + MONITOR_TOLERANCE + margin


@dataclass
class Screened:
    """What the screen left out of one step's peer rollouts, per peer name, and what it read."""

    likelihood_dropped: dict[str, int] = field(default_factory=dict)
    quarantined: dict[str, int] = field(default_factory=dict)
    weight_mean: dict[str, float] = field(default_factory=dict)  # per peer: mean monitor weight of this step

    def metrics(self) -> dict:
        return {"likelihood_dropped": sum(self.likelihood_dropped.values()),
                "likelihood_dropped_by": self.likelihood_dropped,
                "quarantined": sum(self.quarantined.values()), "quarantined_by": self.quarantined,
                "peer_weight_mean_by": self.weight_mean}


class Screen:
    """One local member's model-reading defenses, and each peer's monitor test (kept for the run)."""

    def __init__(self, defense, receiver: str):
        self.defense = defense
        self.receiver = receiver
        self.tests: dict[str, PeerTest] = {}

    def state(self) -> dict:
        """Every peer's test, for the member's checkpoint (JSON)."""
        return {"tests": {name: dataclasses.asdict(test) for name, test in self.tests.items()}}

    def load_state(self, state: object, where: str) -> None:
        """Go on with the tests of a checkpoint's state(); a malformed one raises ValueError naming `where`."""
        tests = state.get("tests") if isinstance(state, dict) else None
        if not isinstance(tests, dict):
            raise ValueError(f"{where}: not a screen state (no 'tests' object)")
        loaded = {}
        for name, fields in tests.items():
            try:
                test = PeerTest(**fields)
                numbers = [test.excess, test.head_start] + [x for pair in test.recent for x in pair]
                if not (isinstance(test.tokens, int) and test.tokens >= 0 and isinstance(test.quarantined, bool)
                        and all(isinstance(x, (int, float)) and math.isfinite(x) for x in numbers)
                        and all(len(pair) == 2 for pair in test.recent)):
                    raise TypeError("a field of the wrong type or value")
            except TypeError as exc:
                # from None: a one-line error for the user; the cause adds nothing to it
                raise ValueError(f"{where}: peer {name!r}'s test is malformed ({exc})") from None
            test.recent = [(float(t), int(n)) for t, n in test.recent]
            loaded[name] = test
        self.tests = loaded

    def quarantined_names(self) -> set[str]:
        return {name for name, test in self.tests.items() if test.quarantined}

    @property
    def active(self) -> bool:
        return self.defense.likelihood_floor is not None or self.defense.claims_monitor

    def verdicts(self, rollouts: list[Rollout], own_logprobs: list[torch.Tensor], names: list[str]
                 ) -> tuple[set[int], Screened]:
        """The indices of `rollouts` to leave out (whole groups: one sender's completions of one prompt at one
        version), given the receiver's log-probs of each one's tokens and each one's sender name."""
        out = Screened()
        drop: set[int] = set()
        floor, window = self.defense.likelihood_floor, self.defense.likelihood_window
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(rollouts):
            groups.setdefault((r.member, r.prompt_index, r.policy_version), []).append(i)
        if floor is not None:
            for members in groups.values():
                if any(lowest_window_mean(own_logprobs[i], window) < floor for i in members):
                    drop.update(members)
                    name = names[members[0]]
                    out.likelihood_dropped[name] = out.likelihood_dropped.get(name, 0) + len(members)
        if self.defense.claims_monitor:
            by_peer: dict[str, list[int]] = {}
            for i, r in enumerate(rollouts):
                if r.seq_logprob is None:
                    by_peer.setdefault(names[i], []).append(i)
            for name, members in by_peer.items():
                weights = torch.cat([monitor_weights(own_logprobs[i], rollouts[i].gen_logprobs) for i in members])
                out.weight_mean[name] = float(weights.mean())
                if self._quarantine(name, weights):
                    refused = [i for i in members if i not in drop]
                    drop.update(members)
                    out.quarantined[name] = out.quarantined.get(name, 0) + len(refused)
        return drop, out

    def _quarantine(self, name: str, weights: torch.Tensor) -> bool:
        """Feed one step's weights of a peer to its test; whether its rollouts are refused."""
        test = self.tests.setdefault(name, PeerTest())
        if test.quarantined:
            test.recent.append((float(weights.sum()), weights.numel()))
            while len(test.recent) > RELEASE_PARCELS and \
                    sum(k for _, k in test.recent[1:]) >= RELEASE_TOKENS:  # the latest steps holding enough tokens
                test.recent.pop(0)
            total, n = sum(t for t, _ in test.recent), sum(k for _, k in test.recent)
            if len(test.recent) < RELEASE_PARCELS or n < RELEASE_TOKENS or not looks_honest(total, n):
                return True
            self.tests[name] = PeerTest(head_start=math.log(1 / MONITOR_ALPHA) / 2)
            log.warning("%s: peer %s released from quarantine: its claimed log-probs of its last %d steps look "
                        "honest", self.receiver, name, RELEASE_PARCELS)
            return False  # this step's were honest-looking: taken (and the test starts over after them)
        test.excess += float((weights - 1 - MONITOR_TOLERANCE).sum())
        test.tokens += weights.numel()
        if test.log_evidence() < math.log(1 / MONITOR_ALPHA):
            return False
        test.quarantined, test.recent = True, []
        log.warning("%s: peer %s quarantined: its claimed generation log-probs make this model's tokens likelier "
                    "than any sampler's can be (mean weight %.3f over %d tokens; false alarm < %g): its rollouts "
                    "are refused until its claims look honest again", self.receiver, name,
                    1 + (test.excess / test.tokens) + MONITOR_TOLERANCE, test.tokens, MONITOR_ALPHA)
        return True


__all__ = ["PeerTest", "Screen", "Screened", "looks_honest", "lowest_window_mean", "monitor_weights"]
