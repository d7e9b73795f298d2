"""Built-in tiny tasks with verifiable rewards: small enough for a randomly initialised tiny model to learn by RL
on a CPU in minutes. The answer is one digit; the reward is 1 when the completion begins with it.

- tiny-add:  "a+b=" -> (a + b) mod 10, single digits a, b. Train and eval both cover the 100 pairs.
- tiny-last: "d1d2...dk=" -> dk, the last digit before "=", k in 2..5. Eval: 200 held-out strings.
"""

from __future__ import annotations

import random

from ..rewards import tiny_answer_reward
from .base import Example, Task


def _add(rng: random.Random) -> Example:
    a, b = rng.randrange(10), rng.randrange(10)
    return Example(f"{a}+{b}=", str((a + b) % 10))


def _last(rng: random.Random) -> Example:
    digits = "".join(str(rng.randrange(10)) for _ in range(rng.randint(2, 5)))
    return Example(f"{digits}=", digits[-1])


TINY_TASKS = {"tiny-add": _add, "tiny-last": _last}
TRAIN_SIZE = 4096


def make_task(name: str, seed: int) -> Task:
    draw = TINY_TASKS[name]
    train_rng = random.Random(f"{name}-train-{seed}")
    train = [draw(train_rng) for _ in range(TRAIN_SIZE)]
    if name == "tiny-add":
        held_out = [Example(f"{a}+{b}=", str((a + b) % 10)) for a in range(10) for b in range(10)]
    else:
        seen = {e.question for e in train}
        eval_rng = random.Random(f"{name}-eval-{seed}")
        held_out = []
        while len(held_out) < 200:
            example = draw(eval_rng)
            if example.question not in seen:
                held_out.append(example)
                seen.add(example.question)
    return Task(name=name, train=train, evals={name: held_out}, reward=tiny_answer_reward, system_prompt=None,
                prompt_format="plain")
