"""How an exception is told in one line (the command line's errors are one line each)."""

from __future__ import annotations


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message (at most `limit` characters), or its type's name when it has none."""
    lines = str(exc).strip().splitlines()
    return lines[0][:limit] if lines else type(exc).__name__
