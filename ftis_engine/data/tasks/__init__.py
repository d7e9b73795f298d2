"""Tasks: a training set, held-out eval sets, a reward, and how a question becomes a prompt."""

from __future__ import annotations

from ..rewards import WeightedReward, binary_answer_reward, load_reward, tiny_answer_reward
from . import arith, generic, tiny
from .base import SYSTEM_PROMPT, Example, RewardError, Task, TaskError


def load_task(data, seed: int, eval_datasets: list[str] | None = None, with_train: bool = True,
              eval_reward: str | None = None) -> Task:
    """Build the task named by `data.task` (a DataSettings), with its eval sets, its training reward (the task's,
    or data.reward / data.rewards) and its answer check for eval (the task's, or `eval_reward`: eval.reward).
    with_train=False (eval of a checkpoint): a task read from files leaves its training set unread (empty)."""
    from . import math as math_tasks  # each imports only .base: loaded when a task needs it

    if data.task in math_tasks.MATH_TASKS:  # the sets evaluated: a path for any other is read for nothing
        evaluated = eval_datasets or math_tasks.MATH_TASKS[data.task][1]
        given = [name for name in data.eval_paths if name in math_tasks.EVAL_SETS]  # others: unknown, said below
    else:
        evaluated = eval_datasets if eval_datasets is not None else list(data.eval_paths)
        given = list(data.eval_paths)
    # task math500 always reads MATH-500 (its problems are held out of the training file)
    unused = [name for name in given if name not in evaluated and (data.task, name) != ("math500", "math500")]
    if unused:
        raise TaskError(f"data.eval_paths.{unused[0]}: {unused[0]} is not evaluated (eval sets: "
                        f"{', '.join(evaluated) or 'none'}); drop the entry, or add {unused[0]} to eval.datasets")
    if data.task in tiny.TINY_TASKS:
        task = tiny.make_task(data.task, seed)
    elif data.task == "arith":
        task = arith.make_task(seed)
    elif data.task in math_tasks.MATH_TASKS:
        task = math_tasks.make_task(data, eval_datasets, with_train)
    elif data.task in ("jsonl", "hf"):
        task = generic.make_task(data, eval_datasets, with_train)
    else:
        known = ", ".join(sorted(set(tiny.TINY_TASKS) | set(math_tasks.MATH_TASKS) | {"arith", "jsonl", "hf"}))
        raise TaskError(f"data.task: unknown task {data.task!r}; expected one of {known}")
    if eval_datasets is not None:
        unknown = [name for name in eval_datasets if name not in task.evals]
        if unknown:
            raise TaskError(f"eval.datasets: unknown dataset {unknown[0]!r} for task {task.name} "
                            f"(available: {', '.join(task.evals)})")
        task.evals = {name: task.evals[name] for name in eval_datasets}
    task.reward_timeout_s = data.reward_timeout_s
    if data.system_prompt is not None:
        task.system_prompt = data.system_prompt
    if data.prompt_format != "auto":
        task.prompt_format = data.prompt_format
    # training rewards replace task.reward only: eval's answer check (task.check) stays the task's own
    if data.reward is not None:
        try:
            task.reward = load_reward(data.reward)
        except ValueError as exc:
            # from None: a one-line error for the user; the cause adds nothing to it
            raise TaskError(f"data.reward: {exc}") from None
    if data.rewards:
        terms = []
        for k, term in enumerate(data.rewards):
            try:
                terms.append((term.function, load_reward(term.function), term.weight))
            except ValueError as exc:
                # from None: a one-line error for the user; the cause adds nothing to it
                raise TaskError(f"data.rewards.{k}.function: {exc}") from None
        task.reward = WeightedReward(terms)
    if eval_reward is not None:
        try:
            task.check = load_reward(eval_reward)
        except ValueError as exc:
            # from None: a one-line error for the user; the cause adds nothing to it
            raise TaskError(f"eval.reward: {exc}") from None
    return task


def prompt_text(tokenizer, task: Task, question: str) -> str:
    """The prompt string for a question: the tokenizer's chat template (system + user) when the task's format is
    chat, or auto with a template available; else the system prompt and the question as plain text."""
    use_chat = task.prompt_format == "chat" or (task.prompt_format == "auto" and getattr(tokenizer, "chat_template", None))
    if use_chat:
        messages = [{"role": "user", "content": question}]
        if task.system_prompt:
            messages.insert(0, {"role": "system", "content": task.system_prompt})
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if task.system_prompt:
        return f"{task.system_prompt}\n\n{question}\n"
    return question


def prompt_ids(tokenizer, task: Task, question: str) -> list[int]:
    return tokenizer(prompt_text(tokenizer, task, question), add_special_tokens=False)["input_ids"]


__all__ = [
    "SYSTEM_PROMPT",
    "RewardError",
    "Example",
    "Task",
    "TaskError",
    "binary_answer_reward",
    "load_task",
    "prompt_ids",
    "prompt_text",
    "readers",
    "tiny_answer_reward",
]
