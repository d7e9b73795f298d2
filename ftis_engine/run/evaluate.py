"""Greedy pass@1 of a member on the task's held-out sets, and of every member a process holds (evaluate_all)."""

from __future__ import annotations

from ..data.tasks import Example, Task, prompt_ids
from ..exchange.adversary import carries_payload, measured_payloads
from ..report.metrics import eval_record, return_freed_memory
from .session import Swarm


def evaluate_member(member, task: Task, examples: list[Example], max_new_tokens: int, on_batch=None,
                    payloads: tuple[str, ...] = ()) -> tuple[float, tuple[float, dict[str, float]] | None]:
    """Greedy pass@1 on `examples` (the fraction whose greedy completion's answer is right by the task's answer check,
    Task.solved: never the training reward, whose weights or format terms may pay a wrong answer), and
    with `payloads` (adversary kinds with a text attack: inject, in-context) the attack success rate: the fraction
    whose greedy completion carries any of their payloads, and per kind (else None). A member on several ranks:
    every shard evaluates every K-th example and the counts are summed (every shard calls it)."""
    accuracy, attacked, _ = evaluate_questions(member, task, examples, max_new_tokens, on_batch, payloads)
    return accuracy, attacked


def evaluate_questions(member, task: Task, examples: list[Example], max_new_tokens: int, on_batch=None,
                       payloads: tuple[str, ...] = ()) -> tuple[float, tuple[float, dict[str, float]] | None,
                                                             list[bool]]:
    """evaluate_member's (accuracy, attack success) and whether each example was solved, in their order: what an
    analysis over questions (a bootstrap over the eval set) needs beside the seeds."""
    if not examples:
        return float("nan"), ((float("nan"), {k: float("nan") for k in payloads}) if payloads else None), []
    shard = member.shard
    mine = list(shard.share(len(examples)))
    solved, carries = judge(member, task, [examples[k] for k in mine], max_new_tokens, on_batch, payloads)
    parts = shard.all_gather((mine, solved, _carried(carries, payloads)))
    correct = [False] * len(examples)
    for indices, flags, _ in parts:
        for k, flag in zip(indices, flags, strict=True):
            correct[k] = flag
    carried = [sum(part) for part in zip(*(c for _, _, c in parts))]
    n = len(examples)
    attacked = (carried[0] / n, {k: c / n for k, c in zip(payloads, carried[1:])}) if payloads else None
    return sum(correct) / n, attacked, correct


def _carried(carries: list[list[bool]], payloads: tuple[str, ...]) -> tuple[int, ...]:
    """How many completions carry any of the payloads, then how many carry each."""
    return (sum(any(c) for c in carries), *(sum(c[k] for c in carries) for k in range(len(payloads))))


def judge(member, task: Task, examples: list[Example], max_new_tokens: int, on_batch=None,
          payloads: tuple[str, ...] = ()) -> tuple[list[bool], list[list[bool]]]:
    """Per example: whether the member's greedy completion solves it (Task.solved), and whether it carries each of
    the payloads."""
    if not examples:
        return [], []
    prompts = [prompt_ids(member.tokenizer, task, ex.question) for ex in examples]
    outputs = member.generator.greedy(prompts, max_new_tokens, on_batch=on_batch)
    solved = task.solved(member.tokenizer, outputs, examples)
    texts = member.tokenizer.batch_decode([o.tolist() if hasattr(o, "tolist") else list(o) for o in outputs],
                                          skip_special_tokens=True) if payloads else [""] * len(examples)
    carries = [[carries_payload(kind, text) for kind in payloads] for text in texts]
    return list(solved), carries


def count_passes(member, task: Task, examples: list[Example], max_new_tokens: int, on_batch=None,
                 payloads: tuple[str, ...] = ()) -> tuple[int, ...]:
    """How many of `examples` the member's greedy completion solves (Task.solved), how many carry any of the
    payloads, then how many carry each."""
    solved, carries = judge(member, task, examples, max_new_tokens, on_batch, payloads)
    return (sum(solved), *_carried(carries, payloads))


def evaluate_all(swarm: Swarm, step: int) -> list[dict]:
    """Greedy pass@1 of every local member on every eval set."""
    cfg = swarm.config.eval
    max_new = cfg.max_new_tokens or swarm.config.rollout.max_new_tokens
    records = []
    payloads = measured_payloads(swarm.config)
    for member in swarm.members:  # a member on several ranks: every shard evaluates a share, the leader reports
        with member.generator.awake():
            for name, examples in swarm.task.evals.items():
                examples = examples[: cfg.max_samples] if cfg.max_samples else examples
                share = len(member.shard.share(len(examples)))
                bar = swarm.progress.start(f"{member.name}: eval {name}", share)
                accuracy, attacked, correct = evaluate_questions(member, swarm.task, examples, max_new,
                                                                 on_batch=lambda k: swarm.progress.advance(bar, k),
                                                                 payloads=payloads)
                swarm.progress.finish(bar)
                record = eval_record(step, member.name, name, accuracy, len(examples), correct)
                if attacked is not None:  # the share of its greedy completions carrying an attacker's payload
                    record["attack_success"], record["attack_success_by"] = attacked
                records.append(record)
                return_freed_memory()  # the greedy passes' KV caches
    return records if swarm.role.reports else []
