"""`doit verify`: every stored step output hashed again, past the stat cache, against the
listing its record made when it was published; each file that differs named, exit 1."""

from __future__ import annotations

from typing import Any

from doit.cmd_base import DoitCmdBase

from pipelines.core.errors import PipelineError
from pipelines.engine.steps import GRAPH
from pipelines.engine.store import Store, read_record


def verify_store(store: Store) -> tuple[int, list[str]]:
    """(how many outputs were checked, one line per file that differs from its record)."""
    lines, checked = [], 0
    for folder in sorted((store.root / "steps").iterdir()):
        if not (folder / "step.json").exists() and not (folder / "step.json").is_symlink():
            continue
        checked += 1
        try:
            name = read_record(folder / "step.json").get("name", "?")
        except PipelineError as err:
            lines.append(f"{folder.name[:16]}: {err}")
            continue
        lines += [f"{name} {folder.name[:16]}: {what}" for what in store.changed(folder.name, True)]
    return checked, lines


class Verify(DoitCmdBase):  # type: ignore[misc]  # doit is untyped
    """doit command: hash every stored output again and name each file that changed."""

    name = "verify"
    doc_purpose = "hash every stored step output again; name each file changed since (exit 1)"
    doc_usage = ""
    doc_description = None
    cmd_options = ()

    def _execute(self, pos_args: list[Any]) -> int:
        if not GRAPH:
            self.outstream.write("verify: no keyed step in this task graph\n")
            return 0
        engine, _ = next(iter(GRAPH.values()))
        checked, lines = verify_store(engine.store)
        for line in lines:
            self.outstream.write(f"verify: {line}\n")
        if lines:
            self.outstream.write(
                f"verify: {len(lines)} file(s) differ in {engine.store.root / 'steps'}; the next"
                " build makes those steps again\n"
            )
            return 1
        self.outstream.write(f"verify: {checked} stored output(s), every file as made\n")
        return 0
