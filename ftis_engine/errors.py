"""How an exception is told in one line (the command line's errors are one line each)."""

from __future__ import annotations


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message (at most `limit` characters), or its type's name when it has none."""
    lines = str(exc).strip().splitlines()
    return lines[0][:limit] if lines else type(exc).__name__


def describe_load_error(exc: BaseException) -> str:
    """Why a file could not be loaded, for one line. torch.load(weights_only=True) refusing a pickle that holds more
    than tensors says so plainly: torch's own message suggests retrying with weights_only=False, the one thing not
    to do with a file from someone else."""
    import pickle

    if isinstance(exc, pickle.UnpicklingError):
        return ("UnpicklingError: it holds pickled objects other than tensors and plain values; refused unread "
                "(loading it would run code)")
    return f"{type(exc).__name__}: {first_line(exc)}"
