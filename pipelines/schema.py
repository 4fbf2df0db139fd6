"""YAML documents validated into read-only models, with errors as one line naming file and field."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from pipelines.errors import PipelineError

M = TypeVar("M", bound=BaseModel)
# libyaml's parser where PyYAML was built with it: a 54-file lock parses ~10x faster.
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class Strict(BaseModel):
    """A document section: unknown fields are errors, values are read-only."""

    # Schemas are built on first use: a run pays only for the documents it reads.
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)


def load_yaml_model(path: Path, model: type[M], error: type[PipelineError] = PipelineError) -> M:
    """Parse the YAML file at path and validate it as model, or raise error with one line."""
    try:
        data = yaml.load(path.read_text(), Loader=SAFE_LOADER)
    except FileNotFoundError:
        raise error(f"{path}: file not found") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}:" if mark else ""
        raise error(f"{path}:{where} not valid YAML: {getattr(err, 'problem', err)}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a mapping of {model.__name__} fields")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise error(f"{path}: {describe_error(err, model)}") from None


def describe_error(err: ValidationError, model: type[BaseModel]) -> str:
    """The first validation error as 'field X: what was expected', plus how many more."""
    # A misspelled field also makes the real one "missing": the unknown name is the cause.
    errors = sorted(err.errors(), key=lambda e: e["type"] != "extra_forbidden")
    first = errors[0]
    loc = [p for p in first["loc"] if not (isinstance(p, str) and "[" in p)]
    field = ".".join(str(p) for p in loc)
    if first["type"] == "extra_forbidden":
        allowed = sorted(fields_at(model, loc[:-1]))
        near = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        text = f"unknown field {field!r}{hint}; expected one of: {', '.join(allowed)}"
    elif field:
        text = f"field {field!r}: {first['msg']}"
    else:
        text = first["msg"].removeprefix("Value error, ")
    more = len(errors) - 1
    return text + (f" (and {more} more error{'s' if more > 1 else ''})" if more else "")


def fields_at(model: type[BaseModel], loc: list[Any]) -> set[str]:
    """Field names of the model section found by following loc from model."""
    for part in loc:
        if isinstance(part, int):
            continue
        annotation = model.model_fields[part].annotation
        model = next(t for t in _model_types(annotation))
    return set(model.model_fields)


def _model_types(annotation: Any) -> list[type[BaseModel]]:
    """The BaseModel classes inside a type annotation (through Optional, list, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found = []
    for arg in getattr(annotation, "__args__", ()):
        found += _model_types(arg)
    return found
