"""The step's walk: where the Swarm goes during one step (issue 69's figure), measured the same way at any commit.

    python benchmarks/step_walk.py [--output walk.json]                       # this checkout
    git worktree add /tmp/old <commit> && PYTHONPATH=/tmp/old python benchmarks/step_walk.py   # another commit

The method (written here because the issue's own figure, "38 stays in 16 rooms with 18 climbs", came from a method
nothing in the repository reproduced): one step of configs/tiny.yaml shortened as the tests shorten it (tests/helpers
SHORT: two members, sync, in this process) runs under sys.setprofile. Every call of a function of ftis_engine that
takes the step's Swarm as an argument is a visit to that function's module, a *room*. The *walk* is the sequence of
rooms of those calls, in call order; a *stay* is a run of consecutive visits to one room; *rooms* counts the distinct
modules; a *climb* is a move from a room to one that imports it (directly or through others: back up the layers,
a lower layer handing the Swarm to a higher one). The import graph is read from the checkout's sources (imports
inside functions included), so each commit is measured against its own layers.

What it measures is how far one object that holds everything travels, and how often the walk turns back up: the
fewer rooms and climbs, the more the step's work is done by modules that get only what they need. It is a
structural figure (deterministic for a commit), not a timing.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def import_graph(package: pathlib.Path) -> dict[str, set[str]]:
    """Each module of the package (dotted name) -> the package's modules it imports, anywhere in its source."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        base = name.split(".") if is_package else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    stem = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                targets = [stem] + [f"{stem}.{alias.name}" for alias in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    found.add(target)
        graph[name] = found
    return graph


def importers(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each module -> every module that imports it, directly or through others."""
    above: dict[str, set[str]] = {m: set() for m in graph}
    for module in graph:
        stack, seen = [module], set()
        while stack:
            for target in graph[stack.pop()]:
                if target not in seen:
                    seen.add(target)
                    stack.append(target)
        for target in seen:
            above.setdefault(target, set()).add(module)
    return above


def walk_of_one_step(run_dir: pathlib.Path) -> list[str]:
    """The rooms (modules) of the calls that take the Swarm during step 1, in order."""
    sys.path.insert(0, str(ROOT))
    import ftis_engine
    from ftis_engine.run import session
    from ftis_engine.run.step import run_step
    from tests.helpers import short_config

    config = short_config("eval.every=0")
    if hasattr(session, "Start"):
        swarm, start = session.open_run(config, session.Start(run_dir))
    else:  # before issue 69's start-up: open_run(config, run_dir)
        swarm, start = session.open_run(config, run_dir)
    swarm.exchange.start(swarm.schedule.parcel_limit, start)
    package = str(pathlib.Path(ftis_engine.__file__).parent)
    rooms: list[str] = []
    codes: dict[object, str | None] = {}

    def room(code) -> str | None:
        if code not in codes:
            path = pathlib.Path(code.co_filename)
            codes[code] = None
            if code.co_filename.startswith(package):
                parts = path.relative_to(pathlib.Path(package).parent).with_suffix("").parts
                codes[code] = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        return codes[code]

    def profile(frame, event, arg):
        if event != "call":
            return
        name = room(frame.f_code)
        if name is None:
            return
        code = frame.f_code
        arguments = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if any(frame.f_locals.get(a) is swarm for a in arguments):
            rooms.append(name)

    sys.setprofile(profile)
    try:
        run_step(swarm, 1)
    finally:
        sys.setprofile(None)
        swarm.close()
    return rooms


def measure(rooms: list[str], above: dict[str, set[str]]) -> dict:
    stays = [r for k, r in enumerate(rooms) if k == 0 or rooms[k - 1] != r]
    climbs = [(a, b) for a, b in zip(stays, stays[1:]) if b in above.get(a, set())]
    return {"stays": len(stays), "rooms": len(set(stays)), "climbs": len(climbs), "walk": stays,
            "climbs_at": [f"{a} -> {b}" for a, b in climbs]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=pathlib.Path, help="Write the measurement as JSON here too.")
    args = parser.parse_args(argv)
    import ftis_engine

    package = pathlib.Path(ftis_engine.__file__).parent
    with tempfile.TemporaryDirectory() as tmp:
        rooms = walk_of_one_step(pathlib.Path(tmp) / "run")
    result = measure(rooms, importers(import_graph(package)))
    commit = subprocess.run(["git", "-C", str(package.parent), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    result = {"commit": commit, "method": "benchmarks/step_walk.py", **result}
    print(f"{commit}: {result['stays']} stays in {result['rooms']} rooms with {result['climbs']} climbs")
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
