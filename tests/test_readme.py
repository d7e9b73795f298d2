"""The README's claims stay true: its Python example runs, and CI runs its test command."""

from __future__ import annotations

import pathlib
import re

import pytest

from .helpers import ci_commands

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
    ci_lines = ci_commands()
    assert install in ci_lines and tests in ci_lines
    assert any("-m venv" in line for line in ci_lines)
    assert (ROOT / "constraints.txt").is_file()


def test_the_set_up_section_says_a_plain_torch_is_the_cuda_build_and_how_to_get_the_cpu_one():
    """A new user on an ordinary Linux machine followed the install line into a multi-GB CUDA torch: only the quick
    start said how to get the CPU build. The set-up section says it, with the index the quick start gives."""
    setup = " ".join(README.split("## Set up", 1)[1].split("\n## ", 1)[0].split())
    index = "--extra-index-url https://download.pytorch.org/whl/cpu"
    assert "`torch==2.13.0` from PyPI is the CUDA build" in setup and f"add `{index}` to the first command" in setup
    assert index in " ".join((ROOT / "docs" / "quickstart.md").read_text().split())
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text().split()


@pytest.mark.parametrize("workers", [pytest.param([], id="one-process", marks=pytest.mark.slow),
                                     pytest.param(["-n", "2"], id="xdist", marks=pytest.mark.integration)])
def test_the_test_sessions_cache_is_removed_when_it_ends_and_a_users_cache_is_kept(tmp_path, workers):
    """The README's test command leaves nothing behind: conftest gives a session its own FTIS_CACHE_DIR (a
    packaged model in it is half a gigabyte) and removes it when the session ends; a cache the user named stays.
    With pytest-xdist's workers (the README runs two) as in one process: one cache for the session, removed."""
    import getpass
    import os
    import subprocess
    import sys

    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "test_probe.py").write_text(
        "import os, pathlib\n\ndef test_probe():\n"
        "    cache = pathlib.Path(os.environ['FTIS_CACHE_DIR'])\n"
        "    (cache / 'kept').write_text(str(cache))\n"
        "    (pathlib.Path(__file__).parent / 'seen').write_text(str(cache))\n")
    temp, mine = tmp_path / "tmp", tmp_path / "mine"
    temp.mkdir(), mine.mkdir()
    for cache in (None, mine):
        env = {k: v for k, v in os.environ.items() if k != "FTIS_CACHE_DIR"}
        env.update(TMPDIR=str(temp), **({} if cache is None else {"FTIS_CACHE_DIR": str(cache)}))
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                              "-c", os.devnull, "--rootdir", str(probe), *workers, str(probe / "test_probe.py")],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr
        seen = pathlib.Path((probe / "seen").read_text())
        if cache is None:  # the session's own, made under TMPDIR, written to, and gone
            assert seen.parent == temp and seen.name.startswith("ftis-test-cache-") and not seen.exists()
    assert seen == mine and (mine / "kept").read_text() == str(mine)
    # only pytest's own numbered base folder, which pytest-xdist makes for its workers (pytest keeps the last three)
    left = [path for path in temp.rglob("*") if not (path.is_dir() and path.relative_to(temp).parts[0] == "pytest-of-"
                                                     + getpass.getuser())]
    assert left == []
