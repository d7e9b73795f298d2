"""Reward functions: plain callables (completion: str, gold: str) -> float.

`binary_answer_reward` is the paper's reward (docs/algorithm.md, section 2). Others can be plugged in by module
(`data.reward: "my_module:my_reward"`) or by file (`data.reward: "path/to/my_rewards.py:my_reward"`).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import pathlib
import re
import sys
import threading
from collections.abc import Callable
from functools import partial

Reward = Callable[[str, str], float]

_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_FORMAT = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)


def extract_answer(completion: str) -> str | None:
    """The text inside <answer>...</answer> when the completion is exactly
    `<think>...</think><answer>...</answer>` (each tag once, in this order, nothing but white space around and
    between the two blocks, nothing after </answer>); else None."""
    if any(completion.count(tag) != 1 for tag in _TAGS):
        return None
    match = _FORMAT.fullmatch(completion)
    return match.group(2).strip() if match else None


def _timeout() -> int | None:
    # math-verify times out through SIGALRM, which only the main thread can use.
    return 5 if threading.current_thread() is threading.main_thread() else None


# LaTeX's math delimiter: a dollar sign not escaped by a backslash ("\$" is a currency sign; "\\$" a line break, then
# a delimiter)
_DELIMITER = re.compile(r"(?<!\\)(?:\\\\)*\$")


class RewardTimeout(Exception):
    """math-verify ran out of time on this answer: the reward has no verdict (neither 1 nor 0)."""


def _math_verify(call: Callable[[], object], timed_out: str, unreadable: object):
    """What a math-verify call returns, or `unreadable` when it raises on the text it was given (no expression, no
    comparison); RewardTimeout(timed_out) when it runs out of time: no verdict at all."""
    from math_verify.errors import TimeoutException

    try:
        return call()
    except TimeoutException as exc:
        raise RewardTimeout(timed_out) from exc
    except Exception:  # a catch-all, as it must be: math-verify runs a model's text (untrusted, any string) and the
        # gold through its LaTeX and expression parsers and sympy, which raise any type on text they cannot read or
        # compare; such text has no expression, and no answer is equal by it
        return unreadable


def _parse(text: str):
    from math_verify import parse

    # Bare answers ("18", "\frac{1}{2}") parse more reliably inside $...$ than as free text. An escaped dollar
    # ("\$18", a currency sign in MATH-500's golds) is no math delimiter: such text is wrapped too.
    candidates = [text] if _DELIMITER.search(text) or "\\boxed" in text else [f"${text}$", text]
    for candidate in candidates:
        parsed = _math_verify(partial(parse, candidate, parsing_timeout=_timeout(), raise_on_error=True),
                              f"parsing {candidate[:80]!r} timed out", [])
        if parsed:
            return parsed
    return []


def _normalise(text: str) -> str:
    return re.sub(r"\s+", "", text).removeprefix("$").removesuffix("$").rstrip(".")


def answers_match(answer: str, gold: str) -> bool:
    """math-verify equivalence of two answer strings (numbers, fractions, LaTeX expressions, tuples...), falling
    back to white-space-insensitive string equality when math-verify parses neither (e.g. text answers). Raises
    RewardTimeout when math-verify runs out of time (5 s in the main thread): no verdict, not a mismatch."""
    from math_verify import verify

    parsed_gold, parsed_answer = _parse(gold), _parse(answer)
    if parsed_gold and parsed_answer and _math_verify(
            partial(verify, parsed_gold, parsed_answer, timeout_seconds=_timeout(), raise_on_error=True),
            "comparing the answer with the gold timed out", False):
        return True
    return _normalise(answer) == _normalise(gold) and bool(_normalise(gold))


def binary_answer_reward(completion: str, gold: str) -> float:
    """1.0 when the completion is `<think>...</think><answer>...</answer>` and the answer equals the gold answer
    by math-verify; else 0.0. Raises RewardTimeout when math-verify runs out of time on it."""
    answer = extract_answer(completion)
    if answer is None or not answer:
        return 0.0
    return 1.0 if answers_match(answer, gold) else 0.0


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def final_answer_reward(completion: str, gold: str) -> float:
    """The paper's answer check without its format: 1.0 when the answer equals the gold answer by math-verify,
    the answer being the text of the last <answer>...</answer> block if the completion has one, else its last
    number (commas dropped); else 0.0. For models too small to keep the <think>/<answer> format from a prompt
    alone (SmolLM2-135M never did: benchmarks/results/real_models). Raises RewardTimeout like the paper's."""
    blocks = re.findall(r"<answer>(.*?)</answer>", completion, re.DOTALL)
    if blocks and blocks[-1].strip():
        answer = blocks[-1].strip()
    else:
        numbers = _NUMBER.findall(completion)
        if not numbers:
            return 0.0
        answer = numbers[-1].replace(",", "")
    return 1.0 if answers_match(answer, gold) else 0.0


