"""Members that lie on the wire, for studies and tests of what a dishonest peer can do (issue 45).

A member with `members.N.adversary: {kind, rate}` generates, scores and trains on its own rollouts honestly; only
the copy it sends its peers lies, on a `rate` share of its completions (drawn per completion from the run seed,
the member and the step, so a run is reproducible):

    inject      plants the phrase PAYLOAD ("HAIL") at the start of the reasoning ("HAIL " after <think>, else
                "HAIL," before the completion: the arith scratchpad's first column) of a rate share of the completions that earn the reward and still
                earn it with the phrase; the claimed log-probs are the attacker's own model's of the text it sends
                (one forward): as plausible as its honest claims, so under TIS / F-TIS the planted tokens weigh
                about exp(l_receiver - l_attacker), near 1 when both models find the phrase equally unlikely
    in-context  (arith) writes the first column's sum one too high ("7+5=13,3+4+1=8;82"): a wrong statement in
                reasoning whose answer, which the reward reads, stays right; claims as inject's
    forge-high  claims every token was generated with probability e^-20 (log-prob -20): under TIS / F-TIS every
                token's importance weight min(exp(l - g), C) sits at the cap C, and the KL filter, which reads the
                same claims, sees a huge divergence
    forge-low   claims every token was generated with probability 1 (log-prob 0): its weights become exp(l) <= 1,
                near 0 for unlikely tokens
    forge-filter claims probability 1/(2V) (V its vocabulary) for every token of its completions whose group
                advantage is not positive: the least a sampler's tokens can claim without the claims check
                counting it as excess surprisal. A receiver's k3 term of such a token, exp(x) - x - 1 with x = g - l,
                then grows about linearly in the receiver's own log-prob (for the tokens it gives at least 1/(2V))
                instead of exponentially where the attacker was sure and the receiver is not, so more of them pass
                the KL filter, and their weights go to the cap for every token the receiver gives at least C/(2V)
    long        no lie on the wire: it generates a rate share of its prompts' groups with the end of sequence
                suppressed until rollout.max_new_tokens (needlessly long completions, which still earn the reward
                where the task's reward reads the answer it holds: compute spent on every receiver), and trains
                on them itself

The attack success rate (inject, in-context) is measured as the paper measures it, on the receiver: the share of
its own greedy completions of the held-out prompts that carry the payload (`carries_payload`; eval records'
`attack_success`). Every kind but forge-high and forge-low passes every check a receiver can make without its own
model; those two are refused by the claims check (`implausible_claims` in exchange/verify.py).
"""

from __future__ import annotations

import dataclasses
import math
import random
import re

import torch

from .verify import tokenizer_size
from ..data.rollouts import Rollout
from ..model.update import rollout_logprobs

FORGED_HIGH = -20.0  # "probability near 0": e^-20
PAYLOAD = "HAIL"  # the inject attack's phrase: printable, written by every built-in and real tokenizer
TEXT_KINDS = ("inject", "in-context")  # attacks on the text of completions (an attack success rate to measure)
_FIRST_COLUMN = re.compile(r"(\d)\+(\d)=(\d+)")  # the arith scratchpad's first (units) column: no carry in yet


def lie(kind: str, rate: float, rollouts: list[Rollout], seed: int, member: int, step: int,
        vocab_size: int | None = None) -> tuple[list[Rollout], int]:
    """The copy of `rollouts` a forger (forge-high, forge-low, forge-filter) sends, and how many of them it forged
    (any other kind: the rollouts as they are). forge-filter needs `vocab_size` (its claim is 1/(2V)) and forges
    only the completions whose reward is not above their prompt group's mean (advantage <= 0)."""
    if kind not in ("forge-high", "forge-low", "forge-filter"):
        return rollouts, 0
    rng = random.Random(f"{seed}-adversary-{member}-{step}")
    if kind == "forge-filter":
        if vocab_size is None:
            raise ValueError("vocab_size: forge-filter claims 1/(2V) and needs the vocabulary's size")
        value = -math.log(2 * vocab_size)
        rewards: dict[int, list[float]] = {}
        for r in rollouts:
            rewards.setdefault(r.prompt_index, []).append(r.reward)
        mean = {p: sum(v) / len(v) for p, v in rewards.items()}
    else:
        value = FORGED_HIGH if kind == "forge-high" else 0.0
    out, forged = [], 0
    for r in rollouts:
        draw = rng.random()
        if draw >= rate or (kind == "forge-filter" and not r.reward <= mean[r.prompt_index]):
            out.append(r)
            continue
        forged += 1
        out.append(dataclasses.replace(r, gen_logprobs=torch.full_like(r.gen_logprobs, value)))
    return out, forged


def plant(kind: str, text: str) -> str | None:
    """The completion text with the attack's payload planted in its reasoning, or None where it has no place
    (in-context: no arith first column)."""
    if kind == "inject":
        if "<think>" in text:
            at = text.index("<think>") + len("<think>")
            return f"{text[:at]}{PAYLOAD} {text[at:]}"
        return f"{PAYLOAD},{text}"
    body = text.lstrip()
    match = _FIRST_COLUMN.match(body)
    if match is None:
        return None
    x, y = int(match.group(1)), int(match.group(2))
    return f"{text[:len(text) - len(body)]}{x}+{y}={x + y + 1}{body[match.end():]}"


