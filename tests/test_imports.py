"""The package's shape: no module of ftis_engine imports, directly or through others, a module that imports it
back (imports inside functions count too: they are cycles that merely run later; and so do imports for type
checking only: to a reader, and to a type checker, the two modules still depend on each other). Its packages import
downward only, config/ reaches nothing of the runtime, and loading a config loads no torch."""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "ftis_engine"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, name: str, known: set[str]) -> set[str]:
    """The ftis_engine modules `path` imports, wherever the import statement stands."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("ftis_engine")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if not base.startswith("ftis_engine"):
                continue
            for alias in node.names:  # `from . import sample` imports a module; `from .x import f` imports x
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in known else base)
    # importing a.b.c runs a/b/__init__.py first: an edge to each enclosing package (but not to the importer's own,
    # which is being imported already when the importer runs)
    found |= {".".join(m.split(".")[:k]) for m in found for k in range(2, m.count(".") + 1)}
    return {m for m in found if m in known and m != name and not name.startswith(m + ".")}


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    known = set(paths)
    return {name: _imports(path, name, known) for name, path in paths.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_an_import_for_type_checking_only_is_an_edge_of_the_graph(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n")
    known = {"ftis_engine.pkg.a", "ftis_engine.pkg.b", "ftis_engine.pkg"}
    assert _imports(tmp_path / "pkg" / "a.py", "ftis_engine.pkg.a", known) == {"ftis_engine.pkg.b"}


def test_no_import_cycle_in_ftis_engine():
    graph = _graph()
    assert "ftis_engine.run.step" in graph and "ftis_engine.run.session" in graph["ftis_engine.run.step"]
    # `from .tasks import arith` in models.py runs tasks/__init__.py, which imports every task module
    assert {"ftis_engine.data.tasks", "ftis_engine.data.tasks.arith"} <= graph["ftis_engine.model.models"]
    assert "ftis_engine.config.schema" not in graph["ftis_engine.config.checks"]  # issue 76: the two were a cycle
    assert _cycles(graph) == []


# ftis_engine's packages from the top down (docs/architecture.md draws them): a module imports only modules of its
# own package or of a package below it, imports inside functions and for type checking counted. The two files at
# the root are the package's own (`__init__`: its version) and `python -m ftis_engine` (`__main__`: the console).
LAYERS = ("app", "study", "run", "member", "openswarm", "exchange", "generation", "model", "report", "topology", "data",
          "config", "core")
ROOT_FILES = {"ftis_engine", "ftis_engine.__main__"}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def _upward(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for module, imported in sorted(graph.items()):
        here = _layer(module)
        for target in sorted(imported):
            there = _layer(target)
            if here is not None and there is not None and LAYERS.index(there) < LAYERS.index(here):
                out.append(f"{module} -> {target}")
    return out


def test_the_direction_checker_refuses_an_import_of_a_package_above():
    graph = {"ftis_engine.core.errors": {"ftis_engine.run.step"}, "ftis_engine.run.step": {"ftis_engine.core.errors"}}
    assert _upward(graph) == ["ftis_engine.core.errors -> ftis_engine.run.step"]


def test_every_module_of_ftis_engine_lives_in_a_package_of_the_layers_and_imports_only_downward():
    graph = _graph()
    assert sorted(m for m in graph if _layer(m) is None and m not in ROOT_FILES) == []
    assert sorted(m.split(".")[1] for m in graph if m.count(".") == 1 and m not in ROOT_FILES) == sorted(LAYERS)
    assert _upward(graph) == []


def test_the_config_reaches_nothing_of_the_runtime():
    """config/ is a leaf: loading and checking a config reaches none of the engine's runtime, through any chain of
    imports (the constants it shares with the runtime live in core/limits.py and config/tasks.py)."""
    graph = _graph()
    reached, todo = set(), ["ftis_engine.config"]
    while todo:
        for target in graph[todo.pop()] - reached:
            reached.add(target)
            todo.append(target)
    assert "ftis_engine.config.tasks" in reached and "ftis_engine.core.limits" in reached
    assert sorted(m for m in reached if _layer(m) not in ("config", "core")) == []
    assert sorted(m for m in reached if _layer(m) == "core") == ["ftis_engine.core", "ftis_engine.core.limits",
                                                                         "ftis_engine.core.safefile"]


# a fresh interpreter reads and checks a real config, and the loss's options as a user imports them, then names the
# torch modules it has loaded
_CONFIG_ONLY = """
import sys
from ftis_engine.app.cli import main
from ftis_engine.config import load_config
from ftis_kernels import METHODS, LossConfig
load_config(sys.argv[1])
assert LossConfig(method=METHODS[0]).method == "nois"
try:
    main(["train", "--config", sys.argv[1], "--set", "members.0.lr=abc"])
