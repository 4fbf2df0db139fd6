"""The weights-stager image's inputs: the member's modules and wheels it carries, checked
against the code and the lock they come from (the image itself runs in test_deploy's ring)."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.lockfile import pins_with_hashes

from pipelines.core.paths import IMAGES_DIR, REPO_ROOT
from pipelines.stages.images.spec import ImageError, load_image
from pipelines.stages.images.wheels import download_command, download_wheels

STAGER = "weights-stager"


def member_lib(lib: Path) -> Path:
    """lib made the member's site folder: links to the top-level modules of each distribution
    the stager's requirements pin, as the project's venv has them (at the pinned version: the
    stager's pins are the lock's, which the venv installs; a test below keeps them equal)."""
    image = load_image(STAGER)
    pins = pins_with_hashes((image.path / image.spec.wheels.requirements).read_text())
    for name, (version, _) in pins.items():
        dist = importlib.metadata.distribution(name)
        assert dist.version == version, f"{name}: the venv has {dist.version}, the stager {version}"
        tops = {f.parts[0] for f in dist.files or () if f.parts[0] not in ("..", "__pycache__")}
        for top in tops - {t for t in tops if t.endswith((".dist-info", ".data"))}:
            (lib / top).symlink_to(dist.locate_file(top))
    return lib


def member_imports(lib: Path) -> dict[str, str]:
    """Module -> file of everything the ring member (stages/weights/ring.py) imports (modules with
    a file only), asked of a Python that has only what the member's has: the standard library,
    the stager's wheels (member_lib) and this checkout's code."""
    # -I -S: no site-packages, no .pth (the venv's editable install names the main checkout),
    # no PYTHONPATH. What the venv has beyond the wheels (pyOpenSSL, which botocore imports
    # only where it is installed) cannot be imported, as in the image.
    code = (
        f"import sys; sys.path[:0] = [{str(lib)!r}, {str(REPO_ROOT)!r}];"
        "import json, pipelines.stages.weights.ring;"
        "print(json.dumps({n: m.__file__ for n, m in sys.modules.items()"
        " if getattr(m, '__file__', None)}))"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code], cwd=lib, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def member_closure(lib: Path) -> set[str]:
    """The project files the member imports, relative to the repository."""
    return {
        str(Path(f).relative_to(REPO_ROOT))
        for name, f in member_imports(lib).items()
        if name.split(".")[0] == "pipelines"
    }


def test_the_image_carries_exactly_the_members_import_closure_and_what_it_stages_with(tmp_path):
    image = load_image(STAGER)
    closure = member_closure(member_lib(tmp_path))
    # stage.py is imported only once the member is complete (--stage-into).
    assert set(image.spec.project_files) == closure | {"pipelines/stages/weights/stage.py"}
    assert "pipelines/stages/weights/tasks.py" not in closure  # no doit in the member


def test_the_images_wheels_are_requirements_lock_pins_and_hashes():
    image = load_image(STAGER)
    wanted = pins_with_hashes((image.path / image.spec.wheels.requirements).read_text())
    locked = pins_with_hashes((REPO_ROOT / "requirements.lock").read_text())
    assert {"boto3", "urllib3", "msgspec", "pyyaml", "rich"} <= set(wanted)
    for name, (version, hashes) in wanted.items():
        assert locked[name] == (version, hashes), name


def test_every_third_party_module_the_member_imports_has_its_wheel(tmp_path):
    image = load_image(STAGER)
    wanted = set(pins_with_hashes((image.path / image.spec.wheels.requirements).read_text()))
    top = {name.split(".")[0] for name in member_imports(member_lib(tmp_path))}
    outside = {
        name
        for name in top - set(sys.stdlib_module_names) - {"pipelines"}
        if not name.startswith("_")
    }
    # Import names -> distribution names where they differ.
    dist = {
        "yaml": "pyyaml",
        "dateutil": "python-dateutil",
        "typing_extensions": "typing-extensions",
    }
    assert {dist.get(n, n) for n in outside} <= wanted, outside


def test_wheels_are_downloaded_for_the_images_platform_only_with_hashes():
    command = download_command(Path("r.txt"), "linux/arm64", "3.11", Path("d"))
    assert "--require-hashes" in command and "--only-binary=:all:" in command
    assert "--no-deps" in command
    assert command[command.index("--python-version") + 1] == "3.11"
    assert "manylinux_2_17_aarch64" in command and not any("x86_64" in c for c in command)
    with pytest.raises(ImageError, match="wheels for linux/riscv64: expected one of"):
        download_command(Path("r.txt"), "linux/riscv64", "3.11", Path("d"))


def test_a_wheel_whose_hash_differs_is_refused_naming_the_requirements_file(tmp_path):
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("six==1.17.0 --hash=sha256:" + "0" * 64 + "\n")
    with pytest.raises(ImageError, match=r"requirements.txt: pip download for linux/amd64 failed"):
        download_wheels(requirements, "linux/amd64", "3.11", tmp_path / "wheels")
    assert list((tmp_path / "wheels").glob("*.whl")) == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda spec: spec["project_files"].append("pipelines/stages/weights/nothing.py"),
            r"field 'project_files\[\d+\]': 'pipelines/stages/weights/nothing.py' is not a file",
        ),
        (
            lambda spec: spec["wheels"].update(requirements="missing.txt"),
            r"field 'wheels.requirements': no file 'missing.txt'",
        ),
        (
            lambda spec: spec["wheels"].update(python="3"),
            r"wheels.python",
        ),
    ],
)
def test_a_bad_image_yaml_is_one_line_naming_the_field(tmp_path, change, message):
    folder = tmp_path / STAGER
    shutil.copytree(IMAGES_DIR / STAGER, folder)
    spec = yaml.safe_load((folder / "image.yaml").read_text())
    change(spec)
    (folder / "image.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(ImageError, match=message):
        load_image(STAGER, folder=tmp_path)
