"""GSM8K and MATH-500: from the HF hub by name, or from local JSONL files with the same fields; and gsm8k-calc, the
calculator steps inside GSM8K's solutions (a real task short enough for small models on a CPU)."""

from __future__ import annotations

import json
import math
import pathlib
import random
import re
from collections.abc import Callable

from ...core.errors import first_line
from ...core.hub import hub_reachable
from ..rewards import binary_answer_reward, final_answer_reward
from .base import Example, Task, TaskError

HUB = {
    # name: (hub dataset, config, split, question field, answer field)
    "gsm8k-train": ("openai/gsm8k", "main", "train", "question", "answer"),
    "gsm8k": ("openai/gsm8k", "main", "test", "question", "answer"),
    "gsm8k-calc": ("openai/gsm8k", "main", "test", "question", "answer"),  # its calculator steps (calculator_steps)
    "math500": ("HuggingFaceH4/MATH-500", None, "test", "problem", "answer"),
}
MATH_TASKS = {
    # task: (training set, default eval sets). math500 has no training split of its own: it trains on the file
    # data.train_path names (config/schema.py requires it), never on the 500 problems it is evaluated on.
    "gsm8k": ("gsm8k-train", ["gsm8k", "math500"]),
    "math500": ("math500", ["math500"]),
    "gsm8k-calc": ("gsm8k-train", ["gsm8k-calc"]),
}
EVAL_SETS = tuple(name for name in HUB if name != "gsm8k-train")


def gsm8k_gold(answer_field: str) -> str:
    """GSM8K's gold answer: the text after '####', commas removed."""
    if "####" not in answer_field:
        raise ValueError("a GSM8K answer must contain '####'")
    return answer_field.split("####")[-1].strip().replace(",", "")


def read_jsonl(path: str, field: str, needed: tuple[str, ...]) -> list[tuple[int, dict]]:
    """(line number, row) of each row of a local JSONL file (UTF-8, with or without a byte-order mark; one JSON
    object a line; blank lines skipped). Errors name the config field, the file and the line: a broken line, a row
    that is not an object or lacks a needed key, an empty file."""
    file = pathlib.Path(path)
    if not file.is_file():
        raise TaskError(f"{field}: no such file {path!r}")
    rows = []
    try:
        with file.open("rb") as handle:  # decoded a line at a time: a byte that is not UTF-8 is named by its line
            for number, raw in enumerate(handle, start=1):
                try:  # a byte-order mark some editors write is no part of line 1
                    line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
                except UnicodeDecodeError as exc:
                    # from None: a one-line error for the user; the cause adds nothing to it
                    raise TaskError(f"{field}: {path} line {number} is not UTF-8 text ({exc.reason}: "
                                    f"{raw[exc.start]:#04x} at byte {exc.start + 1} of the line)") from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    # from None: a one-line error for the user; the cause adds nothing to it
                    raise TaskError(f"{field}: {path} line {number} is not valid JSON ({exc.msg})") from None
                except RecursionError:
                    # from None: a one-line error for the user; the cause adds nothing to it
                    raise TaskError(f"{field}: {path} line {number} is nested too deep to read") from None
                if not isinstance(row, dict):
                    raise TaskError(f"{field}: {path} line {number} is not a JSON object")
                missing = [k for k in needed if k not in row]
                if missing:
                    raise TaskError(f"{field}: {path} line {number} has no field {missing[0]!r} "
                                    f"(it has: {', '.join(row) or 'nothing'})")
                rows.append((number, row))
    except OSError as exc:  # no permission, or a file that cannot be read as one (/proc/self/mem)
        # from None: a one-line error for the user; the cause adds nothing to it
        raise TaskError(f"{field}: cannot read {path} ({exc.strerror or type(exc).__name__})") from None
    if not rows:
        raise TaskError(f"{field}: {path} holds no rows")
    return rows


