"""The `ftis-engine` command's entry point: as light as can be, so that a Ctrl-C while torch and transformers are
still being imported is one line too, and the current directory is importable (a reward module beside the
config), as it is for `python -m ftis_engine`."""

from __future__ import annotations

import os
import sys

from .exits import INTERRUPTED


def main(argv: list[str] | None = None) -> None:
    if "" not in sys.path and os.getcwd() not in sys.path:  # what `python -m` puts first
        sys.path.insert(0, os.getcwd())
    try:
        from .cli import main as cli_main
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted while starting; nothing was written\n")
        sys.exit(INTERRUPTED)
    cli_main(argv)
