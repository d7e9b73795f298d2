"""What a task is: its examples, its reward, the scoring path every check uses, and how it fails."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..rewards import Reward, RewardTimeout

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
    reward: Reward
    system_prompt: str | None = SYSTEM_PROMPT
    prompt_format: str = "auto"  # auto | chat | plain
    # (style, count, seed) -> worked (question, completion) pairs for a warm start; None: the task has none
    demonstrations: Callable[[str, int, int], list[tuple[str, str]]] | None = None

    def score(self, tokenizer, completions: Sequence[Sequence[int]], examples: Sequence[Example],
              undecided: float | None = 0.0) -> list[float | None]:
        """The reward of each completion (token ids, special tokens dropped when decoding) against its example's
        gold answer. The one scoring path: generation, the receiver's re-score of a peer's rollouts and eval all
        use it, so a peer's claimed reward and the local re-score can never drift apart. A reward that times out
        (RewardTimeout) has no verdict and scores `undecided`: 0 for one's own completions and eval (it was not
        shown right), None for a receiver, which then cannot check the peer's claim."""
        ids = [c.tolist() if hasattr(c, "tolist") else list(c) for c in completions]
        texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
        rewards: list[float | None] = []
        for text, example in zip(texts, examples, strict=True):
            try:
                rewards.append(float(self.reward(text, example.answer)))
            except RewardTimeout:
                rewards.append(undecided)
        return rewards


class TaskError(ValueError):
    """A task, dataset or path that cannot be loaded; the message names the config field."""
