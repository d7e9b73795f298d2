"""The `ftis-engine` command's entry point: as light as can be, so that a Ctrl-C while torch and transformers are
still being imported is one line too. The folder the user stands in is never searched ahead of installed packages:
`python -m ftis_engine` puts it first on sys.path, and a `kernels/` or `datasets/` there would shadow the library
that transformers imports under that name; a reward module there is still found (rewards.load_reward looks in the
current directory after the installed modules, for that module alone)."""

from __future__ import annotations

import os
import sys

from .exits import INTERRUPTED


def drop_working_directory(path: list[str]) -> None:
    """Remove what `python -m` and `python -c` put first on sys.path (the working directory, as "" or its path).
    ftis_engine itself is imported already, and its modules are found through its package."""
    if path and path[0] in ("", os.getcwd()):
        del path[0]


def main(argv: list[str] | None = None) -> None:
    drop_working_directory(sys.path)
    try:
        from .cli import main as cli_main
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted while starting; nothing was written\n")
        sys.exit(INTERRUPTED)
    cli_main(argv)
