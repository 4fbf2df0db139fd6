"""The import contracts hold, and they fail when a forbidden import is added."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def copy_project(tmp_path: Path) -> Path:
    """The packages and the configuration the linters read, in a scratch folder."""
    for folder in ("pipelines", "devstack", "images"):
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__py*"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    return tmp_path


def lint_imports(folder: Path) -> subprocess.CompletedProcess:
    """lint-imports run on a folder (its packages first on the path)."""
    return subprocess.run(
        [str(BIN / "lint-imports"), "--no-cache"],
        cwd=folder,
        env={"PYTHONPATH": str(folder), "PATH": str(BIN)},
        capture_output=True,
        text=True,
    )


def test_the_shipped_tree_keeps_every_contract(tmp_path):
    result = lint_imports(copy_project(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


LAYERS = "The house's layers"
ALONE = "No stage imports another"
BREAKAGES = [
    ("pipelines/engine/steps.py", "import pipelines.stages.weights", LAYERS),
    ("pipelines/core/profiles.py", "import pipelines.engine.steps", LAYERS),
    ("pipelines/targets/docker.py", "import pipelines.stages.deploy", LAYERS),
    ("pipelines/stages/deploy/records.py", "import pipelines.gc.builds", LAYERS),
    ("pipelines/engine/stage.py", "import pipelines.targets", LAYERS),
    ("pipelines/stages/render/tasks.py", "import pipelines.stages.weights.fetch", ALONE),
    ("pipelines/stages/images/tasks.py", "import pipelines.stages.provenance", ALONE),
    ("pipelines/stages/bench/tasks.py", "import pipelines.stages.fabric", ALONE),
    ("pipelines/engine/store.py", "import requests", "import no outside-world library"),
    ("pipelines/core/files.py", "import boto3", "import no outside-world library"),
    ("pipelines/stages/bench/intervals.py", "import urllib3", "The bench's formulas and gate"),
    ("pipelines/stages/images/tasks.py", "import devstack", "No part of the pipeline imports"),
    ("devstack/settings.py", "import pipelines.engine.steps", "The local stack imports only"),
    ("devstack/access.py", "import pipelines.stages.weights.s3", "The local stack imports only"),
    ("pipelines/stages/weights/tasks.py", "import model_signing", "Only the model's signature"),
    ("pipelines/targets/pruning.py", "import pipelines.targets.kubeapi", "The pruning shape"),
]


@pytest.mark.parametrize(("module", "line", "contract"), BREAKAGES)
def test_a_forbidden_import_breaks_its_contract(tmp_path, module, line, contract):
    folder = copy_project(tmp_path)
    path = folder / module
    path.write_text(path.read_text() + f"\n{line}  # the forbidden import\n")
    result = lint_imports(folder)
    assert result.returncode != 0
    # A contract with ignore_imports says so after the word: "BROKEN (1 ignored import)".
    broken = [row for row in result.stdout.splitlines() if re.search(r" BROKEN( \(.*\))?$", row)]
    assert any(contract in row for row in broken), result.stdout


def test_every_contract_has_a_forbidden_import_that_breaks_it():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    names = [c["name"] for c in pyproject["tool"]["importlinter"]["contracts"]]
    assert [n for n in names if not any(row[2] in n for row in BREAKAGES)] == []


def test_a_new_stage_is_held_by_the_contracts_as_they_are(tmp_path):
    # A stage added as a folder under stages/ is independent of the others and under the
    # targets with no edit to pyproject.toml: importing another stage breaks the contract.
    folder = copy_project(tmp_path)
    new = folder / "pipelines" / "stages" / "newstage"
    new.mkdir()
    (new / "__init__.py").write_text("import pipelines.stages.render  # noqa: F401\n")
    result = lint_imports(folder)
    assert result.returncode != 0
    assert f"{ALONE} BROKEN" in result.stdout, result.stdout
    assert "pipelines.stages.newstage is not allowed to import pipelines.stages.render" in (
        result.stdout
    )


def test_a_folder_outside_the_layers_is_refused(tmp_path):
    # Exhaustive layers: a new folder of pipelines/ must be given its place in the house.
    folder = copy_project(tmp_path)
    (folder / "pipelines" / "extras").mkdir()
    (folder / "pipelines" / "extras" / "__init__.py").write_text("")
    result = lint_imports(folder)
    assert result.returncode != 0
    assert "pipelines.extras" in result.stdout, result.stdout


@pytest.mark.parametrize(
    ("module", "line"),
    [
        ("images/local-sim/sim/__main__.py", "import pipelines.engine.steps"),
        ("pipelines/engine/steps.py", "import dodo"),
    ],
)
def test_importing_dodo_or_the_pipeline_into_an_image_is_refused_by_ruff(tmp_path, module, line):
    folder = copy_project(tmp_path)
    path = folder / module
    path.write_text(path.read_text() + f"\n{line}  # noqa: F401, E402\n")
    result = subprocess.run(
        [str(BIN / "ruff"), "check", "--no-cache", module],
        cwd=folder,
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert "TID251" in result.stdout, result.stdout


# Lists each import cycle of a package once: a module, and a module it imports that imports it
# back (directly or through others), with the chain back. grimp counts every import, those in
# functions and under TYPE_CHECKING too: a cycle hidden in a function is still a cycle.
CYCLES = """
import json, sys
import grimp
cycles = []
for package in sys.argv[1:]:
    graph = grimp.build_graph(package, cache_dir=None)
    for module in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back and not any(set(back) == set(c) for c in cycles):
                cycles.append([module, *back])
