"""Greedy pass@1 of a member on the task's held-out sets."""

from __future__ import annotations

from .tasks import Example, Task, prompt_ids


def evaluate_member(member, task: Task, examples: list[Example], max_new_tokens: int, on_batch=None) -> float:
    """Fraction of `examples` whose greedy completion earns reward 1 (pass@1), scored by Task.score."""
    if not examples:
        return float("nan")
    prompts = [prompt_ids(member.tokenizer, task, ex.question) for ex in examples]
    outputs = member.generator.greedy(prompts, max_new_tokens, on_batch=on_batch)
    rewards = task.score(member.tokenizer, outputs, examples)
    return sum(reward >= 1.0 for reward in rewards) / len(examples)
