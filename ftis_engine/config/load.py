"""Reading a run's config: the YAML file (UTF-8 or UTF-16 with its mark, a key given twice refused), the dotted
`--set` overrides typed by the field they name, validation with pydantic's first error rewritten as one line naming
the field, and the differences between two configs."""

from __future__ import annotations

import copy
import pathlib
import re
import typing
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ValidationError

from ..core import safefile
from .schema import RunConfig
from .types import ConfigError, unwrap


def config_differences(saved: RunConfig, new: RunConfig) -> list[tuple[str, object, object]]:
    """(dotted field, saved value, new value) for every leaf that differs."""
    return value_differences(saved.model_dump(mode="json"), new.model_dump(mode="json"))


def value_differences(old: object, new: object, path: str = "") -> list[tuple[str, object, object]]:
    """(dotted field, old value, new value) for every leaf of two JSON-like values that differs."""
    out: list[tuple[str, object, object]] = []

    def walk(a, b, path: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for key in list(a) + [k for k in b if k not in a]:
                walk(a.get(key), b.get(key), f"{path}.{key}" if path else str(key))
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{path}.{i}")
        elif a != b:
            out.append((path, a, b))

    walk(old, new, path)
    return out


def _location(error: dict) -> str:
    return ".".join(str(part) for part in error["loc"]) or "config"


def format_validation_error(error: ValidationError) -> str:
    first = error.errors()[0]
    where = _location(first)
    message = first["msg"].removeprefix("Value error, ")
    loss_field = re.match(r"LossConfig\.(\w+): (.*)", message)
    if loss_field:  # a LossConfig check: name the field inside the algorithm section
        field = loss_field.group(1)
        where = "rollout.temperature" if field == "temperature" else f"algorithm.{field}"
        message = loss_field.group(2)
    own_field = re.match(r"([a-z_]+(?:\.[a-z_0-9]+)+):? (.*)", message) if where == "config" else None
    if own_field:  # a whole-config check that names its field first
        where, message = own_field.group(1), own_field.group(2)
    if first["type"] == "extra_forbidden":
        message = "unknown key"
    elif first["type"] == "missing":
        message = "required field is missing"
    return f"{where}: {message}"


def _field_annotation(parts: list[str]) -> Any:
    """The annotation of the RunConfig field a dotted path names (list indices and dict keys followed), or None
    when the path names no field (validation then says so)."""
    annotation: Any = RunConfig
    for part in parts:
        inner, _ = unwrap(annotation)  # the type that holds fields, items or values
        if len(inner) != 1:
            return None
        annotation = inner[0]
        origin = typing.get_origin(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(part)
            if field is None:
                return None
            annotation = field.annotation
        elif origin is list and part.lstrip("-").isdigit():
            annotation = typing.get_args(annotation)[0]
        elif origin is dict:
            annotation = typing.get_args(annotation)[1]
        else:
            return None
    return annotation


def _text_field(annotation: Any) -> tuple[bool, bool]:
    """(whether a field takes text: str, an optional str or a Literal of strings; whether it may be null)."""
    inner, optional = unwrap(annotation)
    if len(inner) != 1:
        return False, False
    kind = inner[0]
    if typing.get_origin(kind) is Literal:
        text = all(isinstance(v, str) for v in typing.get_args(kind))
    else:
        text = kind is str
    return text, text and optional


NULLS = ("null", "Null", "NULL", "~")


def _parse_value(text: str, annotation: Any = None) -> Any:
    """An override's value: as typed for a field that takes text (run_name=1.10 stays "1.10", a system prompt
    keeps its '#' and ':', nothing is the empty text; null and ~ give None where the field may be null), else a YAML
    value ([1, 2], {a: 1}, null, 1e-6), read with the loader config files are read with."""
    is_text, nullable = _text_field(annotation)
    if is_text:
        return None if nullable and text.strip() in NULLS else text  # "" stays "" (no system prompt, say)
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader) if text.strip() else ""
    except (yaml.YAMLError, RecursionError):
        return text

# what --set takes (apply_override), as every command's help says it
OVERRIDE_HELP = ("Override a field: dotted.path=value, list indices allowed (members.1.lr=1e-4). A text field takes the "
                 "value exactly as typed ('#' and ':' included; null clears an optional one); any other field a YAML "
                 "value: 1e-4, [q_proj, v_proj], {gsm8k: data/test.jsonl}, null. Repeatable.")


def apply_override(raw: dict, assignment: str) -> None:
    """Apply one `dotted.path=value` override to the raw (unvalidated) config dict; list indices allowed. A field
    that takes text gets the value as typed; any other a YAML value."""
    if "=" not in assignment:
        raise ConfigError(f"--set {' '.join(assignment.split())}: expected KEY=VALUE")
    key, text = assignment.split("=", 1)
    parts = key.strip().split(".")
    if not key.strip() or any(not p for p in parts):
        raise ConfigError(f"--set {' '.join(assignment.split())}: empty key")
    apply_value(raw, key.strip(), _parse_value(text, _field_annotation(parts)))


def apply_value(raw: dict, key: str, value: Any) -> None:
    """Set the field a dotted key names (list indices allowed) to an already typed value (a study's `set:`)."""
    parts = key.split(".")
    node: Any = raw
    for depth, part in enumerate(parts[:-1]):
        node = _child(node, part, ".".join(parts[: depth + 1]), create=True)
    last = parts[-1]
    if isinstance(node, list):
        index = _index(node, last, key)
        node[index] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ConfigError(f"--set {key}: {'.'.join(parts[:-1])} is not a section")


def _index(node: list, part: str, where: str) -> int:
    try:
        index = int(part)
    except ValueError:
        # from None: a one-line error for the user; the cause adds nothing to it
        raise ConfigError(f"--set {where}: {part!r} is not a list index") from None
    if not -len(node) <= index < len(node):
        raise ConfigError(f"--set {where}: index {index} is out of range (the list has {len(node)} items)")
    return index


def _child(node: Any, part: str, where: str, create: bool) -> Any:
    if isinstance(node, list):
        return node[_index(node, part, where)]
    if isinstance(node, dict):
        if node.get(part) is None and create:
            node[part] = {}
        return node[part]
    raise ConfigError(f"--set {where}: not a section")


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A key given twice in one mapping: YAML keeps the second silently (a second `train:` section would replace
    the first, its micro_batch_tokens and threads lost)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing a key given twice in one mapping."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: merged (and overridden) by YAML's rules
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base constructor reports it
                continue
            if first is not None:
                raise DuplicateKeyError(problem=f"key {key!r} is given twice in one section (lines {first + 1} and "
                                                f"{key_node.start_mark.line + 1}); keep one",
                                        problem_mark=key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _UniqueKeyLoader.construct_yaml_map)


MAX_CONFIG_BYTES = 16 << 20  # a config (a run's, a study's) is kilobytes


def read_yaml_mapping(path: str | pathlib.Path, error: type[ConfigError] = ConfigError) -> dict:
    """A config file's top-level mapping: UTF-8 (with or without a byte-order mark) or UTF-16 with its mark, as
    editors save them. Anything else raises `error` with one line naming --config and the file."""
    path = pathlib.Path(path)
    if not path.is_file():
        what = ("is a directory" if path.is_dir() else "is not a regular file (a device, a pipe or a socket)"
                if path.exists() else "no such file")
        raise error(f"--config {path}: {what}")
    try:
        data = safefile.read_bytes(path, MAX_CONFIG_BYTES, "a config file")  # bounded: a config is kilobytes
    except OSError as exc:
        # from None: a one-line error for the user; the cause adds nothing to it
        raise error(f"--config {path}: cannot read it ({exc.strerror or type(exc).__name__})") from None
    try:
        text = data.decode("utf-16") if data[:2] in (b"\xff\xfe", b"\xfe\xff") else data.decode("utf-8-sig")
    except UnicodeDecodeError:
        # from None: a one-line error for the user; the cause adds nothing to it
        raise error(f"--config {path}: is not UTF-8 (or UTF-16) text; save it as UTF-8") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)
    except DuplicateKeyError as exc:
        # from None: a one-line error for the user; the cause adds nothing to it
        raise error(f"--config {path}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        # from None: a one-line error for the user; the cause adds nothing to it
        raise error(f"--config {path}:{where} is not valid YAML") from None
    except RecursionError:
        # from None: a one-line error for the user; the cause adds nothing to it
        raise error(f"--config {path}: nested too deep to read") from None
    if not isinstance(raw, dict):
        raise error(f"--config {path}: expected a mapping of sections at the top level")
    return raw


def load_config(path: str | pathlib.Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read YAML, apply `--set` overrides, validate. Raises ConfigError (one line naming the field)."""
    raw = copy.deepcopy(read_yaml_mapping(path))
    for assignment in overrides:
        apply_override(raw, assignment)
    return validate_config(raw)


def validate_config(raw: dict) -> RunConfig:
    try:
        config = RunConfig.model_validate(raw)
    except ValidationError as exc:
        # from None: a one-line error for the user; the cause adds nothing to it
        raise ConfigError(format_validation_error(exc)) from None
    return config


def dump_config(config: RunConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
