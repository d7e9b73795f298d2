"""A reward for the real-model tier's one-step runs: SmolLM2 solves almost none of its first calculator prompts, so
the paper's reward would give every group the same 0 and the step no gradient; this one tells apart completions
that begin with the number from those that begin with words ("Sure! ..."), which SmolLM2 writes both of."""


def starts_with_a_number(completion: str, gold: str) -> float:
    return 1.0 if completion.lstrip()[:1].isdigit() else 0.0


def contains_a_digit(completion: str, gold: str) -> float:
    """The adversary tests' reward: a digit anywhere in the completion (a third of an untrained tiny model's
    4-token completions; a planted phrase keeps it)."""
    return 1.0 if any(c.isdigit() for c in completion) else 0.0
