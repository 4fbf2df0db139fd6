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

from pipelines.core.errors import PipelineError
from pipelines.core.files import MiB, read_capped

M = TypeVar("M", bound="Strict")
# Profiles, locks and image specs are a few KiB (the 54-file lock: 9.5 KiB); a lock of some
# 6,000 files would still fit. Anything larger is refused before a byte of it is parsed.
YAML_MAX_BYTES = 1 * MiB
# Real documents nest 3 (a lock) to 5 (a profile) levels. PyYAML composes nodes by C recursion
# (libyaml's own parser does not): some 25,000 levels overflow the stack (SIGSEGV), so depth is
# bounded, on the parser's events, before anything is composed.
YAML_MAX_DEPTH = 64
# Nodes counted with every alias expanded: a capped file holds at most some 500,000 nodes, so
# only aliases of aliases ("billion laughs") go past this, and what walks the data (validation,
# the key hash) would walk them all.
YAML_MAX_NODES = 1_000_000
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
    data = load_yaml_file(path, error)
    if not isinstance(data, dict):
        raise error(f"{path}: expected a mapping of {model.__name__} fields")
    try:
        return validate(data, model)
    except msgspec.ValidationError as err:
        raise error(f"{path}: {describe_error(str(err), model, data)}") from None


def load_yaml_file(path: Path, error: type[PipelineError], cap: int = YAML_MAX_BYTES) -> Any:
    """The one YAML document of a file of at most cap bytes, nested no deeper than
    YAML_MAX_DEPTH, or error with one line naming the file (and line)."""
    [data] = load_yaml_documents(path, error, cap, single=True)
    return data


def load_yaml_documents(
    path: Path, error: type[PipelineError], cap: int, single: bool = False
) -> list[Any]:
    """Every document of a YAML file, bounded as load_yaml_file's (single: exactly one)."""
    text = read_text_capped(path, cap, error)
    try:
        check_yaml_shape(text)
        if single:
            return [yaml.load(text, Loader=UniqueKeyLoader)]
        return list(yaml.load_all(text, Loader=UniqueKeyLoader))
    except YAMLShapeError as err:
        raise error(f"{path}: line {err.line}: {err.problem}; refused before parsing") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}:" if mark else ""
        raise error(f"{path}:{where} not valid YAML: {getattr(err, 'problem', err)}") from None


def read_text_capped(path: Path, cap: int, error: type[PipelineError]) -> str:
    """A file of at most cap bytes as UTF-8 text, or error naming it."""
    data = read_capped(path, cap, error)
    try:
        return data.decode()
    except UnicodeDecodeError as err:
        raise error(f"{path}: not UTF-8 text: byte {err.start} is {data[err.start]:#04x}") from None


class YAMLShapeError(yaml.YAMLError):
    """A document too deep or too large once its aliases are expanded (said with its line)."""

    def __init__(self, problem: str, event: yaml.Event):
        super().__init__(problem)
        self.problem = problem
        self.line = event.start_mark.line + 1 if event.start_mark else 1


def check_yaml_shape(text: str) -> None:
    """Refuse text nested deeper than YAML_MAX_DEPTH or expanding to over YAML_MAX_NODES nodes.

    One pass over libyaml's events, which its parser makes with a stack of its own (no
    recursion): linear, and about a third of the load's own time.
    """
    open_at: list[tuple[str | None, int]] = []  # each open collection: its anchor, nodes before
    sizes: dict[str, int] = {}  # anchor -> nodes of its value, aliases expanded
    nodes = 0
    for event in yaml.parse(text, Loader=FastLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            open_at.append((event.anchor, nodes))
            nodes += 1
            if len(open_at) > YAML_MAX_DEPTH:
                raise YAMLShapeError(f"nested deeper than {YAML_MAX_DEPTH} levels", event)
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, before = open_at.pop()
            if anchor is not None:
                sizes[anchor] = nodes - before
        elif isinstance(event, yaml.ScalarEvent):
            nodes += 1
            if event.anchor is not None:
                sizes[event.anchor] = 1
        elif isinstance(event, yaml.AliasEvent):
            if any(anchor == event.anchor for anchor, _ in open_at):
                raise YAMLShapeError(f"alias *{event.anchor} inside its own value", event)
            nodes += sizes.get(event.anchor or "", 1)
        if nodes > YAML_MAX_NODES:
            raise YAMLShapeError(f"more than {YAML_MAX_NODES} nodes with aliases expanded", event)


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