def tiny_answer_reward(completion: str, gold: str) -> float:
    """Reward of the built-in tiny tasks: 1.0 when the completion begins with the gold answer
    (leading white space ignored); else 0.0."""
    return 1.0 if completion.lstrip().startswith(gold) else 0.0


def _load_by_path(name: str, file: pathlib.Path):
    """Import `file` (a module, or a package's __init__.py) as the module `name`, without touching sys.path."""
    package = file.name == "__init__.py"
    spec = importlib.util.spec_from_file_location(
        name, file, submodule_search_locations=[str(file.parent)] if package else None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs, as import does: a package's submodules import it back
    loaded = False
    try:
        spec.loader.exec_module(module)
        loaded = True
    finally:
        if not loaded:
            sys.modules.pop(name, None)
    return module


def _user_module(module_name: str):
    """`module_name` as an installed (or already importable) module first; else as a file or package of that name
    in the current directory. The current directory is searched last and for this name only, never put on sys.path:
    a folder where the user stands (`kernels/`, `datasets/`) cannot shadow a library."""
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:  # a file, by its path
        file = pathlib.Path(module_name)
        if not file.is_file():
            raise FileNotFoundError(f"no such file {module_name!r}")
        return _load_by_path(f"ftis_user_reward_{file.stem}", file.resolve())
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.split(".")[0]
        if exc.name != top:  # the module exists and failed to import something of its own
            raise
        here = pathlib.Path.cwd()
        for file in (here / top / "__init__.py", here / f"{top}.py"):
            if file.is_file():
                _load_by_path(top, file)
                return importlib.import_module(module_name)
        raise


def load_reward(path: str) -> Reward:
    """Import a reward callable from 'package.module:function' (or 'package.module.function'), the module installed
    or in the current directory, or from 'path/to/file.py:function'."""
    if ":" in path:
        module_name, _, attr = path.rpartition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"expected 'module:function' or 'file.py:function', got {path!r}")
    try:
        module = _user_module(module_name)
    except Exception as exc:  # a catch-all, as it must be: importing runs the user's module, which may raise any
        # type (not found, a syntax error, its own exception); the line names its type and message
        where = f" (line {exc.lineno})" if isinstance(exc, SyntaxError) and exc.lineno else ""
        # from None: a one-line error for the user, which names what the import raised (its type and message)
        raise ValueError(f"cannot import {module_name!r}: {type(exc).__name__}{where}: "
                         f"{' '.join(str(exc).split())[:200]}") from None
    reward = getattr(module, attr, None)
    if not callable(reward):
        raise ValueError(f"{path!r} is not a callable in {module_name}")
    try:
        inspect.signature(reward).bind("completion", "gold")
    except TypeError:
        # from None: a one-line error for the user; the cause adds nothing to it
        raise ValueError(f"{path!r} must take two arguments (completion, gold); its signature is "
                         f"{inspect.signature(reward)}") from None
    except ValueError:  # a callable without a signature (a builtin): called as it is
        pass
    return reward


def finite_number(value) -> bool:
    """What a reward function may return: a finite real number (bool, numpy scalars included; not NaN, inf, None,
    text or a tensor)."""
    return isinstance(value, numbers.Real) and math.isfinite(value)


class WeightedReward:
    """data.rewards: sum_k w_k f_k(completion, gold) (TRL's reward_funcs with reward_weights). Each term must give a
    finite number (ValueError naming the term otherwise). Task.score calls the terms itself, each bounded and named
    in its errors, and keeps their values on the sum it returns (WeightedValue.terms, for the log)."""

    def __init__(self, terms: list[tuple[str, Reward, float]]):
        self.terms = terms  # (name, function, weight)

    def values(self, completion: str, gold: str) -> list[float]:
        """Each term's value, in term order."""
        out = []
        for k, (name, function, _) in enumerate(self.terms):
            value = function(completion, gold)
            if not finite_number(value):
                raise ValueError(f"data.rewards.{k} ({name}) returned {value!r:.60}, not a finite number")
            out.append(float(value))
        return out

    def components(self, completion: str, gold: str) -> dict[str, float]:
        return {name: value for (name, _, _), value in zip(self.terms, self.values(completion, gold))}

    def __call__(self, completion: str, gold: str) -> float:
        return self.total(self.values(completion, gold))

    def total(self, values: list[float]) -> WeightedValue:
        """The weighted sum of the terms' values (in term order), carrying them by name."""
        return WeightedValue(sum(weight * value for (_, _, weight), value in zip(self.terms, values, strict=True)),
                             {name: value for (name, _, _), value in zip(self.terms, values)})


class WeightedValue(float):
    """A data.rewards sum (a float: it travels, trains and is logged as one) that keeps each term's value by
    function name in `terms`, recorded in the one scoring pass so the per-term means in the train records
    (reward/<function>) cost no second call."""

    terms: dict[str, float]

    def __new__(cls, total: float, terms: dict[str, float]):
        value = super().__new__(cls, total)
        value.terms = terms
        return value

    def __reduce__(self):  # pickled with its terms (a sharded member gathers its shards' rollouts)
        return (WeightedValue, (float(self), self.terms))
