"""A Debian mirror, read: its Release and Packages index to lock a base, the locked .debs fetched
by hash, and a local repository of exactly those .debs for debootstrap to build from."""

from __future__ import annotations

import hashlib
import lzma
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import urllib3

from pipelines.core.addresses import is_loopback_url
from pipelines.core.errors import Unreachable
from pipelines.core.files import describe_json_error
from pipelines.core.httpjson import HTTPError, http_pool
from pipelines.stages.images.debian_lock import BaseLockError, Deb, DebianLock, Release
from pipelines.stages.images.spec import ImageError, LocalBase

RELEASE_CAP = 1 << 20  # a suite's Release file is about 150 KB
PACKAGES_CAP = 1 << 28  # bookworm's main Packages.xz, unpacked: about 45 MB
FETCHERS = 8  # .debs fetched at once: a base is about a hundred small files
CHUNK = 1 << 20
KEYRING = (
    "/usr/share/keyrings/debian-archive-keyring.gpg"  # Debian's package debian-archive-keyring
)


def open_get(url: str) -> urllib3.BaseHTTPResponse:
    """A GET on the mirror, its body still to read; one line for a mirror that does not answer."""
    try:
        return http_pool().request("GET", url, preload_content=False, timeout=60)
    except HTTPError as err:
        raise Unreachable(f"Debian mirror: GET {url}: {err}") from None


def get(url: str, cap: int) -> bytes:
    """The body of a GET of at most cap bytes; one line for a missing file or a silent mirror."""
    r = open_get(url)
    try:
        if r.status != 200:
            raise BaseLockError(f"Debian mirror: GET {url}: HTTP {r.status}")
        body = r.read(cap + 1)
    finally:
        r.release_conn()
    if len(body) > cap:
        raise BaseLockError(f"Debian mirror: {url} is over {cap} bytes")
    return body


def stanzas(text: str) -> Iterator[dict[str, str]]:
    """The paragraphs of a Debian control file (Release, Packages), field -> value."""
    for paragraph in text.split("\n\n"):
        fields: dict[str, str] = {}
        last = ""
        for line in paragraph.splitlines():
            if line[:1] in (" ", "\t") and last:
                fields[last] += "\n" + line.strip()
            elif ":" in line:
                last, _, value = line.partition(":")
                fields[last] = value.strip()
        if fields:
            yield fields


def release_files(release: dict[str, str]) -> dict[str, tuple[str, int]]:
    """The files a Release lists under SHA256: path -> (sha256, size)."""
    listed = {}
    for line in release.get("SHA256", "").splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1].isdigit():
            listed[parts[2]] = (parts[0], int(parts[1]))
    return listed


def packages_index(
    mirror: str, suite: str, arch: str, release: dict[str, str]
) -> dict[str, dict[str, str]]:
    """The suite's main packages for arch, checked against the Release's sha256: name -> its
    stanza's fields (as the mirror wrote them: checked only for the packages locked)."""
    listed = release_files(release)
    index = f"main/binary-{arch}/Packages.xz"
    if index not in listed:
        raise BaseLockError(f"Debian mirror: {mirror} {suite}: Release lists no {index}")
    sha, size = listed[index]
    packed = get(f"{mirror}/dists/{suite}/{index}", PACKAGES_CAP)
    if len(packed) != size or hashlib.sha256(packed).hexdigest() != sha:
        raise BaseLockError(f"Debian mirror: {mirror} {suite}: {index} differs from its Release")
    try:
        text = lzma.LZMADecompressor().decompress(packed, PACKAGES_CAP).decode()
    except (lzma.LZMAError, UnicodeDecodeError) as err:
        raise BaseLockError(f"Debian mirror: {mirror} {suite}: {index}: {err}") from None
    debs: dict[str, dict[str, str]] = {}
    for fields in stanzas(text):
        debs.setdefault(fields.get("Package", ""), fields)
    return debs


