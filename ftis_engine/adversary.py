"""Members that lie on the wire, for studies and tests of what a dishonest peer can do (issue 45).

A member with `members.N.adversary: {kind, rate}` generates, scores and trains on its own rollouts honestly; only
the copy it sends its peers lies, on a `rate` share of its completions (drawn per completion from the run seed,
the member and the step, so a run is reproducible):

    forge-high  claims every token was generated with probability e^-20 (log-prob -20): under TIS / F-TIS every
                token's importance weight min(exp(l - g), C) sits at the cap C, and the KL filter, which reads the
                same claims, sees a huge divergence
    forge-low   claims every token was generated with probability 1 (log-prob 0): its weights become exp(l) <= 1,
                near 0 for unlikely tokens
    long        no lie on the wire: it generates a rate share of its prompts' groups with the end of sequence
                suppressed until rollout.max_new_tokens (needlessly long completions, which still earn the reward
                where the task's reward reads the answer it holds: compute spent on every receiver), and trains
                on them itself

Both pass every check a receiver can make without its own model: the log-probs are finite and not positive, the
ids and rewards are the honest ones (`implausible_claims` in exchange/admission.py refuses them where no sampler
could have made them). Not built yet: `inject`, `in-context` and `forge-filter` (they need completions whose text
is changed after generation).
"""

from __future__ import annotations

import dataclasses
import random

import torch

from .rollouts import Rollout

FORGED_HIGH = -20.0  # "probability near 0": e^-20


def lie(kind: str, rate: float, rollouts: list[Rollout], seed: int, member: int, step: int) -> tuple[list[Rollout],
                                                                                                   int]:
    """The copy of `rollouts` a member with this adversary setting sends; and how many of them it forged."""
    if kind not in ("forge-high", "forge-low"):  # long: honest on the wire (its generation is what differs)
        return rollouts, 0
    rng = random.Random(f"{seed}-adversary-{member}-{step}")
    out, forged = [], 0
    for r in rollouts:
        if rng.random() >= rate:
            out.append(r)
            continue
        forged += 1
        value = FORGED_HIGH if kind == "forge-high" else 0.0
        out.append(dataclasses.replace(r, gen_logprobs=torch.full_like(r.gen_logprobs, value)))
    return out, forged


__all__ = ["FORGED_HIGH", "lie"]
