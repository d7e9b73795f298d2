"""Any dataset of questions and gold answers: task jsonl (local JSONL files) or hf (a dataset `datasets` can load:
a hub id, or a local directory of data files), with its own field names and a prompt template."""

from __future__ import annotations

import pathlib
import re

from ...core.errors import first_line
from ..rewards import binary_answer_reward
from .base import Example, Task, TaskError
from .math import _text, load_hf, read_jsonl


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
            # from None: a one-line error for the user; the cause adds nothing to it
            raise TaskError(f"{where(number)}: no field {exc.args[0]!r} (data.question_field / data.answer_field)"
                            ) from None
        except ValueError as exc:
            # from None: a one-line error for the user; the cause adds nothing to it
            raise TaskError(f"{where(number)}: {exc}") from None
    return examples


def _hf_rows(data, split: str, field: str) -> list[tuple[int, dict]]:
    check_local_files(data.path)
    rows = load_hf(data.path, data.subset, split, lambda exc: _load_error(data, split, field, exc))
    return list(enumerate(rows, start=1))


PARQUET_MARK = b"PAR1"  # a Parquet file begins and ends with it
DATA_SUFFIXES = (".parquet", ".arrow", ".jsonl", ".json", ".csv", ".tsv", ".txt")  # what datasets reads rows from


def check_local_files(path: str) -> None:
    """task hf on a local directory: each of its data files (DATA_SUFFIXES; names not starting with . or _, as
    `datasets` reads them) is not empty, and a .parquet file carries Parquet's marks at both ends; TaskError naming data.path and
    the file otherwise (datasets said 'Failed to read schema' in two lines that never named an empty file)."""
    folder = pathlib.Path(path)
    if not folder.is_dir():
        return
    for file in sorted(folder.rglob("*")):
        parts = file.relative_to(folder).parts
        if not file.is_file() or file.suffix not in DATA_SUFFIXES or any(p.startswith((".", "_")) for p in parts):
            continue
        size = file.stat().st_size
        if size == 0:
            raise TaskError(f"data.path: {file} is empty (0 bytes); remove it or write its rows")
        if file.suffix == ".parquet":
            with open(file, "rb") as handle:
                head = handle.read(4)
                handle.seek(max(0, size - 4))
                tail = handle.read(4)
            if size < 12 or head != PARQUET_MARK or tail != PARQUET_MARK:
                raise TaskError(f"data.path: {file} is not a Parquet file ({size} bytes without Parquet's PAR1 "
                                "marks at its start and end: cut short, or another format under a .parquet name)")


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
