"""The local base's Debian lock: the base is built from exactly the locked .debs; a mirror that
moved stops the build in one line naming the first package that moved; `doit lock_base`
refreshes the lock on purpose and says what moved, and the base built from the refreshed lock
holds what moved."""

from __future__ import annotations

import functools
import hashlib
import lzma
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler
from pathlib import Path

import msgspec
import pytest
from support import http_double, stages

from pipelines.core.profiles import load_profile
from pipelines.engine.steps import Engine
from pipelines.engine.store import Store
from pipelines.stages.images import Images
from pipelines.stages.images.base import build_base
from pipelines.stages.images.debian_archive import fetch_deb, lock_suite
from pipelines.stages.images.debian_lock import (
    BaseLockError,
    Deb,
    load_debian_lock,
    lock_changes,
    lock_file,
)
from pipelines.stages.images.inputs import debian_arch
from pipelines.stages.images.spec import load_image

REPO = Path(__file__).resolve().parent.parent
DEBS = REPO / ".cache" / "debs"  # the locked .debs, fetched by scripts/install
# The image whose base the others share (base: same_as): the one Debian lock.
LOCKED = "weights-stager"
BUMPED = "debconf"  # arch: all, 121 KB, in every minbase (apt needs it)


class ImagesOf(Images):
    """The images stage of `local` with its image read from another folder (a copy), named
    for that folder."""

    def __init__(self, folder: Path, engine: Engine):
        self.image = load_image(folder.name, folder.parent)  # before the steps are made
        super().__init__(stages.context(load_profile("local"), engine))
        self.image_name = folder.name


def control(deb: Path, *fields: str) -> list[str]:
    """Fields of a .deb's control file, as dpkg-deb reads them."""
    out = subprocess.run(
        ["dpkg-deb", "-f", str(deb), *fields], capture_output=True, text=True, check=True
    ).stdout
    if len(fields) == 1:  # one field: dpkg-deb prints its value alone
        return [out.strip()]
    values = dict(line.split(": ", 1) for line in out.splitlines())
    return [values[f] for f in fields]


def pool_name(deb: Path) -> str:
    """Where a mirror keeps a .deb: pool/main/<name>_<version without epoch>_<arch>.deb."""
    name, version, arch = control(deb, "Package", "Version", "Architecture")
    return f"pool/main/{name}_{version.split(':')[-1]}_{arch}.deb"


def index_mirror(root: Path, arch: str) -> None:
    """Packages (xz) and Release of the mirror's pool, as a Debian archive writes them."""
    dist = root / "dists" / "bookworm"
    binary = dist / "main" / f"binary-{arch}"
    binary.mkdir(parents=True, exist_ok=True)
    packages = subprocess.run(
        ["apt-ftparchive", "packages", "pool/main"], cwd=root, capture_output=True, check=True
    ).stdout
    (binary / "Packages.xz").write_bytes(lzma.compress(packages))
    write_release(root, arch)


def write_release(root: Path, arch: str) -> None:
    """The mirror's Release, listing the hash of its Packages index as it is now."""
    dist = root / "dists" / "bookworm"
    (dist / "Release").unlink(missing_ok=True)
    options = [
        "-oAPT::FTPArchive::Release::Suite=bookworm",
        "-oAPT::FTPArchive::Release::Codename=bookworm",
        "-oAPT::FTPArchive::Release::Components=main",
        f"-oAPT::FTPArchive::Release::Architectures={arch}",
    ]
    release = subprocess.run(
        ["apt-ftparchive", *options, "release", "."], cwd=dist, capture_output=True, check=True
    ).stdout
    (dist / "Release").write_bytes(release)


class QuietHandler(SimpleHTTPRequestHandler):
    """A static file server that keeps its access log to itself."""

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base's name)
        """Nothing: the test's output is the pipeline's."""


@pytest.fixture
def mirror(tmp_path) -> Iterator[tuple[str, Path]]:
    """A Debian mirror of the .debs scripts/install fetched, served on loopback: (url, root)."""
    debs = sorted(DEBS.iterdir()) if DEBS.is_dir() else []
    assert debs, f"{DEBS}: no .debs; run scripts/install"
    root = tmp_path / "mirror"
    for deb in debs:
        target = root / pool_name(deb)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(deb, target)
    index_mirror(root, debian_arch())
    handler = functools.partial(QuietHandler, directory=str(root))
    with http_double.serving(handler) as url:
        yield url, root


