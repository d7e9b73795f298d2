"""mkdocs hooks: the configuration reference is generated from the pydantic descriptions (docs/configuration.md holds
it, committed, readable without a build: `python docs/hooks.py` writes it, tests/test_docs.py keeps it equal to the
schema, and every build writes it again), and the committed results under benchmarks/results/ are served as part of
the site."""

from __future__ import annotations

import pathlib
import re
import typing

from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "configuration.md"
BEGIN = "<!-- the configuration reference: generated from ftis_engine/config/schema.py by `python docs/hooks.py` -->"
END = "<!-- end of the configuration reference -->"


def on_files(files, config):
    for path in sorted(RESULTS.rglob("*")):
        if path.is_file() and path.suffix in (".md", ".png", ".json"):
            files.append(File.generated(config, "results/" + path.relative_to(RESULTS).as_posix(),
                                        abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page, config, files):
    return with_reference(markdown) if BEGIN in markdown else markdown


def with_reference(markdown: str) -> str:
    """The page with the reference between BEGIN and END written anew from the schema."""
    head, _, rest = markdown.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n\n{reference()}\n\n{END}{tail}"


def _type(annotation) -> str:
    text = str(_plain(annotation)).replace("typing.", "").replace("<class '", "").replace("'>", "")
    return re.sub(r"ftis_engine\.config\.\w+\.", "", text).replace("|", "\\|")


def _plain(annotation):
    """The annotation without Annotated's validators (their functions print with an address that changes with
    every process: the committed page must be the same wherever it is written)."""
    import functools
    import operator
    import types

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _plain(args[0])
    if origin in (typing.Union, types.UnionType):
        return functools.reduce(operator.or_, [_plain(a) for a in args])
    if origin in (list, dict, tuple):
        return origin[tuple(_plain(a) for a in args)]
    return annotation


def _fields(model, prefix: str) -> list[tuple[str, str, str, str]]:
    from pydantic import BaseModel

    rows, nested = [], []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        args = [a for a in typing.get_args(annotation) if isinstance(a, type)]
        inner = annotation if isinstance(annotation, type) else next((a for a in args if issubclass(a, BaseModel)),
                                                                     None)
        key = f"{prefix}{name}"
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            nested.append((key, inner))
            if typing.get_origin(annotation) is list:
                key += ".N"
            continue
        default = "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
        rows.append((key, _type(annotation), default, (field.description or "").replace("|", "\\|")))
    for key, inner in nested:
        sub = f"{key}.N." if typing.get_origin(model.model_fields[key.rsplit('.', 1)[-1]].annotation) is list else \
            f"{key}."
        rows += _fields(inner, sub)
    return rows


def reference() -> str:
    from ftis_engine.config.schema import RunConfig

    lines = ["| field | type | default | what it does |", "|---|---|---|---|"]
    for key, kind, default, description in _fields(RunConfig, ""):
        lines.append(f"| `{key}` | `{kind}` | `{default}` | {description} |")
    return "\n".join(lines)


if __name__ == "__main__":  # python docs/hooks.py: write the reference into docs/configuration.md
    import sys

    sys.path.insert(0, str(ROOT))
    PAGE.write_text(with_reference(PAGE.read_text()))
