"""What a peer may send: the checks of a peer's rollouts that need no model (admission.py applies them, in its
order, to every parcel). `validate`: the deal, the sender, ids, lengths and values; `implausible_claims`: generation
log-probs no generator can have made; `RolloutChecker`: both, the rewards re-scored here, and a foreign peer's text
adopted into the receiver's tokens. Everything raises RolloutError naming the first problem.
"""

from __future__ import annotations

import math

import torch

from ..data.context import FOREIGN_EXPANSION
from ..data.rollouts import Rollout, RolloutError, reencoded
from ..data.tasks import Task


def validate(rollouts: list[Rollout], *, sender: int, vocab_size: int, max_new_tokens: int,
             expected: dict[int, int] | None, num_prompts: int) -> None:
    """Check a peer's rollouts before training on them; raises RolloutError naming the first problem.
    sender: the member they claim to be from; expected: prompt index -> number of completions dealt to it for
    the parcel's step (None: not checked)."""
    if expected is not None:
        counts: dict[int, int] = {}
        for r in rollouts:
            counts[r.prompt_index] = counts.get(r.prompt_index, 0) + 1
        for prompt, count in counts.items():
            if prompt not in expected:
                raise RolloutError(f"prompt index {prompt} was not dealt to member {sender} this step")
            if count != expected[prompt]:
                raise RolloutError(f"{count} completions of prompt {prompt}, {expected[prompt]} were dealt")
        missing = set(expected) - set(counts)
        if missing:
            raise RolloutError(f"no completions of dealt prompt {min(missing)}")
    for i, r in enumerate(rollouts):
        where = f"sequence {i}"
        if r.member != sender:
            raise RolloutError(f"{where}: claims member {r.member}, sent by member {sender}")
        if not 0 <= r.prompt_index < num_prompts:
            raise RolloutError(f"{where}: prompt index {r.prompt_index} is outside the dataset (0..{num_prompts - 1})")
        if r.gen_logprobs.numel() != r.num_tokens:
            raise RolloutError(f"{where}: {r.gen_logprobs.numel()} log-probs for {r.num_tokens} tokens")
        if not 1 <= r.num_tokens <= max_new_tokens:
            raise RolloutError(f"{where}: {r.num_tokens} tokens, outside 1..max_new_tokens={max_new_tokens}")
        if bool(((r.completion_ids < 0) | (r.completion_ids >= vocab_size)).any()):
            raise RolloutError(f"{where}: token id outside the vocabulary [0, {vocab_size})")
        if not bool(torch.isfinite(r.gen_logprobs).all()):
            raise RolloutError(f"{where}: NaN or inf generation log-prob")
        if bool((r.gen_logprobs > 0).any()):
            raise RolloutError(f"{where}: positive generation log-prob")
        if math.isinf(r.reward):  # NaN is allowed: the sender's own scoring had no verdict (unscored)
            raise RolloutError(f"{where}: reward is infinite")
        if r.policy_version < 0:
            raise RolloutError(f"{where}: negative policy version {r.policy_version}")
        if r.made_at < 0:
            raise RolloutError(f"{where}: made before 1970 ({r.made_at:.3f} s since the epoch)")


# the false-alarm probability of the surprisal bound, per sequence and per parcel, under any honest generator
CLAIM_FALSE_ALARM = 1e-9
# how far above 1 the claimed probabilities of a prefix's branches may sum (an honest sampler's numerics: one
# group's sequences are forward passes of their own rows, in bf16 on a GPU)
BRANCH_TOLERANCE = 0.25


def surprisal_limit(tokens: int, alpha: float = CLAIM_FALSE_ALARM) -> float:
    """The c > 1 for which `tokens` honestly sampled tokens have a mean excess surprisal above c with probability
    at most alpha. A token sampled from any distribution over V ids has P(-log p > log V + s) <= e^-s (the ids
    with p < e^-(log V + s) hold less than that mass together), whatever came before it: the excesses over log V
    are dominated by independent Exp(1) draws, and Chernoff's bound for their mean gives
    P(mean > c) <= exp(-n (c - 1 - ln c))."""
    target = math.log(1 / alpha) / tokens
    low, high = 1.0, 2.0
    while high - 1 - math.log(high) < target:
        high *= 2
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if mid - 1 - math.log(mid) < target else (low, mid)
    return high