def bump(root: Path, name: str, suffix: str, in_place: bool) -> tuple[str, str]:
    """A new version of a package in the mirror's pool: (old version, new version)."""
    (old,) = (root / "pool" / "main").glob(f"{name}_*.deb")
    unpacked = root.parent / "unpacked"
    subprocess.run(["dpkg-deb", "-R", str(old), str(unpacked)], check=True)
    text = (unpacked / "DEBIAN" / "control").read_text()
    (version,) = control(old, "Version")
    (unpacked / "DEBIAN" / "control").write_text(
        text.replace(f"Version: {version}\n", f"Version: {version}{suffix}\n")
    )
    built = root.parent / "bumped.deb"
    subprocess.run(["dpkg-deb", "-b", str(unpacked), str(built)], check=True, capture_output=True)
    shutil.rmtree(unpacked)
    if in_place:  # other bytes under the locked name
        built.replace(old)
    else:  # a new version under its own name, the old one gone, the index rewritten
        old.unlink()
        built.replace(root / pool_name(built))
        index_mirror(root, debian_arch())
    return version, f"{version}{suffix}"


@pytest.mark.stack  # a Debian mirror served here, and a debootstrap
def test_a_mirror_that_moved_stops_the_build_and_a_refresh_gives_one_new_digest(
    mirror, tmp_path, capsys
):
    url, root = mirror
    folder = tmp_path / "images" / LOCKED
    shutil.copytree(REPO / "images" / LOCKED, folder)
    lock_file(folder).unlink()
    spec_file = folder / "image.yaml"
    packages = "    packages: [python3, nginx-light]\n"
    assert packages in spec_file.read_text()
    # The mirror's minbase alone: the lock's mechanics are the same for any package set, and
    # Python's postinst (the whole standard library compiled) would be most of each build.
    minbase = f"    mirror: {url}\n    packages: []\n"
    spec_file.write_text(spec_file.read_text().replace(packages, minbase))
    engine = Engine(Store(tmp_path / "store"))
    images = ImagesOf(folder, engine)
    local, arch = images.image.spec.base.local, debian_arch()
    assert local is not None and local.mirror == url
    epoch, lock = images.image.spec.source_date_epoch, lock_file(folder)

    images.lock_base()
    said = capsys.readouterr().out
    assert f"{LOCKED}: Release: nothing -> " in said
    first_key = engine.key(images.base_step)

    refresh = f"run `doit lock_base (for {LOCKED})` to refresh the lock"
    locked, _ = bump(root, BUMPED, "+sparkforge1", in_place=True)
    with pytest.raises(BaseLockError) as moved:
        build_base(local, lock, arch, epoch, tmp_path / "b2", tmp_path / "debs2")
    assert str(moved.value) == (
        f"{lock}: {BUMPED} {locked} moved: the mirror serves other bytes for"
        f" pool/main/{BUMPED}_{locked}_all.deb; {refresh}"
    )
    bump(root, BUMPED, "+sparkforge2", in_place=False)
    with pytest.raises(BaseLockError) as gone:
        build_base(local, lock, arch, epoch, tmp_path / "b3", tmp_path / "debs3")
    assert str(gone.value) == (
        f"{lock}: {BUMPED} {locked} moved: the mirror answers HTTP 404 for"
        f" pool/main/{BUMPED}_{locked}_all.deb; {refresh}"
    )
    assert not (tmp_path / "b3" / "rootfs").exists()

    images.lock_base()
    said = capsys.readouterr().out
    assert f"{LOCKED} {arch}: ~ {BUMPED} {locked} -> {locked}+sparkforge1+sparkforge2" in said
    assert said.count(f"{LOCKED} {arch}: ~ ") == 1  # only that package moved
    fresh = Engine(Store(tmp_path / "store"))  # a new process: keys are memoized per process
    second_key = fresh.key(ImagesOf(folder, fresh).base_step)
    assert second_key != first_key
    # Built from the refreshed lock, the base holds the version that moved (one debootstrap: a
    # build from the first lock would be another 25 CPU s; that two builds of one lock agree is
    # the reproducibility tests', test_reproducible*).
    again = build_base(local, lock, arch, epoch, tmp_path / "c", tmp_path / "cdebs")
    (layer,) = again.layers
    with tarfile.open(layer.path) as tar:
        status = tar.extractfile("var/lib/dpkg/status")
        assert status is not None
        stanzas = status.read().decode().split("\n\n")
    (installed,) = [stanza for stanza in stanzas if stanza.startswith(f"Package: {BUMPED}\n")]
    assert f"\nVersion: {locked}+sparkforge1+sparkforge2\n" in installed


