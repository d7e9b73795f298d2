"""GSM8K and MATH-500: from the HF hub by name, or from local JSONL files with the same fields."""

from __future__ import annotations

import pathlib

from ..rewards import binary_answer_reward
from . import Example, Task, TaskError

HUB = {
    # name: (hub dataset, config, split, question field, answer field)
    "gsm8k-train": ("openai/gsm8k", "main", "train", "question", "answer"),
    "gsm8k": ("openai/gsm8k", "main", "test", "question", "answer"),
    "math500": ("HuggingFaceH4/MATH-500", None, "test", "problem", "answer"),
}
MATH_TASKS = {
    # task: (training set, default eval sets)
    "gsm8k": ("gsm8k-train", ["gsm8k", "math500"]),
    "math500": ("math500", ["math500"]),
}


def gsm8k_gold(answer_field: str) -> str:
    """GSM8K's gold answer: the text after '####', commas removed."""
    if "####" not in answer_field:
        raise ValueError("a GSM8K answer must contain '####'")
    return answer_field.split("####")[-1].strip().replace(",", "")


def load_examples(name: str, path: str | None, field: str) -> list[Example]:
    """Examples of one dataset from a local JSONL file, or from the HF hub when no path is given."""
    import datasets

    hub_id, config, split, q_field, a_field = HUB[name]
    try:
        if path is not None:
            if not pathlib.Path(path).is_file():
                raise TaskError(f"{field}: no such file {path!r}")
            rows = datasets.load_dataset("json", data_files=str(path), split="train")
        else:
            rows = datasets.load_dataset(hub_id, config, split=split)
    except TaskError:
        raise
    except Exception as exc:  # datasets raises many types: offline, missing, schema...
        where = path or hub_id
        raise TaskError(f"{field}: cannot load {where!r}: {str(exc).splitlines()[0] if str(exc) else exc}") from None
    missing = [f for f in (q_field, a_field) if f not in rows.column_names]
    if missing:
        raise TaskError(f"{field}: {path or hub_id} has no field {missing[0]!r} (fields: {', '.join(rows.column_names)})")
    gold = gsm8k_gold if name.startswith("gsm8k") else (lambda a: str(a).strip())
    try:
        return [Example(str(r[q_field]), gold(str(r[a_field]))) for r in rows]
    except ValueError as exc:
        raise TaskError(f"{field}: {exc}") from None


def make_task(data, eval_datasets: list[str] | None) -> Task:
    train_name, default_evals = MATH_TASKS[data.task]
    train = load_examples(train_name, data.train_path, "data.train_path")
    evals = {}
    for name in eval_datasets or default_evals:
        if name not in HUB or name == "gsm8k-train":
            continue  # load_task reports unknown eval names
        evals[name] = load_examples(name, data.eval_paths.get(name), f"data.eval_paths.{name}")
    unknown_paths = set(data.eval_paths) - set(HUB)
    if unknown_paths:
        raise TaskError(f"data.eval_paths.{sorted(unknown_paths)[0]}: unknown dataset (known: gsm8k, math500)")
    return Task(name=data.task, train=train, evals=evals, reward=binary_answer_reward)
