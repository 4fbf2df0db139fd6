"""Rendered documents: what a renderer returns, the templates it fills, how they are written."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from pipelines.errors import BadInput
from pipelines.paths import MANIFESTS_DIR
from pipelines.weights import Lock

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
        """The document as YAML with a stable key order."""
        return yaml.safe_dump(self.body, sort_keys=True, default_flow_style=False, width=1000)


def template_env(folder: Path = MANIFESTS_DIR) -> jinja2.Environment:
    """jinja2 with StrictUndefined: a missing value is an error, never an empty string."""
    import jinja2  # loaded when something is rendered, not for a no-op run

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(folder),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def render_template(
    env: jinja2.Environment, name: str, context: dict[str, Any]
) -> list[dict[str, Any]]:
    """The objects of one template (one or more YAML documents)."""
    import jinja2

    try:
        text = env.get_template(name).render(**context)
    except jinja2.UndefinedError as err:
        raise RenderError(f"{MANIFESTS_DIR / name}: {err.message}") from None
    return [doc for doc in yaml.safe_load_all(text) if doc]


def write_documents(docs: list[Document], folder: Path) -> None:
    """Write each document to its file (the store makes the folder appear whole); two
    documents for one file are refused, since the second would replace the first unseen."""
    names = [doc.file for doc in docs]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise RenderError(f"render: two documents for {', '.join(twice)}; expected one each")
    for doc in docs:
        (folder / doc.file).write_text(doc.text())
