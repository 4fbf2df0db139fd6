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


BREAKAGES = [
    ("pipelines/steps.py", "import pipelines.weights", "The engine imports no stage"),
    ("pipelines/store.py", "import requests", "import no outside-world library"),
    ("pipelines/profiles.py", "import pipelines.steps", "The edge imports neither"),
    ("pipelines/images/tasks.py", "import devstack", "No stage imports the local stack"),
    ("pipelines/render/tasks.py", "import pipelines.weights.fetch", "Render uses other"),
    ("pipelines/stage.py", "import pipelines.render", "The stage shape (Context, Stage)"),
    ("pipelines/httpjson.py", "import pipelines.bench", "The HTTP pool and its JSON calls"),
    ("pipelines/targets/docker.py", "import pipelines.deploy", "The deploy targets name"),
    ("pipelines/fabric/launch.py", "import pipelines.deploy", "The fabric imports no other"),
    ("pipelines/fabric/tasks.py", "import pipelines.render", "The fabric imports no other"),
    ("pipelines/bench/tasks.py", "import pipelines.fabric", "The bench meets the other"),
    ("pipelines/bench/intervals.py", "import urllib3", "The bench's formulas and gate"),
    ("devstack/access.py", "import pipelines.weights.s3", "The local stack imports only"),
    ("devstack/settings.py", "import pipelines.steps", "The local stack imports only"),
    ("pipelines/cache/remote.py", "import pipelines.store", "The remote cache (an engine"),
    ("pipelines/images/tasks.py", "import pipelines.render.tasks", "Images use other"),
    ("pipelines/weights/tasks.py", "import pipelines.images.tasks", "Weights use other"),
    ("pipelines/deploy/tasks.py", "import pipelines.render.tasks", "Deploy uses other"),
    ("pipelines/deploy/tasks.py", "import pipelines.fabric", "The stages before it do not"),
    ("pipelines/render/tasks.py", "import pipelines.bench", "No stage before it imports"),
    ("pipelines/profile_check/__init__.py", "import pipelines.images.tasks", "The profile stage"),
    ("pipelines/provenance/checks.py", "import pipelines.images", "Provenance and the named keys"),
    ("pipelines/namedkeys.py", "import pipelines.cache", "Provenance and the named keys"),
    ("pipelines/store.py", "import pipelines.gc", "Nothing below gc imports it"),
    ("pipelines/deploy/records.py", "import pipelines.gc.builds", "Nothing below gc imports it"),
    ("pipelines/gc/roots.py", "import pipelines.deploy.tasks", "gc reads the stages' records"),
    ("pipelines/weights/tasks.py", "import model_signing", "Only the model's signature"),
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


@pytest.mark.parametrize(
    ("module", "line"),
    [
        ("images/local-sim/sim/__main__.py", "import pipelines.steps"),
        ("pipelines/steps.py", "import dodo"),
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
    oci = folder / "pipelines" / "images" / "oci.py"
    oci.write_text(oci.read_text() + "\nfrom pipelines.images import registry  # noqa\n")
    cycles = import_cycles(folder)
    assert ["pipelines.images.oci", "pipelines.images.registry", "pipelines.images.oci"] in cycles


# The modules that print without the one printer (pipelines/progress.py), each for a reason.
PRINTS_ELSEWHERE = {
    "pipelines/errors.py": "the error line of every entry point, before anything else may work",
    "pipelines/weights/patch.py": "also runs alone in a Job, with nothing but the standard library",
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
    assert printing - {"pipelines/progress.py"} == set(PRINTS_ELSEWHERE)


def test_every_exception_class_has_a_name_of_its_own():
    import ast
    from collections import defaultdict

    import pipelines.errors

    bases = {name for name in vars(pipelines.errors) if name[:1].isupper()}
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