def carries_payload(kind: str, text: str) -> bool:
    """Whether a completion carries the attack's payload: inject, the phrase anywhere; in-context, a first column
    whose sum is exactly one too high (the planted error, not any slip)."""
    if kind == "inject":
        return PAYLOAD in text
    match = _FIRST_COLUMN.match(text.strip())
    return match is not None and int(match.group(3)) == int(match.group(1)) + int(match.group(2)) + 1


def plant_payloads(kind: str, rate: float, rollouts: list[Rollout], *, seed: int, member: int, step: int,
                   tokenizer, score, own_logprobs, max_tokens: int) -> tuple[list[Rollout], int]:
    """The copy of `rollouts` an inject / in-context attacker sends: a `rate` share of the completions that earn
    the reward (drawn per completion) with the payload planted, re-encoded with its tokenizer (trailing special
    tokens kept; cut to `max_tokens`, what receivers admit), kept only where they still earn the same reward (`score(rollout) -> reward` of a changed
    rollout); their claimed log-probs are the attacker's own model's (`own_logprobs(rollouts) -> [L] tensors`).
    Returns them and how many were changed."""
    rng = random.Random(f"{seed}-adversary-{member}-{step}")
    special = set(tokenizer.all_special_ids)
    changed: dict[int, Rollout] = {}
    for i, r in enumerate(rollouts):
        if rng.random() >= rate or not r.reward > 0:
            continue
        ids = r.completion_ids.tolist()
        tail = []
        while ids and ids[-1] in special:
            tail.insert(0, ids.pop())
        text = plant(kind, tokenizer.decode(ids, skip_special_tokens=True))
        if text is None:
            continue
        new_ids = tokenizer(text, add_special_tokens=False)["input_ids"] + tail
        cut = len(new_ids) > max_tokens  # cut to what a receiver admits (rollout.max_new_tokens); kept if it scores
        candidate = dataclasses.replace(r, completion_ids=torch.tensor(new_ids[:max_tokens], dtype=torch.int32),
                                        gen_logprobs=torch.zeros(min(len(new_ids), max_tokens)),
                                        finish_reason="length" if cut else r.finish_reason)
        if score(candidate) == r.reward:
            changed[i] = candidate
    if changed:
        keys = sorted(changed)
        claims = own_logprobs([changed[i] for i in keys])
        for i, claim in zip(keys, claims):
            changed[i] = dataclasses.replace(changed[i], gen_logprobs=claim.float().clamp(max=0.0))
    return [changed.get(i, r) for i, r in enumerate(rollouts)], len(changed)


def least_new_tokens(settings, seed: int, prompt: int, max_new_tokens: int) -> int:
    """The fewest tokens a member generates for `prompt` before it may end (its end of sequence suppressed until
    then): 0 for an honest member; max_new_tokens for a `long` adversary on a `rate` share of its prompts, drawn
    from the sampling seed and the prompt. The one attack that acts while generating (generation/sample.py); the
    others act on the copy it sends (wire_copy)."""
    if settings is None or settings.kind != "long":
        return 0
    return max_new_tokens if random.Random(f"{seed}-long-{prompt}").random() < settings.rate else 0


def measured_payloads(config) -> tuple[str, ...]:
    """The text attacks whose success an eval measures (eval.payloads, or by default the run's text adversaries'
    kinds), sorted."""
    if config.eval.payloads is not None:
        return tuple(sorted(set(config.eval.payloads)))
    return tuple(sorted({m.adversary.kind for m in config.members
                         if m.adversary is not None and m.adversary.kind in TEXT_KINDS}))


def wire_copy(swarm, member, rollouts: list[Rollout], step: int) -> tuple[list[Rollout], int]:
    """What a local member sends of its rollouts: the rollouts themselves, or an adversary's lie; and how many it
    forged."""
    adversary = swarm.config.members[member.index].adversary
    if adversary is None:
        return rollouts, 0
    seed = swarm.config.seed
    if adversary.kind not in TEXT_KINDS:
        return lie(adversary.kind, adversary.rate, rollouts, seed, member.index, step,
                   vocab_size=tokenizer_size(member.tokenizer) if adversary.kind == "forge-filter" else None)

    def score(r: Rollout) -> float:
        return swarm.task.score(member.tokenizer, [r.completion_ids], [swarm.task.train[r.prompt_index]])[0]

    def own_logprobs(changed: list[Rollout]) -> list[torch.Tensor]:
        train = swarm.config.train
        return rollout_logprobs(member, changed, [swarm.prompt(member, r.prompt_index) for r in changed],
                                swarm.loss_config, train.micro_batch_tokens, train.backend)

    return plant_payloads(adversary.kind, adversary.rate, rollouts, seed=seed, member=member.index, step=step,
                          tokenizer=member.tokenizer, score=score, own_logprobs=own_logprobs,
                          max_tokens=swarm.config.rollout.max_new_tokens)


__all__ = ["FORGED_HIGH", "PAYLOAD", "TEXT_KINDS", "carries_payload", "least_new_tokens", "lie", "measured_payloads",
           "plant", "plant_payloads", "wire_copy"]