except SystemExit as exc:
    assert exc.code == 2, exc.code
print(sorted(m for m in sys.modules if m.partition(".")[0] == "torch"))
import transformers.utils.logging
print(transformers.utils.logging.is_progress_bar_enabled())
"""


@pytest.mark.integration
def test_loading_a_config_and_the_loss_options_imports_no_torch():
    """Reading and checking a run config loads no torch (issue 79), whose import alone takes over a second, nor does
    the command line telling a bad one (exit 2): config/
    takes LossConfig and its option tuples from ftis_kernels.options, which imports no torch, and ftis_kernels loads
    its names on first use."""
    tiny = ROOT.parent / "configs" / "tiny.yaml"
    done = subprocess.run([sys.executable, "-c", _CONFIG_ONLY, str(tiny)], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", "False"]  # and the command line's quieting turned transformers' bars off
    assert "members.0.lr" in done.stderr  # the bad config's one line, told before torch loads


def test_every_public_name_of_ftis_kernels_is_its_defining_modules_object_and_dir_lists_it():
    import ftis_kernels
    from ftis_kernels import config, options

    defined_in = {
        "api": ("BACKENDS", "FTISLoss", "FusedLinearFTISLoss", "ftis_loss", "fused_linear_ftis_loss",
                "fused_linear_token_logprobs", "resolve_backend", "token_logprobs"),
        "options": ("KL_ESTIMATORS", "KL_REDUCTIONS", "METHODS", "NORMALIZATIONS", "STAT_KEYS", "LossConfig"),
        "config": ("LossInputs", "LossOutput", "NonFiniteInputError", "combine_stats", "rejection_scale"),
        "advantages": ("group_advantages",),
    }
    assert sorted(n for names in defined_in.values() for n in names) == sorted(ftis_kernels.__all__)
    for module, names in defined_in.items():
        home = importlib.import_module(f"ftis_kernels.{module}")
        assert [n for n in names if getattr(ftis_kernels, n) is not getattr(home, n)] == []
    assert set(ftis_kernels.__all__) <= set(dir(ftis_kernels))
    # ftis_kernels.config re-exports the options: the same objects, so `is` and isinstance hold across the two
    assert [n for n in dir(options) if (n.isupper() or n == "LossConfig")
            and getattr(config, n, None) is not getattr(options, n)] == []
    assert not hasattr(ftis_kernels, "no_such_name")


def _late_imports(path: pathlib.Path) -> list[int]:
    """Lines of the imports of ftis_engine's own modules that stand inside a function without a comment saying why
    (on the import's line)."""
    source = path.read_text()
    lines = source.splitlines()
    late = []
    for function in ast.walk(ast.parse(source)):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                own = (isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("ftis_engine"))
                       or isinstance(node, ast.Import) and any(a.name.startswith("ftis_engine") for a in node.names))
                if own and "#" not in lines[node.end_lineno - 1]:
                    late.append(node.lineno)
    return sorted(set(late))


def test_an_import_of_the_engines_own_inside_a_function_is_the_command_lines_or_says_why(tmp_path):
    """The layers make a cycle impossible, so an import inside a function is no cycle's way out: only app/ imports
    late (the command line answers --help, a bad flag or a config error before it loads the runtime), and anywhere
    else an import inside a function says why on its line."""
    sample = tmp_path / "m.py"
    sample.write_text("def f():\n    from . import a\n    from . import b  # why\n    import os\n")
    assert _late_imports(sample) == [2]
    found = {str(path.relative_to(ROOT)): _late_imports(path) for path in sorted(ROOT.rglob("*.py"))
             if path.relative_to(ROOT).parts[0] != "app"}
    assert {name: lines for name, lines in found.items() if lines} == {}