def load_hf(path: str, subset: str | None, split: str, problem: Callable[[Exception], str]):
    """The split of a dataset `datasets` loads (a hub id, or a local directory of data files), quietly: no progress
    bars, none of its own log lines before ours; TaskError(problem(exc)) when it cannot be loaded."""
    hub_reachable()  # offline: fail at once from the cache or a local directory instead of retrying
    import datasets

    datasets.disable_progress_bars()
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its ERROR lines would come before ours, unasked
    try:
        return datasets.load_dataset(path, subset, split=split)
    except Exception as exc:  # a catch-all, as it must be: load_dataset runs fetching, resolving configs and
        # splits and every file format's reader, which raise any type for a dataset that is offline, missing or
        # malformed (FileNotFoundError, ValueError, ConnectionError, pyarrow's and the hub's own); the user's line
        # names the setting at fault and quotes it
        # from None: a one-line error for the user; the cause adds nothing to it
        raise TaskError(problem(exc)) from None
    finally:
        datasets.logging.set_verbosity(verbosity)


def load_rows(name: str, path: str | None, field: str) -> list[tuple[int, dict]]:
    """(line or row number, row) of one dataset from a local JSONL file, or from the HF hub when no path is given."""
    hub_id, config, split, q_field, a_field = HUB[name]
    if path is not None:
        numbered = read_jsonl(path, field, (q_field, a_field))
    else:
        rows = load_hf(hub_id, config, split, lambda exc: f"{field}: cannot load {hub_id!r} from the HF hub "
                                                          f"({first_line(exc)}); give a local copy with {field}")
        missing = [f for f in (q_field, a_field) if f not in rows.column_names]
        if missing:
            raise TaskError(f"{field}: {hub_id} has no field {missing[0]!r} (fields: {', '.join(rows.column_names)})")
        numbered = list(enumerate(rows, start=1))
    return numbered


def load_examples(name: str, path: str | None, field: str) -> list[Example]:
    """Examples of one dataset from a local JSONL file, or from the HF hub when no path is given."""
    hub_id, _, _, q_field, a_field = HUB[name]
    numbered = load_rows(name, path, field)
    gold = gsm8k_gold if name.startswith("gsm8k") else (lambda a: str(a).strip())
    examples = []
    for number, row in numbered:
        try:
            question = _text(row[q_field], q_field)
            examples.append(Example(question, gold(_text(row[a_field], a_field, numbers=True))))
        except ValueError as exc:
            where = f"{path} line {number}" if path is not None else f"{hub_id} row {number}"
            # from None: a one-line error for the user; the cause adds nothing to it
            raise TaskError(f"{field}: {where}: {exc}") from None
    return examples


def _text(value, name: str, numbers: bool = False) -> str:
    """A row's field as text: a non-empty string that UTF-8 can hold (or, for an answer, a finite number). null,
    NaN, a list or an empty string would otherwise train and evaluate as the text "None" or "nan"; a lone surrogate
    (JSON's "\\ud800" without its pair) reached the tokenizer, which raised TypeError."""
    if isinstance(value, str) and value.strip():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            # from None: a one-line error for the user; the cause adds nothing to it
            raise ValueError(f"its {name!r} holds {value[exc.start]!r} at character {exc.start + 1}: a lone surrogate "
                             "(a JSON \\ud800-\\udfff escape without its pair), which no text or tokenizer holds"
                             ) from None
        return value
    if numbers and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return str(value)
    raise ValueError(f"its {name!r} is {_described(value)}, not {'a number or ' if numbers else ''}text")


def _described(value) -> str:
    """A field's value in an error, at most 40 characters: as JSON writes it, or (bytes from a binary column, any
    other type JSON has no form for) its type and its start."""
    try:
        return json.dumps(value)[:40]
    except (TypeError, ValueError):
        return f"{type(value).__name__} {repr(value)[:40]}"


# GSM8K's worked solutions mark each arithmetic step for a calculator: "<<16-3-4=9>>9".
CALCULATOR_STEP = re.compile(r"<<([^=<>]+)=([^<>]+)>>")
CALC_SYSTEM_PROMPT = "You are a calculator. Reply with the result only."


def calculator_steps(numbered: list[tuple[int, dict]]) -> list[Example]:
    """gsm8k-calc: the distinct calculator steps of GSM8K's solutions with one or two operations (+ - * /) on plain
    numbers and a whole-number result, as "Compute 16-3-4." -> "9", in a fixed shuffled order. A real task short
    enough for 0.1-0.5 B models on a CPU (benchmarks/results/real_models): SmolLM2-135M-Instruct starts near 5%,
    Qwen2.5-Coder-0.5B-Instruct near 50%, where on GSM8K itself both score about 0 in 256 tokens."""
    seen, examples = set(), []
    for _, row in numbered:
        for expression, _ in CALCULATOR_STEP.findall(str(row["answer"])):
            expression = expression.strip()
            operations = len(re.findall(r"(?<=[\d.)])\s*[-+*/]", expression))
            if expression in seen or not 1 <= operations <= 2 or not re.fullmatch(r"[\d.+\-*/() ]+", expression):
                continue
            value = _evaluate(expression)
            if value is None or value != int(value) or abs(value) > 1e6:
                continue
            seen.add(expression)
            examples.append(Example(f"Compute {expression}.", str(int(value))))
    random.Random(0).shuffle(examples)
    return examples


