"""Rendered documents: what a renderer returns, the templates it fills, how they are written."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from pipelines.core.errors import BadInput, PipelineError
from pipelines.core.modellock import Lock
from pipelines.core.paths import MANIFESTS_DIR

try:  # libyaml's parser: PyYAML's own takes most of a render's time
    from yaml import CSafeLoader as FastLoader
except ImportError:  # pragma: no cover - PyYAML built without libyaml
    from yaml import SafeLoader as FastLoader  # type: ignore[assignment]

if TYPE_CHECKING:
    import jinja2

LLMKUBE = "inference.llmkube.dev/v1alpha1"


@dataclass(frozen=True)
class RenderInputs:
    """What a renderer is given besides the profile: published outputs of other stages."""

    lock: Lock
    image: str  # pinned by digest
    patch_source: str  # the config patch program the patch Job runs
    weights_root: str = ""  # where the members keep blobs and staged models
    stager_image: str = ""  # rings: the weights-stager image, pinned by digest
    ring_plan: str = ""  # rings with a complete lock: the staging plan (JSON); "": no staging


class RenderError(BadInput):
    """A profile that renders into something that must not reach a cluster."""


@dataclass(frozen=True)
class Document:
    """One rendered object and the file it is written to."""

    file: str
    body: dict[str, Any]

    def text(self) -> str:
        """The document as YAML with a stable key order, written by libyaml's emitter."""
        # No fallback to PyYAML's own emitter: it writes some of the same documents with other
        # bytes (long multi-line strings folded elsewhere, some keys in the `? key` form), and
        # a document's bytes must not depend on how PyYAML was built. The lock's wheels carry
        # libyaml; a PyYAML built without it is one line, not other bytes.
        dumper = getattr(yaml, "CSafeDumper", None)
        if dumper is None:
            raise PipelineError(
                f"{self.file}: PyYAML {yaml.__version__} here has no libyaml, whose emitter"
                " writes every rendered document; install the lock's (bash scripts/install)"
            )
        return yaml.dump(
            self.body, Dumper=dumper, sort_keys=True, default_flow_style=False, width=1000
        )


class Flow(str):
    """A value as `tojson` writes it: a YAML flow node that no character of it can escape."""


class RawValue(Exception):
    """A template wrote a value as raw text, where the value's own characters become YAML."""


# Every character a JSON string may hold raw beyond printable ASCII: DEL and C1 controls
# (which PyYAML refuses in a stream) and the rest of Unicode.
NOT_ASCII = re.compile(r"[^\x00-\x7e]")


def yaml_escape(match: re.Match[str]) -> str:
    """One character as a YAML double-quoted escape: astral ones as \\U, which PyYAML reads
    back whole (a JSON surrogate pair would read back as two lone surrogates)."""
    code = ord(match.group())
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def tojson(value: Any) -> Flow:
    """value as a YAML flow node: JSON (keys sorted), every non-ASCII character escaped."""
    defined(value)
    try:
        text = json.dumps(value, sort_keys=True, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as err:
        # NaN, infinities and objects have no JSON spelling that YAML reads back the same.
        raise RawValue(f"{value!r:.80} has no spelling that reads back the same ({err})") from None
    return Flow(NOT_ASCII.sub(yaml_escape, text))


def defined(value: object) -> None:
    """Raise jinja2's own error for a missing value (StrictUndefined), naming it."""
    import jinja2

    if isinstance(value, jinja2.Undefined):
        value._fail_with_undefined_error()


def data_only(value: object) -> Flow:
    """What a `{{ }}` may write: only a value through tojson, never raw text."""
    defined(value)
    if isinstance(value, Flow):
        return value
    raise RawValue(f"{value!r:.80} is written as raw text; expected it through `| tojson`")


@cache
def template_env(folder: Path = MANIFESTS_DIR) -> jinja2.Environment:
    """jinja2 with StrictUndefined (a missing value is an error, never an empty string), whose
    `{{ }}` write only values through tojson: structure is the template's, values are data.

    One per folder and process: a template is compiled once (jinja2 keeps it, and compiles it
    again when its file changes), not at every render of a process that renders many.
    """
    import jinja2  # loaded when something is rendered, not for a no-op run

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(folder),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        finalize=data_only,
    )
    env.filters["tojson"] = tojson
    return env


def render_template(
    env: jinja2.Environment, name: str, context: dict[str, Any]
) -> list[dict[str, Any]]:
    """The objects of one template (one or more YAML documents)."""
    import jinja2

    try:
        text = env.get_template(name).render(**context)
    except jinja2.UndefinedError as err:
        raise RenderError(f"{MANIFESTS_DIR / name}: {err.message}") from None
    except RawValue as err:
        raise RenderError(f"{MANIFESTS_DIR / name}: {err}") from None
    try:
        return [doc for doc in yaml.load_all(text, Loader=FastLoader) if doc]
    except yaml.YAMLError as err:
        # Values cannot add structure, but one can still break the text: YAML allows a mapping
        # key of at most 1024 characters.
        raise RenderError(
            f"{MANIFESTS_DIR / name}: renders as no YAML: {yaml_problem(err)}"
        ) from None


def yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's complaint in one line: the problem and where."""
    if isinstance(err, yaml.MarkedYAMLError) and err.problem_mark:
        mark, context = err.problem_mark, f"{err.context}: " if err.context else ""
        return f"{context}{err.problem} (line {mark.line + 1}, column {mark.column + 1})"
    return " ".join(str(err).split())


def write_documents(docs: list[Document], folder: Path) -> None:
    """Write each document to its file (the store makes the folder appear whole); two
    documents for one file are refused, since the second would replace the first unseen."""
    names = [doc.file for doc in docs]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise RenderError(f"render: two documents for {', '.join(twice)}; expected one each")
    for doc in docs:
        (folder / doc.file).write_text(doc.text())
