"""GSM8K and MATH-500: from the HF hub by name, or from local JSONL files with the same fields."""

from __future__ import annotations

import json
import pathlib

from ..errors import first_line
from ..rewards import binary_answer_reward
from .base import Example, Task, TaskError

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


def read_jsonl(path: str, field: str, needed: tuple[str, ...]) -> list[tuple[int, dict]]:
    """(line number, row) of each row of a local JSONL file (one JSON object a line; blank lines skipped). Errors
    name the config field,
    the file and the line: a broken line, a row that is not an object or lacks a needed key, an empty file."""
    file = pathlib.Path(path)
    if not file.is_file():
        raise TaskError(f"{field}: no such file {path!r}")
    rows = []
    try:
        with file.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TaskError(f"{field}: {path} line {number} is not valid JSON ({exc.msg})") from None
                if not isinstance(row, dict):
                    raise TaskError(f"{field}: {path} line {number} is not a JSON object")
                missing = [k for k in needed if k not in row]
                if missing:
                    raise TaskError(f"{field}: {path} line {number} has no field {missing[0]!r} "
                                    f"(it has: {', '.join(row) or 'nothing'})")
                rows.append((number, row))
    except UnicodeDecodeError as exc:
        raise TaskError(f"{field}: {path} is not UTF-8 text ({exc.reason})") from None
    if not rows:
        raise TaskError(f"{field}: {path} holds no rows")
    return rows


def load_examples(name: str, path: str | None, field: str) -> list[Example]:
    """Examples of one dataset from a local JSONL file, or from the HF hub when no path is given."""
    hub_id, config, split, q_field, a_field = HUB[name]
    if path is not None:
        numbered = read_jsonl(path, field, (q_field, a_field))
    else:
        from ..models import hub_reachable

        hub_reachable()  # offline: fail at once from the cache instead of retrying
        import datasets

        datasets.disable_progress_bars()
        try:
            rows = datasets.load_dataset(hub_id, config, split=split)
        except Exception as exc:  # datasets raises many types: offline, missing, schema...
            raise TaskError(f"{field}: cannot load {hub_id!r} from the HF hub ({first_line(exc)}); give a local copy with "
                            f"{field}") from None
        missing = [f for f in (q_field, a_field) if f not in rows.column_names]
        if missing:
            raise TaskError(f"{field}: {hub_id} has no field {missing[0]!r} (fields: {', '.join(rows.column_names)})")
        numbered = list(enumerate(rows, start=1))
    gold = gsm8k_gold if name.startswith("gsm8k") else (lambda a: str(a).strip())
    examples = []
    for number, row in numbered:
        try:
            examples.append(Example(str(row[q_field]), gold(str(row[a_field]))))
        except ValueError as exc:
            where = f"{path} line {number}" if path is not None else f"{hub_id} row {number}"
            raise TaskError(f"{field}: {where}: {exc}") from None
    return examples


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