def _evaluate(expression: str) -> float | None:
    """The value of a + - * / ( ) expression over plain numbers (ast, no eval), None when it has none."""
    import ast
    import operator

    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.USub: operator.neg}

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.operand))
        raise ValueError(expression)

    try:
        return round(value(ast.parse(expression, mode="eval").body), 9)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, OverflowError):
        return None


def _calc_train_or_none(data) -> list[Example]:
    """gsm8k-calc's training steps for an eval that reads no training set, only to leave them out of the eval set
    as training did; when they cannot be read, the eval set stays whole (said)."""
    import logging

    try:
        return calculator_steps(load_rows("gsm8k-train", data.train_path, "data.train_path"))
    except TaskError as exc:
        logging.getLogger("ftis_engine").warning("gsm8k-calc: the training steps cannot be read (%s), so the eval "
                                                 "set keeps the steps that also occur in training", exc)
        return []


def _held_out(train: list[Example], evaluated: list[Example], path: str | None) -> list[Example]:
    """The training examples without MATH-500's eval problems (a training file cut from MATH's test split holds
    them: said, and left out); none left is an error naming data.train_path."""
    held = {ex.question.strip() for ex in evaluated}
    kept = [ex for ex in train if ex.question.strip() not in held]
    if train and not kept:
        raise TaskError(f"data.train_path: every problem of {path} is a MATH-500 eval problem; train on other "
                        "problems (e.g. MATH's train split), or evaluate on other sets (eval.datasets)")
    if len(kept) < len(train):
        import logging

        logging.getLogger("ftis_engine").warning("data.train_path: %d of the %d problems of %s are MATH-500 eval "
                                                 "problems; they are left out of the training set",
                                                 len(train) - len(kept), len(train), path)
    return kept


def make_task(data, eval_datasets: list[str] | None, with_train: bool = True) -> Task:
    train_name, default_evals = MATH_TASKS[data.task]
    calc = data.task == "gsm8k-calc"
    unknown_paths = set(data.eval_paths) - set(EVAL_SETS)
    if unknown_paths:  # before anything is read
        raise TaskError(f"data.eval_paths.{sorted(unknown_paths)[0]}: unknown dataset (known: "
                        f"{', '.join(EVAL_SETS)})")
    if not with_train:  # an eval of a checkpoint reads only the eval sets
        train = []
    elif calc:
        train = calculator_steps(load_rows(train_name, data.train_path, "data.train_path"))
    else:
        train = load_examples(train_name, data.train_path, "data.train_path")
    evals = {}
    for name in eval_datasets or default_evals:
        if name not in HUB or name == "gsm8k-train":
            continue  # load_task reports unknown eval names
        field = f"data.eval_paths.{name}"
        if name == "gsm8k-calc":  # held out: a step that also occurs in a training solution is left out
            trained = {ex.question for ex in (train if with_train or not calc else _calc_train_or_none(data))}
            evals[name] = [ex for ex in calculator_steps(load_rows(name, data.eval_paths.get(name), field))
                           if ex.question not in trained]
        else:
            evals[name] = load_examples(name, data.eval_paths.get(name), field)
    if data.task == "math500" and with_train:  # MATH-500's problems never train, evaluated this run or not (a
        # resume that changes eval.datasets must not change the training set)
        held = evals.get("math500") or load_examples("math500", data.eval_paths.get("math500"),
                                                     "data.eval_paths.math500")
        train = _held_out(train, held, data.train_path)
    if calc:
        return Task(name=data.task, train=train, evals=evals, reward=final_answer_reward,
                    system_prompt=CALC_SYSTEM_PROMPT)
    return Task(name=data.task, train=train, evals=evals, reward=binary_answer_reward)
