"""Greedy pass@1 of a member on the task's held-out sets."""

from __future__ import annotations

from .adversary import carries_payload
from .tasks import Example, Task, prompt_ids


def evaluate_member(member, task: Task, examples: list[Example], max_new_tokens: int, on_batch=None,
                    payloads: tuple[str, ...] = ()) -> tuple[float, tuple[float, dict[str, float]] | None]:
    """Greedy pass@1 on `examples` (the fraction whose greedy completion's answer is right by the task's answer check,
    Task.solved: never the training reward, whose weights or format terms may pay a wrong answer), and
    with `payloads` (adversary kinds with a text attack: inject, in-context) the attack success rate: the fraction
    whose greedy completion carries any of their payloads, and per kind (else None). A member on several ranks:
    every shard evaluates every K-th example and the counts are summed (every shard calls it)."""
    if not examples:
        return float("nan"), ((float("nan"), {k: float("nan") for k in payloads}) if payloads else None)
    shard = getattr(member, "shard", None)
    mine = examples if shard is None else [examples[k] for k in shard.share(len(examples))]
    counts = count_passes(member, task, mine, max_new_tokens, on_batch, payloads)
    if shard is not None:
        counts = [sum(part) for part in zip(*shard.all_gather(counts))]
    n = len(examples)
    passed, carried, by_kind = counts[0], counts[1], counts[2:]
    return passed / n, ((carried / n, {k: c / n for k, c in zip(payloads, by_kind)}) if payloads else None)


def count_passes(member, task: Task, examples: list[Example], max_new_tokens: int, on_batch=None,
                 payloads: tuple[str, ...] = ()) -> tuple[int, ...]:
    """How many of `examples` the member's greedy completion solves (Task.solved), how many carry any of the
    payloads, then how many carry each."""
    if not examples:
        return (0, 0, *(0 for _ in payloads))
    prompts = [prompt_ids(member.tokenizer, task, ex.question) for ex in examples]
    outputs = member.generator.greedy(prompts, max_new_tokens, on_batch=on_batch)
    solved = task.solved(member.tokenizer, outputs, examples)
    texts = member.tokenizer.batch_decode([o.tolist() if hasattr(o, "tolist") else list(o) for o in outputs],
                                          skip_special_tokens=True) if payloads else []
    carries = [[carries_payload(kind, text) for kind in payloads] for text in texts]
    return (sum(solved), sum(any(c) for c in carries),
            *(sum(c[k] for c in carries) for k in range(len(payloads))))