def locked_deb(fields: dict[str, str], where: str) -> Deb:
    """A Packages stanza as a lock entry, checked as a lock's are: one line naming the field."""
    entry = {
        "name": fields.get("Package"),
        "version": fields.get("Version"),
        "filename": fields.get("Filename"),
        "size": int(fields["Size"]) if fields.get("Size", "").isdigit() else fields.get("Size"),
        "sha256": fields.get("SHA256"),
    }
    try:
        return msgspec.convert(entry, Deb)
    except msgspec.ValidationError as err:
        name = fields.get("Package")
        raise BaseLockError(f"{where}: package {name!r}: {describe_json_error(str(err))}") from None


def resolved_names(spec: LocalBase, arch: str) -> list[str]:
    """The packages debootstrap would install for spec on arch, as it resolves them today."""
    with tempfile.TemporaryDirectory(prefix="sparkforge-resolve-") as target:
        # Names only: versions and hashes come from the index lock_suite checked itself.
        command = ["debootstrap", "--print-debs", "--no-check-gpg", f"--variant={spec.variant}"]
        command.append(f"--arch={arch}")
        if spec.packages:
            command.append("--include=" + ",".join(spec.packages))
        result = subprocess.run(
            [*command, spec.suite, target, spec.mirror], capture_output=True, text=True
        )
    if result.returncode != 0:
        tail = " | ".join((result.stdout + result.stderr).strip().splitlines()[-3:])
        raise ImageError(f"debootstrap --print-debs {spec.suite} failed: {tail}")
    return sorted(set(result.stdout.split()))


def check_signature(spec: LocalBase, release: bytes) -> None:
    """Refuse a Release whose signature (Release.gpg) does not verify against Debian's archive
    keyring; only a mirror on a loopback address (this machine's own) may be unsigned."""
    url = f"{spec.mirror}/dists/{spec.suite}/Release.gpg"
    try:
        signature = get(url, RELEASE_CAP)
    except BaseLockError:
        if is_loopback_url(spec.mirror):
            return
        raise
    with tempfile.TemporaryDirectory(prefix="sparkforge-release-") as tmp:
        (Path(tmp) / "Release").write_bytes(release)
        (Path(tmp) / "Release.gpg").write_bytes(signature)
        result = subprocess.run(
            ["gpgv", "--keyring", KEYRING, "Release.gpg", "Release"],
            cwd=tmp,
            capture_output=True,
            text=True,
        )
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise BaseLockError(
            f"Debian mirror: {spec.mirror} {spec.suite}: Release's signature does not verify"
            f" against {KEYRING}: {last}"
        )


def lock_suite(spec: LocalBase, archs: list[str]) -> DebianLock:
    """The lock of spec's suite on its mirror today, for every architecture named (all of them
    against one Release, so that the lock names one state of the archive)."""
    release_bytes = get(f"{spec.mirror}/dists/{spec.suite}/Release", RELEASE_CAP)
    check_signature(spec, release_bytes)
    where = f"Debian mirror: {spec.mirror} {spec.suite}"
    release = next(stanzas(release_bytes.decode(errors="replace")), None)
    if release is None:
        raise BaseLockError(f"{where}: Release holds no fields")
    locked = {}
    for arch in sorted(set(archs)):
        index = packages_index(spec.mirror, spec.suite, arch, release)
        names = resolved_names(spec, arch)
        missing = [n for n in names if n not in index]
        if missing:
            raise BaseLockError(f"{where}: no {missing[0]} for {arch} in main")
        locked[arch] = [locked_deb(index[n], f"{where} {arch}") for n in names]
    return DebianLock(
        mirror=spec.mirror,
        suite=spec.suite,
        variant=spec.variant,
        include=list(spec.packages),
        release=Release(
            date=release.get("Date", ""), sha256=hashlib.sha256(release_bytes).hexdigest()
        ),
        archs=locked,
    )


