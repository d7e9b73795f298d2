"""Any dataset of questions and gold answers: task jsonl (local JSONL files) or hf (a dataset `datasets` can load:
a hub id, or a local directory of data files), with its own field names and a prompt template."""

from __future__ import annotations

import re

from ..errors import first_line
from ..rewards import binary_answer_reward
from .base import Example, Task, TaskError
from .math import _text, read_jsonl


def _gold(answer: str) -> str:
    """The gold answer: a GSM8K-style solution is cut to what follows its last '####'."""
    return answer.split("####")[-1].strip().replace(",", "") if "####" in answer else answer.strip()


def _examples(rows, data, where) -> list[Example]:
    examples = []
    for number, row in rows:
        try:
            question = data.prompt_template.format(question=_text(row[data.question_field], data.question_field))
            examples.append(Example(question, _gold(_text(row[data.answer_field], data.answer_field, numbers=True))))
        except KeyError as exc:
            raise TaskError(f"{where(number)}: no field {exc.args[0]!r} (data.question_field / data.answer_field)"
                            ) from None
        except ValueError as exc:
            raise TaskError(f"{where(number)}: {exc}") from None
    return examples


def _hf_rows(data, split: str, field: str) -> list[tuple[int, dict]]:
    from ..hub import hub_reachable

    hub_reachable()  # offline: at once from the cache or a local directory
    import datasets

    datasets.disable_progress_bars()
    try:
        rows = datasets.load_dataset(data.path, data.subset, split=split)
    except Exception as exc:  # datasets raises many types: offline, missing, schema, unknown config or split...
        raise TaskError(_load_error(data, split, field, exc)) from None
    return list(enumerate(rows, start=1))


def _load_error(data, split: str, field: str, exc: Exception) -> str:
    """One line for a dataset `datasets` could not load, led by the setting at fault: the config (data.subset:
    missing for a dataset with several, or not one of them), the split (`field`: data.split or an eval_paths
    entry), else the dataset itself (data.path)."""
    text = " ".join(str(exc).split())
    what = f"{data.path!r}" + (f" config {data.subset!r} (data.subset)" if data.subset is not None else "") + \
        f" split {split!r} ({field})"
    available = re.search(r"[Aa]vailable(?: configs)?: (\[[^\]]*\])", text)
    if "Config name is missing" in text:
        return (f"data.subset: {data.path!r} has several configs and data.subset names none"
                + (f"; name one of {available.group(1)}" if available else ""))
    if "BuilderConfig" in text and "not found" in text:
        return f"data.subset: {data.path!r} has no config {data.subset!r}" + (
            f" (it has {available.group(1)})" if available else "")
    lead = field if "Unknown split" in text else "data.path"
    return f"{lead}: cannot load {what}: {first_line(exc)}"


def make_task(data, eval_datasets: list[str] | None, with_train: bool = True) -> Task:
    needed = (data.question_field, data.answer_field)
    if data.task == "jsonl":
        if data.train_path is None and with_train:
            raise TaskError("data.train_path: task jsonl reads its training set from a JSONL file; give its path")
        train = _examples(read_jsonl(data.train_path, "data.train_path", needed), data,
                          lambda n: f"data.train_path: {data.train_path} line {n}") if with_train else []
        evals = {name: _examples(read_jsonl(path, f"data.eval_paths.{name}", needed), data,
                                 lambda n, name=name, path=path: f"data.eval_paths.{name}: {path} line {n}")
                 for name, path in data.eval_paths.items()}
    else:  # hf
        if data.path is None:
            raise TaskError("data.path: task hf needs the dataset (a hub id or a local directory)")
        train = _examples(_hf_rows(data, data.split, "data.split"), data,
                          lambda n: f"data.path: {data.path} {data.split} row {n}") if with_train else []
        evals = {name: _examples(_hf_rows(data, split, f"data.eval_paths.{name}"), data,
                                 lambda n, split=split: f"data.path: {data.path} {split} row {n}")
                 for name, split in data.eval_paths.items()}
    return Task(name=data.task, train=train, evals=evals, reward=binary_answer_reward)
