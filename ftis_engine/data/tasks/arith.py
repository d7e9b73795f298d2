"""The study testbed's task: column addition with a worked scratchpad, small enough for the built-in tiny models.

A question is "a+b="; a completion is a compact equivalent of the paper's `<think>...</think><answer>...</answer>`:
the scratchpad, ";", the answer, then end of text, e.g. "37+45=" -> "7+5=12,3+4+1=8;82" (17 tokens of the
character-level tokenizer). The reward is binary, format and answer (`scratchpad_reward`).

- in distribution (`arith`, eval set `arith`): two 2-digit numbers, 10..99 each.
- out of distribution (eval set `arith-ood`): a 3-digit plus a 2-digit number, one more column and carry chains,
  the analogue of MATH-500 against GSM8K. Training prompts and warm-start demonstrations hold a few (`OOD_SHARE`)
  so that members start with a little ability there, as the paper's pretrained models do on MATH-500.

Warm-start demonstrations come in two solution styles (the expertise heterogeneity of the study):
- `columns`: right to left, each column as "digit+digit(+carry)=sum": "7+5=12,3+4+1=8;82"
- `carry-first`: the same columns written carry first, the lower operand's digit before the upper's:
  "5+7=12,1+4+3=8;82". Both earn the reward; a member that learnt one finds the other improbable.
- `msd-first`: a shifted task (the distance study's far peer): the columns left to right, most significant
  first, each a plain digit sum with no carry written, the carries resolved only in the answer:
  "3+4=7,7+5=12;82". It earns the same reward, but its scratchpad is another algorithm in another digit order.
"""

from __future__ import annotations

import random
import re

from .base import Example, Task

STYLES = ("columns", "carry-first", "msd-first")
TRAIN_SIZE = 4096
EVAL_SIZE = 200
OOD_SHARE = 0.3  # of training prompts and demonstrations that are out-of-distribution shaped

_COMPLETION = re.compile(r"([^;]+);(\d+)")


def scratchpad_reward(completion: str, gold: str) -> float:
    """1.0 when the completion is exactly `<scratchpad>;<answer>` (one ';', a non-empty scratchpad, an integer
    answer, nothing after it but white space) and the answer equals `gold`; else 0.0."""
    match = _COMPLETION.fullmatch(completion.strip())
    return 1.0 if match is not None and match.group(2) == gold.strip() else 0.0


def _draw(rng: random.Random, ood: bool) -> tuple[int, int]:
    return (rng.randint(100, 999) if ood else rng.randint(10, 99)), rng.randint(10, 99)


def _example(a: int, b: int) -> Example:
    return Example(f"{a}+{b}=", str(a + b))


def solution(question: str, style: str) -> str:
    """The worked completion of "a+b=" in a style (without end of text)."""
    a, b = (int(x) for x in question.rstrip("=").split("+"))
    da, db = str(a)[::-1], str(b)[::-1]
    columns = [(int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0)
               for i in range(max(len(da), len(db)))]  # least significant first
    if style == "msd-first":  # plain digit sums, most significant first, the carries left to the answer
        return ",".join(f"{x}+{y}={x + y}" for x, y in reversed(columns)) + f";{a + b}"
    steps, carry = [], 0
    for x, y in columns:
        total = x + y + carry
        terms = [str(x), str(y)] + (["1"] if carry else [])
        if style == "carry-first":
            terms = terms[::-1]
        steps.append("+".join(terms) + f"={total}")
        carry = total // 10
    return ",".join(steps) + f";{a + b}"


def _eval_sets() -> dict[str, list[Example]]:
    """The held-out sets, fixed (the same for every seed)."""
    rng = random.Random("arith-eval")
    evals: dict[str, list[Example]] = {}
    held: set[str] = set()
    for name, ood in (("arith", False), ("arith-ood", True)):
        examples: list[Example] = []
        while len(examples) < EVAL_SIZE:
            example = _example(*_draw(rng, ood))
            if example.question not in held:
                held.add(example.question)
                examples.append(example)
        evals[name] = examples
    return evals


def _draw_examples(count: int, rng: random.Random, held: set[str]) -> list[Example]:
    examples: list[Example] = []
    while len(examples) < count:
        example = _example(*_draw(rng, rng.random() < OOD_SHARE))
        if example.question not in held:
            examples.append(example)
    return examples


def demonstrations(style: str, count: int, seed: int) -> list[tuple[str, str]]:
    """`count` (question, worked completion) pairs in `style`, drawn from `seed`, none of them an eval question."""
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; expected one of {', '.join(STYLES)}")
    held = {e.question for examples in _eval_sets().values() for e in examples}
    rng = random.Random(f"arith-demonstrations-{style}-{seed}")
    return [(e.question, solution(e.question, style)) for e in _draw_examples(count, rng, held)]


def make_task(seed: int) -> Task:
    """Training prompts drawn from the run seed; eval sets fixed and disjoint from them."""
    evals = _eval_sets()
    held = {e.question for examples in evals.values() for e in examples}
    train = _draw_examples(TRAIN_SIZE, random.Random(f"arith-train-{seed}"), held)
    return Task(name="arith", train=train, evals=evals, reward=scratchpad_reward, system_prompt=None,
                prompt_format="plain", demonstrations=demonstrations)
