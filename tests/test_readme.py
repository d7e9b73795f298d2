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


def test_ci_runs_the_readme_test_command():
    commands = [line.strip() for block in re.findall(r"```bash\n(.*?)```", README, re.S) for line in block.splitlines()]
    test_command = next(c for c in commands if "pytest" in c)
    assert test_command in (ROOT / ".ci" / "run").read_text()
