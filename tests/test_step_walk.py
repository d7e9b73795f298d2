"""benchmarks/step_walk.py's counting (the issue 69 figure), against walks counted by hand."""

from __future__ import annotations

from benchmarks import step_walk  # as a module of the package: benchmarks/ on sys.path would shadow libraries


def test_stays_rooms_and_climbs_are_counted_as_the_method_says():
    # c imports b, b imports a: a is the lowest layer
    above = step_walk.importers({"c": {"b"}, "b": {"a"}, "a": set()})
    assert above == {"a": {"b", "c"}, "b": {"c"}, "c": set()}
    measured = step_walk.measure(["c", "c", "b", "a", "a", "c", "b", "b", "c"], above)
    # stays c, b, a, c, b, c: a -> c climbs (c imports a through b), b -> c climbs; c -> b and b -> a descend
    assert (measured["stays"], measured["rooms"], measured["climbs"]) == (6, 3, 2)
    assert measured["climbs_at"] == ["a -> c", "b -> c"]


def test_the_import_graph_reads_relative_and_absolute_imports_inside_functions_too(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from .. import low\n")
    (package / "low.py").write_text("import os\n")
    (package / "high.py").write_text("def f():\n    from .sub import thing\n    import pkg.low\n")
    graph = step_walk.import_graph(package)
    assert graph["pkg.high"] == {"pkg.sub", "pkg.low"}
    assert graph["pkg.sub"] == {"pkg", "pkg.low"} and graph["pkg.low"] == set()
