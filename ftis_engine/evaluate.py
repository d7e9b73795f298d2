"""Greedy pass@1 of a member on the task's held-out sets."""

from __future__ import annotations

from .tasks import Example, Task, prompt_ids


def evaluate_member(member, task: Task, examples: list[Example], max_new_tokens: int, on_batch=None) -> float:
    """Fraction of `examples` whose greedy completion earns reward 1 (pass@1)."""
    if not examples:
        return float("nan")
    prompts = [prompt_ids(member.tokenizer, task, ex.question) for ex in examples]
    outputs = member.generator.greedy(prompts, max_new_tokens, on_batch=on_batch)
    texts = member.tokenizer.batch_decode([o.tolist() for o in outputs], skip_special_tokens=True)
    correct = sum(task.reward(text, ex.answer) >= 1.0 for text, ex in zip(texts, examples))
    return correct / len(examples)