@pytest.mark.parametrize(
    "filename",
    ["pool/../../etc/x.deb", "pool/main/../../../etc/x.deb", "/etc/x.deb", "pool/.x.deb"],
)
def test_a_lock_whose_names_could_leave_the_pool_is_refused_in_one_line(tmp_path, filename):
    text = lock_file(REPO / "images" / LOCKED).read_text()
    path = tmp_path / "debian.lock.yaml"
    first = text[text.index("filename: ") :].split(",")[0]
    path.write_text(text.replace(first, f"filename: {filename}", 1))
    with pytest.raises(BaseLockError) as refused:
        load_debian_lock(path)
    assert str(refused.value).startswith(f"{path}: field 'archs.[...].0.filename': expected `str`")


def test_a_lock_for_other_packages_than_image_yaml_asks_is_refused(tmp_path):
    image = load_image(LOCKED)
    assert image.spec.base.local is not None
    lock = load_debian_lock(lock_file(image.path))
    other = type(image.spec.base.local)(suite="bookworm", packages=["python3", "curl"])
    with pytest.raises(BaseLockError) as refused:
        lock.debs(other, debian_arch(), lock_file(image.path), "doit lock_base")
    assert str(refused.value) == (
        f"{lock_file(image.path)}: include: locked ['nginx-light', 'python3'], image.yaml asks"
        " ['curl', 'python3']; run `doit lock_base`"
    )


def test_what_moved_is_one_line_per_package():
    lock = load_debian_lock(lock_file(REPO / "images" / LOCKED))
    arch = debian_arch()
    first, second, *rest = lock.archs[arch]
    moved = msgspec.structs.replace(first, version="9.9")
    added = msgspec.structs.replace(second, name="zz-new")
    new = msgspec.structs.replace(lock, archs={arch: [moved, *rest, added]})
    assert lock_changes(lock, new, arch) == [
        f"~ {first.name} {first.version} -> 9.9",
        f"- {second.name} {second.version}",
        f"+ zz-new {second.version}",
    ]


@pytest.mark.stack  # a Debian mirror served here
def test_a_release_whose_signature_does_not_verify_is_refused_when_locking(mirror, tmp_path):
    # A loopback mirror may be unsigned; one that serves a signature must verify against
    # Debian's archive keyring.
    url, root = mirror
    (root / "dists" / "bookworm" / "Release.gpg").write_bytes(b"not a signature\n")
    spec = load_image(LOCKED).spec.base.local
    assert spec is not None
    with pytest.raises(BaseLockError) as refused:
        lock_suite(msgspec.structs.replace(spec, mirror=url), [debian_arch()])
    assert str(refused.value).startswith(
        f"Debian mirror: {url} bookworm: Release's signature does not verify against"
        " /usr/share/keyrings/debian-archive-keyring.gpg: "
    )


@pytest.mark.stack  # a Debian mirror served here
def test_a_packages_entry_naming_a_path_out_of_the_pool_is_refused_when_locking(mirror):
    # The index is the mirror's word: a locked entry is checked as a lock's entries are.
    url, root = mirror
    index = root / "dists" / "bookworm" / "main" / f"binary-{debian_arch()}" / "Packages.xz"
    text = lzma.decompress(index.read_bytes()).decode()
    hostile = text.replace(f"Filename: pool/main/{BUMPED}_", f"Filename: pool/../../{BUMPED}_", 1)
    assert hostile != text
    index.write_bytes(lzma.compress(hostile.encode()))
    write_release(root, debian_arch())  # the Release lists the altered index: it is consistent
    spec = load_image(LOCKED).spec.base.local
    assert spec is not None
    with pytest.raises(BaseLockError) as refused:
        lock_suite(msgspec.structs.replace(spec, mirror=url), [debian_arch()])
    assert str(refused.value).startswith(
        f"Debian mirror: {url} bookworm {debian_arch()}: package '{BUMPED}':"
        " field 'filename': expected `str` matching regex"
    )


def test_a_deb_whose_bytes_changed_at_its_locked_size_is_refused(mirror, tmp_path):
    # The size check alone would take it: only the sha256, computed as it streams, refuses.
    url, root = mirror
    path = next((root / "pool" / "main").glob("*.deb"))
    data = bytearray(path.read_bytes())
    locked = Deb(
        name="x",
        version="1",
        filename=str(path.relative_to(root)),
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
    )
    data[len(data) // 2] ^= 0xFF  # one byte flipped, the size the same
    path.write_bytes(bytes(data))
    cache = tmp_path / "cache"
    cache.mkdir()
    said = fetch_deb(url, locked, cache)
    assert said == f"the mirror serves other bytes for {locked.filename}"
    assert list(cache.iterdir()) == []  # nothing kept of what was refused
