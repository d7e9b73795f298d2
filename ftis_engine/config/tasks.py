"""The built-in tasks by name and the data fields each reads: plain names, so the config checks a field against its
task without loading the tasks (data/tasks/ builds them; tests/test_tasks.py checks the two agree)."""

from __future__ import annotations

TINY_TASKS = ("tiny-add", "tiny-last")
MATH_TASKS = ("gsm8k", "math500", "gsm8k-calc")  # data/tasks/math.py's MATH_TASKS, in its order

# The data fields each kind of task reads, beyond those every task reads (task, system_prompt, prompt_format,
# reward, rewards, reward_timeout_s, max_prompt_tokens, shuffle). A field set away from its default for a task that
# does not read it is refused at load (config/schema.py), never silently unused.
_READS_FILES = {"train_path", "eval_paths"}
_READS_FIELDS = {"question_field", "answer_field", "prompt_template"}


def settings_read(task: str) -> set[str] | None:
    """The task-specific data fields `task` reads (None: an unknown task, reported by load_task)."""
    if task in TINY_TASKS or task == "arith":
        return set()
    if task in MATH_TASKS:
        return set(_READS_FILES)
    if task == "jsonl":
        return _READS_FILES | _READS_FIELDS
    if task == "hf":
        return {"path", "subset", "split", "eval_paths"} | _READS_FIELDS
    return None


def readers(field: str) -> str:
    """The tasks that read a data field, for the message that refuses it elsewhere."""
    kinds = [sorted(MATH_TASKS), ["jsonl"], ["hf"]]  # each group reads the same fields
    return ", ".join(", ".join(names) for names in kinds if field in settings_read(names[0]))
