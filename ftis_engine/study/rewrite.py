"""Write a finished study's report.md (and figures) again from its summary.json with this code; nothing is run:

    python -m ftis_engine.study.rewrite --config configs/study/paper.yaml --dir benchmarks/results/paper_study
"""

from __future__ import annotations

import argparse
import pathlib

from .config import load_study
from .report import rewrite_report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ftis_engine.study.rewrite", description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=pathlib.Path, required=True, help="the study's config (configs/study/*.yaml)")
    parser.add_argument("--dir", type=pathlib.Path, required=True, help="the study's directory (holds summary.json)")
    parser.add_argument("--no-figures", action="store_true", help="keep the figures as they are")
    args = parser.parse_args(argv)
    print(rewrite_report(load_study(args.config), args.dir, figures=not args.no_figures))


if __name__ == "__main__":
    main()