def implausible_claims(rollouts: list[Rollout], vocab_size: int, branches: bool = True) -> str | None:
    """What no honest generator's claimed log-probs can show, or None (no model needed; false alarms bounded):

    - surprisal: a sequence's, or the whole parcel's, mean claimed surprisal -log p over log(2 V) above
      surprisal_limit (a forger claiming every token was improbable, to push its importance weights to the cap);
    - branches: completions of one prompt share a prefix and then differ: their claimed probabilities of the
      different next tokens come from one distribution and sum to at most 1 (+ BRANCH_TOLERANCE) (a forger claiming
      probability 1 for every token). Only with branches (no top-k or top-p: a truncation that rounding moves
      between two rows renormalises their claims by more than rounding)."""
    floor = math.log(2 * vocab_size)
    total, count = 0.0, 0
    for i, r in enumerate(rollouts):
        excess = float((-r.gen_logprobs.double() - floor).sum())
        n = r.num_tokens
        total, count = total + excess, count + n
        if excess / n > surprisal_limit(n):
            return (f"sequence {i}: its claimed generation log-probs average {float(r.gen_logprobs.double().mean()):.2f}"
                    f", a surprisal no sampler over {vocab_size} ids shows (false alarm < {CLAIM_FALSE_ALARM:g})")
    if count and total / count > surprisal_limit(count):
        return (f"its {count} tokens' claimed generation log-probs average a surprisal no sampler over {vocab_size} "
                f"ids shows (false alarm < {CLAIM_FALSE_ALARM:g})")
    by_prompt: dict[int, list[Rollout]] = {}
    for r in rollouts:
        by_prompt.setdefault(r.prompt_index, []).append(r)
    for prompt, group in by_prompt.items() if branches else ():
        children: dict[tuple[int, int], tuple[int, float]] = {}  # (node, token) -> (child node, least claim)
        branches: dict[int, dict[int, float]] = {}  # node -> token -> least claimed log-prob
        for r in group:
            node = 0
            for token, claim in zip(r.completion_ids.tolist(), r.gen_logprobs.double().tolist()):
                child = children.get((node, token))
                if child is None:
                    child = (len(children) + 1, claim)
                children[(node, token)] = (child[0], min(child[1], claim))
                branches.setdefault(node, {})[token] = children[(node, token)][1]
                node = child[0]
        for node, claims in branches.items():
            if len(claims) > 1:
                mass = sum(math.exp(c) for c in claims.values())
                if mass > 1 + BRANCH_TOLERANCE:
                    return (f"completions of prompt {prompt} branch into {len(claims)} tokens whose claimed "
                            f"generation probabilities sum to {mass:.3g} (one distribution's sum to at most 1)")
    return None


