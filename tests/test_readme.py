"""The README's claims stay true: its Python example runs, and CI runs its test command."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_python_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert blocks, "README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    assert namespace["hidden"].grad is not None and namespace["lm_head"].weight.grad is not None
    assert bool(namespace["out"].loss.isfinite())


def test_the_set_up_section_holds_the_two_commands_ci_runs():
    """.ci/run builds a fresh venv and runs the commands of the 'Set up' section word for word: there must be
    exactly two, the install that runs the embedded default, then the tests."""
    setup = README.split("## Set up", 1)[1].split("\n## ", 1)[0]
    install, tests = (block.strip() for block in re.findall(r"```bash\n(.*?)```", setup, re.S))
    assert "-c constraints.txt" in install and install.endswith("ftis-engine train --config configs/tiny.yaml")
    assert tests.startswith("python -m pytest")
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert install in ci_lines and tests in ci_lines
    assert any("-m venv" in line for line in ci_lines)
    assert (ROOT / "constraints.txt").is_file()
