"""One member's rollouts of one step (or a sampler's round): generate G completions of each dealt prompt, score
them, and tag them with the policy version that made them."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..exchange.adversary import least_new_tokens
from ..data.rollouts import Rollout
from ..generation import SamplingSettings

if TYPE_CHECKING:
    from ..member.members import Member
    from .session import Swarm


def generate_rollouts(swarm: Swarm, member: Member, dealt: dict[int, int], version: int, seed: int) -> list[Rollout]:
    """The member's completions of its dealt prompts ({prompt index: completions}), scored (Task.score), as
    Rollouts of policy `version`, sampled with `seed`."""
    config, task = swarm.config.rollout, swarm.task
    adversary = swarm.config.members[member.index].adversary
    by_n: dict[tuple[int, int], list[int]] = {}
    for prompt, n in dealt.items():  # a `long` adversary fills a rate share of its prompts to the limit
        by_n.setdefault((n, least_new_tokens(adversary, seed, prompt, config.max_new_tokens)), []).append(prompt)
    rollouts: list[Rollout] = []
    bar = swarm.progress.start(f"{member.name}: generate", sum(dealt.values()))
    made = 0
    for (n, least), prompts in by_n.items():
        # each call seeded past the completions before it: calls seeded alike would draw the same noise (the HF
        # generator's stream, vLLM's per-request seeds or its default generator) for their first prompts
        sampling = SamplingSettings(n=n, max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                                    top_p=config.top_p, top_k=config.top_k, seed=seed + made, min_new_tokens=least)
        made += len(prompts) * n
        groups = member.generator.generate([swarm.prompt(member, p) for p in prompts], sampling,
                                           on_batch=lambda k: swarm.progress.advance(bar, k))
        completions = [(p, c) for p, group in zip(prompts, groups) for c in group]
        # a completion whose scoring times out has no verdict: it travels unscored (NaN), and sender and receivers
        # alike leave its group out of their updates (an honest sender under load is never taken for a liar)
        rewards = task.score(member.tokenizer, [c.token_ids for _, c in completions],
                             [task.train[p] for p, _ in completions], undecided=None)
        rewards = [float("nan") if reward is None else reward for reward in rewards]
        made_at = time.time()
        rollouts += [Rollout(member=member.index, prompt_index=p, completion_ids=c.token_ids, gen_logprobs=c.logprobs,
                             reward=reward, finish_reason=c.finish_reason, policy_version=version, made_at=made_at)
                     for (p, c), reward in zip(completions, rewards)]
    swarm.progress.finish(bar)
    return rollouts
