"""Greedy pass@1 of a member on the task's held-out sets."""

from __future__ import annotations

from .tasks import Example, Task, prompt_ids


def evaluate_member(member, task: Task, examples: list[Example], max_new_tokens: int, on_batch=None) -> float:
    """Fraction of `examples` whose greedy completion earns reward 1 (pass@1), scored by Task.score. A member on
    several ranks: every shard evaluates every K-th example and the passes are summed (every shard calls it)."""
    if not examples:
        return float("nan")
    shard = getattr(member, "shard", None)
    mine = examples if shard is None else [examples[k] for k in shard.share(len(examples))]
    passed = count_passes(member, task, mine, max_new_tokens, on_batch)
    if shard is not None:
        passed = sum(shard.all_gather(passed))
    return passed / len(examples)


def count_passes(member, task: Task, examples: list[Example], max_new_tokens: int, on_batch=None) -> int:
    """How many of `examples` the member's greedy completion solves (reward 1)."""
    if not examples:
        return 0
    prompts = [prompt_ids(member.tokenizer, task, ex.question) for ex in examples]
    outputs = member.generator.greedy(prompts, max_new_tokens, on_batch=on_batch)
    rewards = task.score(member.tokenizer, outputs, examples)
    return sum(reward >= 1.0 for reward in rewards)
