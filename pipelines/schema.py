"""YAML documents validated into read-only structs, with errors as one line naming file and field.

msgspec rather than pydantic: the profile is validated on every `doit` start, even `doit list`,
and msgspec imports and validates in a few milliseconds where pydantic took ~150 ms.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Hashable
from pathlib import Path
from typing import Any, TypeVar, get_args

import msgspec
import yaml

from pipelines.errors import PipelineError

M = TypeVar("M", bound="Strict")
# libyaml's parser where PyYAML was built with it: a 54-file lock parses ~10x faster.
try:
    from yaml import CSafeLoader as FastLoader
except ImportError:  # PyYAML without libyaml: the same loader, in Python
    from yaml import SafeLoader as FastLoader  # type: ignore[assignment]


class UniqueKeyLoader(FastLoader):
    """The safe loader, refusing a key given twice in a mapping (YAML keeps the last, silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        """The mapping, or a ConstructorError at the second occurrence of a key."""
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str):
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


# msgspec names no key inside a dict: "$.env[...]".
MAPPING_KEY = "[...]"
# msgspec's messages end with where: "... - at `$.members[1].node`".
WHERE = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
# ... and for a mapping's key: "... - at `key` in `$.env`".
KEY_WHERE = re.compile(r"^(?P<what>.*?) - at `key` in `\$(?P<path>[^`]*)`$", re.S)
KEY_REGEX = re.compile(r"matching regex '(?P<regex>.*)'")
UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>[^`]*)`$")
MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]*)`$")


class Strict(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A document section: unknown fields are errors, values are read-only."""


def as_data(value: Strict) -> Any:
    """A struct as plain JSON-able data (dicts, lists, strings, numbers), defaults included."""
    return msgspec.to_builtins(value)


def replace(value: M, **changes: Any) -> M:
    """A copy of a struct with some fields changed (not re-validated)."""
    return msgspec.structs.replace(value, **changes)


def validate(data: Any, model: type[M]) -> M:
    """Plain data validated as model; msgspec.ValidationError when it is not."""
    return msgspec.convert(data, model)


def load_yaml_model(path: Path, model: type[M], error: type[PipelineError] = PipelineError) -> M:
    """Parse the YAML file at path and validate it as model, or raise error with one line."""
    try:
        data = yaml.load(path.read_text(), Loader=UniqueKeyLoader)
    except FileNotFoundError:
        raise error(f"{path}: file not found") from None
    except UnicodeDecodeError as err:
        raise error(
            f"{path}: not UTF-8 text: byte {err.start} is {err.object[err.start]:#04x}"
        ) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}:" if mark else ""
        raise error(f"{path}:{where} not valid YAML: {getattr(err, 'problem', err)}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a mapping of {model.__name__} fields")
    try:
        return validate(data, model)
    except msgspec.ValidationError as err:
        raise error(f"{path}: {describe_error(str(err), model, data)}") from None


def describe_error(message: str, model: type[Strict], data: Any = None) -> str:
    """msgspec's error as 'field X: what was expected', the field dotted from the top."""
    if key_error := KEY_WHERE.match(message):
        return describe_key_error(key_error["what"], parse_path(key_error["path"]), data)
    match = WHERE.match(message)
    assert match is not None  # the pattern matches any text (everything after is optional)
    what, loc = match["what"], parse_path(match["path"] or "")
    loc = name_mapping_keys(loc, what, data)
    if unknown := UNKNOWN.match(what):
        name = unknown["name"]
        allowed = sorted(fields_at(model, loc))
        near = difflib.get_close_matches(name, allowed, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        return (
            f"unknown field {dotted(loc + [name])!r}{hint}; expected one of: {', '.join(allowed)}"
        )
    if missing := MISSING.match(what):
        return f"field {dotted(loc + [missing['name']])!r}: required"
    # A struct's own rule already names its field from the top of the document.
    if what.startswith("field ") or not loc:
        return what
    return f"field {dotted(loc)!r}: {what[:1].lower()}{what[1:]}"


def describe_key_error(what: str, loc: list[str | int], data: Any) -> str:
    """A mapping key msgspec refused, as 'field X: key K: what was expected' (K as repr: a key
    may hold a newline; found by the pattern the message names, where it names one)."""
    node = data
    for part in loc:
        node = node.get(part) if isinstance(node, dict) else None
    pattern = KEY_REGEX.search(what)
    bad = None
    if pattern and isinstance(node, dict):
        bad = next((k for k in node if not re.search(pattern["regex"], str(k))), None)
    key = f" key {bad!r}:" if bad is not None else " a key:"
    return f"field {dotted(loc)!r}:{key} {what[:1].lower()}{what[1:]}"


def parse_path(path: str) -> list[str | int]:
    """msgspec's '.members[1].node' as ['members', 1, 'node'] ('.env[...]': ['env', '[...]'])."""
    found = re.findall(r"\.([^.\[]+)|\[(\d+)\]|(\[\.\.\.\])", path)
    return [int(i) if i else name or key for name, i, key in found]


# msgspec's type names in "got `int`", and the Python types of parsed YAML they stand for.
GOT_TYPES = {"str": str, "int": int, "float": float, "bool": bool, "null": type(None),
             "array": list, "object": dict}  # fmt: skip


def name_mapping_keys(loc: list[str | int], what: str, data: Any) -> list[str | int]:
    """loc with each unnamed mapping key replaced by the first key whose value is of the type
    msgspec says it got (the only one, where one value is wrong)."""
    got = re.search(r"got `(\w+)`", what)
    named: list[str | int] = []
    node = data
    for part in loc:
        if part == MAPPING_KEY and isinstance(node, dict) and got and got[1] in GOT_TYPES:
            wanted = GOT_TYPES[got[1]]
            part = next((k for k, v in node.items() if type(v) is wanted), part)
        named.append(part)
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            node = None
    return named


def dotted(loc: list[str | int]) -> str:
    """A location as the dotted name the messages use: members.1.node."""
    return ".".join(str(p) for p in loc)


def fields_at(model: type[Strict], loc: list[str | int]) -> set[str]:
    """Field names of the struct found by following loc (names and list indexes) from model."""
    for part in loc:
        if isinstance(part, int):
            continue
        (field,) = (f for f in msgspec.structs.fields(model) if f.name == part)
        model = next(iter(struct_types(field.type)))
    return {f.name for f in msgspec.structs.fields(model)}


def struct_types(annotation: Any) -> list[type[Strict]]:
    """The Strict classes inside a type annotation (through Optional, list, dict, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, Strict):
        return [annotation]
    found = []
    for arg in get_args(annotation):
        found += struct_types(arg)
    return found
