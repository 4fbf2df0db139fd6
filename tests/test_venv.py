"""scripts/venv: a venv holding exactly the lock's packages, pip the lock's too, made without
ensurepip where the interpreter's own pip can install uv, and with it where it has none."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from support.act import uv_settings, wheelhouse
from support.lockfile import pins_with_hashes, requirements_text

REPO = Path(__file__).resolve().parent.parent
# The packages a small project's lock takes from the real one: the installer, the pip the lock
# pins, and the build backend of the editable install.
TAKEN = ("pip", "setuptools", "uv")
BASE_PYTHON = Path(sys.base_prefix) / "bin" / "python3"


def locked(names: tuple[str, ...]) -> dict[str, tuple[str, frozenset[str]]]:
    """Each named package's pin and hashes, as requirements.lock has them."""
    pins = pins_with_hashes((REPO / "requirements.lock").read_text())
    return {name: pins[name] for name in names}


def pinned(names: tuple[str, ...]) -> set[str]:
    """name==version of each named package, as the lock pins it."""
    return {f"{name}=={version}" for name, (version, _) in locked(names).items()}


def small_project(root: Path) -> Path:
    """A checkout of scripts/venv with a lock of TAKEN only and a project of no modules."""
    (root / "scripts").mkdir(parents=True)
    shutil.copy2(REPO / "scripts" / "venv", root / "scripts" / "venv")
    (root / "requirements.lock").write_text(requirements_text(locked(TAKEN)))
    (root / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "venvcheck"\nversion = "0"\n[tool.setuptools]\npy-modules = []\n'
    )
    return root


def make_venv(root: Path, path_first: Path, **env: str) -> subprocess.CompletedProcess:
    """`bash scripts/venv --no-compile` in root, with path_first's python3 first on PATH,
    offline: uv from the runner's wheelhouse, the rest from uv's cache (as a workflow job)."""
    environment = {
        **os.environ,
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(wheelhouse()),
        **uv_settings(),
        "PATH": f"{path_first}:{os.environ['PATH']}",
        **env,
    }
    return subprocess.run(
        ["bash", "scripts/venv", "--no-compile"],
        cwd=root,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )


def installed(root: Path) -> set[str]:
    """name==version of what the venv holds, the editable project aside: its dist-info folders
    read as pip freeze reads them, without starting pip (0.5 CPU s)."""
    (site,) = (root / ".venv" / "lib").glob("python3*/site-packages")
    found = set()
    for dist in importlib.metadata.distributions(path=[str(site)]):
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
        if not direct.get("dir_info", {}).get("editable"):
            found.add(f"{dist.metadata['Name']}=={dist.version}".lower())
    return found


def test_with_the_interpreters_pip_the_venv_is_made_without_ensurepip(tmp_path):
    has_pip = subprocess.run([BASE_PYTHON, "-m", "pip", "--version"], capture_output=True)
    assert has_pip.returncode == 0, f"{BASE_PYTHON}: no pip (CI's interpreter has one)"
    # The interpreter behind a python3 that writes down what it is asked to run. (ensurepip
    # cannot be made to fail from outside: venv and ensurepip both drop the environment's
    # PYTHONPATH and PIP_ settings.)
    bin_dir, asked = tmp_path / "bin", tmp_path / "asked"
    bin_dir.mkdir()
    wrapper = bin_dir / "python3"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >>"{asked}"\nexec "{BASE_PYTHON}" "$@"\n')
    wrapper.chmod(0o755)
    root = small_project(tmp_path / "checkout")
    made = make_venv(root, bin_dir)
    assert made.returncode == 0, made.stdout + made.stderr
    assert installed(root) == pinned(TAKEN)
    asked_lines = asked.read_text().splitlines()
    assert [line for line in asked_lines if line.startswith("-m venv")] == [
        "-m venv --without-pip .venv"
    ]
    assert any(line.startswith("-m pip --python .venv/bin/python install") for line in asked_lines)


def test_without_a_pip_in_the_interpreter_ensurepips_installs_uv_and_the_lock_replaces_it(
    tmp_path,
):
    # A python3 with no pip of its own: a venv made without one (its base's ensurepip intact).
    bare = tmp_path / "bare"
    subprocess.run([BASE_PYTHON, "-m", "venv", "--without-pip", bare], check=True)
    root = small_project(tmp_path / "checkout")
    made = make_venv(root, bare / "bin")
    assert made.returncode == 0, made.stdout + made.stderr
    # The lock's pip and setuptools, not the older ones ensurepip bundles.
    assert installed(root) == pinned(TAKEN)