class RolloutChecker:
    """Steps 8 and 9 for one receiving member: the values of a peer's rollouts, and their rewards re-scored."""

    def __init__(self, task: Task, tokenizer, vocab_size: int, max_new_tokens: int,
                 foreign: dict[int, object] | None = None, foreign_limit: int | None = None,
                 check_claims: bool = True, branches: bool = True):
        self.task = task
        self.check_claims = check_claims
        self.branches = branches  # the branch test of the claims (sampling without top-k or top-p)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_new_tokens = max_new_tokens
        self.foreign = foreign or {}  # member -> its tokenizer, for members whose tokenizer differs from this one
        # the most tokens a re-encoded foreign completion may have here (what fits after the longest prompt)
        self.foreign_limit = foreign_limit if foreign_limit is not None else FOREIGN_EXPANSION * max_new_tokens

    def is_foreign(self, member: int) -> bool:
        return member in self.foreign

    def check(self, rollouts: list[Rollout], sender: int, dealt: dict[int, int] | None
              ) -> tuple[list[Rollout], int, int]:
        """Validate a peer's decoded rollouts and re-score them; raises RolloutError on any problem. A group the
        verdict on which is missing is left out whole (a group trains only whole), the rest kept: one whose
        re-score here times out (math-verify's 5 s: its claim cannot be checked), and one the sender itself marked
        unscored (a NaN reward: its own scoring timed out, which depends on its load, so an honest slow sender is
        never taken for a liar). Returns the kept rollouts and the sequences left out for each reason."""
        tokenizer = self.foreign.get(sender, self.tokenizer)  # a foreign peer's ids are its tokenizer's
        vocab_size = self.vocab_size if sender not in self.foreign else tokenizer_size(tokenizer)
        validate(rollouts, sender=sender, vocab_size=vocab_size, max_new_tokens=self.max_new_tokens,
                 expected=dealt, num_prompts=len(self.task.train))
        if self.check_claims:
            problem = implausible_claims(rollouts, vocab_size, self.branches)
            if problem is not None:
                raise RolloutError(problem)
        unscored = {r.prompt_index for r in rollouts if math.isnan(r.reward)}
        claimed = [(i, r) for i, r in enumerate(rollouts) if r.prompt_index not in unscored]
        try:
            local = self.task.score(tokenizer, [r.completion_ids for _, r in claimed],
                                    [self.task.train[r.prompt_index] for _, r in claimed], undecided=None)
        # a catch-all, as it must be: a peer's (untrusted) ids and text through the user's reward code, which may raise
        # anything on them (ids the tokenizer cannot decode, a reward that fails on this text): the parcel is refused
        except Exception as exc:
            raise RolloutError(f"cannot score the completions: {exc}") from exc
        unverified = set()
        for (i, rollout), reward in zip(claimed, local):
            if reward is None:
                unverified.add(rollout.prompt_index)
            elif abs(reward - rollout.reward) > 1e-6:
                raise RolloutError(f"sequence {i}: claims reward {rollout.reward:g}, re-scored {reward:g}")
        claimed = [r for _, r in claimed]
        kept = [r for r in claimed if r.prompt_index not in unverified]
        return kept, len(claimed) - len(kept), len(rollouts) - len(claimed)

    def adopt(self, rollouts: list[Rollout], sender: int) -> tuple[list[Rollout], int]:
        """A foreign peer's checked rollouts in this member's tokens: each completion's text (the sender's tokens
        decoded, special tokens kept, its final EOS left off when it stopped) re-encoded here, this member's EOS
        appended when it stopped, and the sequence's generation log-prob (the sum of the sender's per-token ones)
        in seq_logprob; per-token log-probs are unknown (zeros, unused: the op's gen_seq_logprobs path). A text
        that does not decode back to itself here (a symbol this tokenizer lacks), or re-encodes longer than
        foreign_limit, leaves its prompt group out. Raises RolloutError for what an honest peer never sends: a
        "stop" that does not end in one of its special tokens, a sequence log-prob that is not finite in float32.
        Returns them and how many were left out. Rollouts of a same-tokenizer peer come back unchanged."""
        peer = self.foreign.get(sender)
        if peer is None:
            return rollouts, 0
        own, eos = self.tokenizer, self.tokenizer.eos_token_id
        specials = set(peer.all_special_ids)
        converted, lost = [], set()
        for i, r in enumerate(rollouts):
            ids = r.completion_ids.tolist()
            stopped = r.finish_reason == "stop"
            if stopped and ids[-1] not in specials:  # else the trained text would differ from the scored one
                raise RolloutError(f"sequence {i}: claims it stopped, but its last token {ids[-1]} is none of its "
                                   "tokenizer's special tokens")
            seq_logprob = float(r.gen_logprobs.double().sum())
            if not math.isfinite(float(torch.tensor(seq_logprob, dtype=torch.float32))):
                raise RolloutError(f"sequence {i}: its log-probs sum to a value float32 cannot hold")
            text = peer.decode(ids[:-1] if stopped else ids, skip_special_tokens=False)
            mine = own(text, add_special_tokens=False)["input_ids"] if text else []
            if own.decode(mine, skip_special_tokens=False) != text or not (mine or stopped) \
                    or (stopped and eos is None) or len(mine) + stopped > self.foreign_limit:
                lost.add(r.prompt_index)
                continue
            converted.append(reencoded(r, mine + ([eos] if stopped else [])))  # its sum, count and final EOS
        kept = [r for r in converted if r.prompt_index not in lost]
        return kept, len(rollouts) - len(kept)


def tokenizer_size(tokenizer) -> int:
    """The ids a tokenizer can decode: its length, or one past its largest id (added tokens may leave gaps)."""
    return max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)