def fetch_deb(mirror: str, deb: Deb, cache: Path) -> Path | str:
    """The .deb in the cache (by sha256), fetched and checked while it streams; else why not."""
    path = cache / deb.sha256
    if path.exists():  # written only once verified, below
        return path
    r = open_get(f"{mirror}/{deb.filename}")
    try:
        if r.status != 200:
            return f"the mirror answers HTTP {r.status} for {deb.filename}"
        sha = hashlib.sha256()
        with tempfile.NamedTemporaryFile(dir=cache, prefix=".deb-", delete=False) as tmp:
            try:
                for chunk in r.stream(CHUNK):
                    sha.update(chunk)
                    tmp.write(chunk)
                    if tmp.tell() > deb.size:
                        break
                size = tmp.tell()
                if (size, sha.hexdigest()) != (deb.size, deb.sha256):
                    return f"the mirror serves other bytes for {deb.filename}"
                os.replace(tmp.name, path)
            finally:
                if os.path.exists(tmp.name):
                    os.unlink(tmp.name)
    finally:
        r.release_conn()
    return path


def fetch_debs(
    lock: DebianLock, debs: list[Deb], cache: Path, where: str, refresh: str
) -> list[Path]:
    """Every locked .deb from the cache or the mirror, by sha256; the first (by name) that the
    mirror no longer serves as locked stops the build in one line."""
    cache.mkdir(parents=True, exist_ok=True)
    ordered = sorted(debs, key=lambda d: d.name)
    with ThreadPoolExecutor(FETCHERS) as pool:
        got = list(pool.map(lambda d: fetch_deb(lock.mirror, d, cache), ordered))
    for deb, result in zip(ordered, got, strict=True):
        if isinstance(result, str):
            raise BaseLockError(
                f"{where}: {deb.name} {deb.version} moved: {result}; run `{refresh}`"
                " to refresh the lock"
            )
    return [p for p in got if isinstance(p, Path)]


def local_repository(lock: DebianLock, arch: str, debs: list[Path], folder: Path) -> str:
    """A repository of exactly these .debs (apt-ftparchive's index), as a file:// mirror."""
    if shutil.which("apt-ftparchive") is None:
        raise ImageError("apt-ftparchive not found: `scripts/install` installs apt-utils")
    pool = folder / "pool"
    pool.mkdir(parents=True)
    for n, deb in enumerate(debs):
        target = pool / f"{n:04d}.deb"  # names are the index's business, not the pool's
        try:
            os.link(deb, target)
        except OSError:  # another filesystem
            shutil.copyfile(deb, target)
    dist = folder / "dists" / lock.suite
    binary = dist / "main" / f"binary-{arch}"
    binary.mkdir(parents=True)
    packages = run_tool(["apt-ftparchive", "packages", "pool"], folder)
    (binary / "Packages").write_text(packages)
    settings = {
        "Suite": lock.suite,
        "Codename": lock.suite,
        "Components": "main",
        "Architectures": arch,
    }
    options = [f"-oAPT::FTPArchive::Release::{k}={v}" for k, v in settings.items()]
    (dist / "Release").write_text(run_tool(["apt-ftparchive", *options, "release", "."], dist))
    return f"file://{folder}"


def run_tool(command: list[str], cwd: Path) -> str:
    """A tool's output, or one line with its error."""
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise ImageError(f"{command[0]} {command[1]} failed: {result.stderr.strip()[-300:]}")
    return result.stdout


def main() -> None:
    """`python -m pipelines.stages.images.debian_archive fetch LOCK FOLDER`: the lock's .debs
    for this machine into FOLDER by sha256 (scripts/install: the tests' Debian mirror)."""
    import sys

    from pipelines.core.errors import BadInput
    from pipelines.stages.images.debian_lock import load_debian_lock
    from pipelines.stages.images.inputs import debian_arch

    if len(sys.argv) != 4 or sys.argv[1] != "fetch":
        raise BadInput("usage: python -m pipelines.stages.images.debian_archive fetch LOCK FOLDER")
    path, folder = Path(sys.argv[2]), Path(sys.argv[3])
    lock = load_debian_lock(path)
    arch = debian_arch()
    if arch not in lock.archs:
        raise BaseLockError(f"{path}: archs.{arch}: not locked")
    fetch_debs(lock, lock.archs[arch], folder, str(path), "doit lock_base")


if __name__ == "__main__":
    from pipelines.core.errors import run_main

    run_main(main)
