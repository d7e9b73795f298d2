"""Every write this package makes to its own process's environment (tests/test_layout_rules.py refuses one anywhere
else). A variable that a library reads during one call is set around that call and put back after it (set_env); the
few that must hold for the rest of the process go through set_for_process, whose callers say why. Building a child's
environment (a dict given to subprocess as env=) writes nothing here and does not come through this module."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def set_env(**values: str) -> Iterator[None]:
    """Set each variable (a str) for the block; leaving it, an exception included, puts each back as it was: its old
    value, or unset where it was unset. What the block itself does to other variables is left as it is."""
    before = {name: os.environ.get(name) for name in values}
    try:
        os.environ.update(values)  # inside the try: a value that is not a str leaves nothing half-written
        yield
    finally:
        for name, old in before.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def set_for_process(**values: str) -> None:
    """Set each variable (a str) for the rest of this process and every process it starts: for a library that reads
    it at import, or at each of many later calls that no one block holds. Each caller says why in a comment."""
    os.environ.update(values)
