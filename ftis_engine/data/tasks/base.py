"""What a task is: its examples, its reward, the scoring path every check uses, and how it fails."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...core.limits import MAX_REWARD
from ..rewards import Reward, RewardTimeout, WeightedReward, finite_number

# The <think>/<answer> instruction (R1 style) that goes with binary_answer_reward's format.
SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The Assistant first thinks about the reasoning process in the mind and then provides the user with the answer. "
    "The reasoning process and answer are enclosed within <think> </think> and <answer> </answer> tags, "
    "respectively, i.e., <think> reasoning process here </think><answer> answer here </answer>."
)


@dataclass(frozen=True)
class Example:
    question: str
    answer: str  # the gold answer the reward compares with


@dataclass
class Task:
    name: str
    train: list[Example]
    evals: dict[str, list[Example]]
    reward: Reward  # what training scores: the task's own, or data.reward / data.rewards
    system_prompt: str | None = SYSTEM_PROMPT
    prompt_format: str = "auto"  # auto | chat | plain
    # (style, count, seed) -> worked (question, completion) pairs for a warm start; None: the task has none
    demonstrations: Callable[[str, int, int], list[tuple[str, str]]] | None = None
    reward_timeout_s: float | None = None  # data.reward_timeout_s: one reward call's bound (None: unbounded)
    # whether an answer is right (1) or not (0), for eval's greedy pass@1: the task's own check (default: its
    # reward as built), or eval.reward; never data.reward / data.rewards, which may weigh format or partial credit
    check: Reward | None = None

    def __post_init__(self):
        if self.check is None:
            self.check = self.reward

    def score(self, tokenizer, completions: Sequence[Sequence[int]], examples: Sequence[Example],
              undecided: float | None = 0.0) -> list[float | None]:
        """The reward of each completion (token ids, special tokens dropped when decoding) against its example's
        gold answer. The one scoring path: generation, the receiver's re-score of a peer's rollouts (and eval,
        through `solved`) use it, so a peer's claimed reward and the local re-score can never drift apart. A
        reward that times out (RewardTimeout) has no verdict and scores `undecided`: 0 for one's own completions,
        None for a receiver, which then cannot check the peer's claim. Under data.rewards each value is a
        WeightedValue that carries its terms' values (for the train records' reward/<function>)."""
        texts = _decode(tokenizer, completions)
        rewards: list[float | None] = []
        for text, example in zip(texts, examples, strict=True):
            try:
                rewards.append(self.call_reward(text, example.answer))
            except RewardTimeout:
                rewards.append(undecided)
        return rewards

    def solved(self, tokenizer, completions: Sequence[Sequence[int]], examples: Sequence[Example]) -> list[bool]:
        """Whether each completion's answer is right by the task's answer check (`check`: 1 right, 0 wrong), which
        eval's greedy pass@1 counts: whatever training rewards (data.reward, data.rewards' weights and format
        terms) add, a pass means the answer is right. A check that times out is no pass (not shown right)."""
        texts = _decode(tokenizer, completions)
        passes = []
        for text, example in zip(texts, examples, strict=True):
            try:
                value = _call([("eval.reward", _name(self.check), self.check)], text, example.answer,
                              self.reward_timeout_s)[0]
            except RewardTimeout:
                value = 0.0
            passes.append(value >= 1.0)
        return passes

    def call_reward(self, text: str, gold: str) -> float:
        """The reward of one completion as a float. A reward that raises (anything but RewardTimeout) or returns
        anything but a finite real number (NaN, inf, None, a string, a tensor) stops here with RewardError naming
        the field (data.reward, or the term: data.rewards.<k>), the function, what it did and the completion,
        before a NaN can reach the loss."""
        if isinstance(self.reward, WeightedReward):
            terms = [(f"data.rewards.{k}", name, function) for k, (name, function, _) in enumerate(self.reward.terms)]
            total = self.reward.total(_call(terms, text, gold, self.reward_timeout_s))
            if not abs(total) <= MAX_REWARD:  # inf too: two weights of 1e308
                raise RewardError(f"data.rewards: the weighted sum of {_call_text('the terms', text, gold)} is "
                                  f"{float(total):g}; a reward is within +-{MAX_REWARD:g} (lower the weights: group "
                                  "advantages do not depend on the rewards' scale)")
            return total
        return _call([("data.reward", _name(self.reward), self.reward)], text, gold, self.reward_timeout_s)[0]


def _decode(tokenizer, completions: Sequence[Sequence[int]]) -> list[str]:
    ids = [c.tolist() if hasattr(c, "tolist") else list(c) for c in completions]
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def _name(function: Reward) -> str:
    return f"{getattr(function, '__module__', '?')}:{getattr(function, '__qualname__', repr(function))}"


def _call(terms: list[tuple[str, str, Reward]], text: str, gold: str, timeout_s: float | None) -> list[float]:
    """Each (field, name, function) term's value on one completion, in order, all within one bound of `timeout_s`
    seconds (None: unbounded). RewardTimeout (math-verify's: no verdict) passes through; a term that raises, runs
    past the bound or returns anything but a finite real number raises RewardError naming its field and function
    and the completion."""
    values: list[float] = []
    field, name = terms[0][:2]
    try:
        with _deadline(timeout_s):
            for field, name, function in terms:
                value = function(text, gold)
                if not finite_number(value):
                    raise RewardError(f"{field}: {_call_text(name, text, gold)} returned {_clip(repr(value))} "
                                      f"({type(value).__name__}); a reward is a finite number")
                if abs(value) > MAX_REWARD:
                    raise RewardError(f"{field}: {_call_text(name, text, gold)} returned {float(value):g}; a reward "
                                      f"is within +-{MAX_REWARD:g} (group advantages do not depend on its scale)")
                values.append(float(value))
    except (RewardTimeout, RewardError):
        raise
    except _Overdue:
        # from None: its cause is this module's own alarm (_Overdue), not the reward's
        raise RewardError(f"{field}: {_call_text(name, text, gold)} did not return within {timeout_s:g} s "
                          "(data.reward_timeout_s); fix the reward, or raise the bound") from None
    except Exception as exc:  # a catch-all, as it must be: the user's reward code may raise any type; its line names
        # the field, the function, the completion and what it raised
        message = " ".join(str(exc).split())[:200]
        # from None: a one-line error for the user, which names what the reward raised (its type and message)
        raise RewardError(f"{field}: {_call_text(name, text, gold)} raised {type(exc).__name__}"
                          + (f": {message}" if message else "")) from None
    return values


def _call_text(name: str, text: str, gold: str) -> str:
    return f"{name}({_clip(text)!r}, {_clip(gold)!r})"


class _Overdue(BaseException):
    """A reward call ran past data.reward_timeout_s. A BaseException: a reward that catches every Exception of its
    own cannot swallow it."""


_armed = threading.Event()  # set while a bounded reward call runs on the main thread
_ALARM = getattr(signal, "SIGUSR2", None)  # not SIGALRM: math-verify's own time-outs use that timer
_installed = False


def _on_alarm(signum, frame):
    if _armed.is_set():  # a signal that arrives after the call returned does nothing
        _armed.clear()
        raise _Overdue


@contextlib.contextmanager
def _deadline(seconds: float | None):
    """Interrupt the block after `seconds`: a watchdog thread signals the main thread, whose handler raises
    _Overdue at the next bytecode (a sleep or socket wait is interrupted too). Only on the main thread (where
    Python runs signal handlers, and where every score is taken); elsewhere, or without the signal, unbounded.
    The handler stays installed for the process: a late signal finds it, disarmed, and does nothing."""
    global _installed
    if seconds is None or _ALARM is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    if not _installed:
        signal.signal(_ALARM, _on_alarm)
        _installed = True
    main = threading.main_thread().ident
    lock = threading.Lock()

    def fire():
        with lock:
            if _armed.is_set():
                signal.pthread_kill(main, _ALARM)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    _armed.set()
    timer.start()
    try:
        yield
    finally:
        with lock:
            _armed.clear()
        timer.cancel()


class TaskError(ValueError):
    """A task, dataset or path that cannot be loaded; the message names the config field."""


class RewardError(TaskError):
    """A reward function that raised or returned something other than a finite number (data.reward)."""


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