print(json.dumps(cycles))
"""


def import_cycles(folder: Path) -> list[list[str]]:
    """The import cycles of the project's packages in folder (the simulator's `sim` too)."""
    path = f"{folder}:{folder / 'images' / 'local-sim'}"
    result = subprocess.run(
        [sys.executable, "-c", CYCLES, "pipelines", "devstack", "sim"],
        cwd=folder,  # `-c` puts the working folder first on the path: the copy's, not ours
        env={"PYTHONPATH": path, "PATH": str(BIN)},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_no_module_imports_itself_through_others(tmp_path):
    cycles = import_cycles(copy_project(tmp_path))
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_a_new_import_cycle_is_found_and_named(tmp_path):
    folder = copy_project(tmp_path)
    oci = folder / "pipelines" / "stages" / "images" / "oci.py"
    oci.write_text(oci.read_text() + "\nfrom pipelines.stages.images import registry  # noqa\n")
    cycles = import_cycles(folder)
    assert [
        "pipelines.stages.images.oci",
        "pipelines.stages.images.registry",
        "pipelines.stages.images.oci",
    ] in cycles


# The modules that print without the one printer (pipelines/core/progress.py), each for a reason.
PRINTS_ELSEWHERE = {
    "pipelines/core/errors.py": "the error line of every entry point, before anything may work",
    "pipelines/stages/weights/patch.py": "runs alone in a Job, with only the standard library",
}


def test_every_line_a_user_reads_goes_through_the_one_printer():
    import ast

    printing = set()
    for path in sorted((REPO / "pipelines").rglob("*.py")):
        calls = [
            node
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print"
        ]
        if calls:
            printing.add(path.relative_to(REPO).as_posix())
    assert printing - {"pipelines/core/progress.py"} == set(PRINTS_ELSEWHERE)


def test_every_exception_class_has_a_name_of_its_own():
    import ast
    from collections import defaultdict

    import pipelines.core.errors

    bases = {name for name in vars(pipelines.core.errors) if name[:1].isupper()}
    where = defaultdict(list)
    for path in sorted((REPO / "pipelines").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            # An exception: a class that derives from one (by the name it is imported under).
            named = (
                {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
                if isinstance(node, ast.ClassDef)
                else set()
            )
            if named & bases or any(n.endswith(("Error", "Exception")) for n in named):
                where[node.name].append(path.relative_to(REPO).as_posix())
    reused = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert reused == {}, f"exception names defined more than once: {reused}"


# A class past this many lines does more than one thing: split it by what it does (how the
# deploy backends, the stages and the ring member were split).
CLASS_LINES = 300


def long_classes(root: Path) -> list[str]:
    """path:Class (lines) of every class of root's pipelines/ longer than CLASS_LINES."""
    import ast

    found = []
    for path in sorted((root / "pipelines").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > CLASS_LINES:
                    found.append(f"{path.relative_to(root)}:{node.name} ({lines})")
    return found


def test_no_class_is_longer_than_its_limit():
    assert long_classes(REPO) == []
