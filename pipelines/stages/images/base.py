"""Base images made here: a Debian rootfs from debootstrap, packed as a one-layer OCI image.

Base images cannot be pulled on these machines, so the local profile's runtime builds on a
Debian made by debootstrap, for this machine's architecture or, under qemu-user-static, another
(emulation.py). No Docker engine is involved: the rootfs becomes a normalized layer directly,
and the image is pushed to the registry under its key.

Nothing of the build's surroundings reaches the bytes. debootstrap and the packages' maintainer
scripts run with SOURCE_DATE_EPOCH (shadow's pwconv writes that day as every account's last
change where it would write today's; Python's postinst compiles checked-hash .pyc files); what
records the build and is not needed at run time is removed (PRUNE: logs with their dates,
ldconfig's aux-cache with its stat times, ...); the layer pins entry order, owners and mtimes
(oci.py). tests/test_reproducible.py varies clock, zone, locale, umask, hostname, CPUs and file
order and holds two builds to one digest.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

from pipelines.core.progress import human_bytes, say
from pipelines.stages.images.debian_archive import fetch_debs, local_repository
from pipelines.stages.images.debian_lock import load_debian_lock
from pipelines.stages.images.emulation import require_emulation
from pipelines.stages.images.inputs import debian_arch
from pipelines.stages.images.oci import (
    Image,
    TarEntry,
    assemble,
    epoch_iso,
    normal_info,
    write_layer,
)
from pipelines.stages.images.spec import ImageError, LocalBase

# Caches, logs and docs: not needed at run time, and they differ from one debootstrap to the next.
PRUNE = (
    "var/cache/apt",
    "var/lib/apt/lists",
    "var/log",
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "var/cache/ldconfig/aux-cache",
    "etc/machine-id",
    "etc/hostname",
    "etc/resolv.conf",
)
# The image's PATH, and debootstrap's.
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


# dpkg's own defaults (security-mac, downgrade: DPKG_FORCE replaces them) and unsafe-io: no
# fsync per unpacked file. A rootfs half-written by a crash is thrown away, never used, so
# durability buys nothing; the fsyncs were half the wall time of an emulated arm64 build
# (343 s -> 180 s, one digest either way).
DPKG_FORCE = "security-mac,downgrade,unsafe-io"


# What of the caller's environment reaches debootstrap and the maintainer scripts: the dynamic
# loader's preload and libfaketime's settings, the one way to move the clock they read
# (tests/test_reproducible.py does), and nothing else. Any other variable may change what a
# script writes: PYTHONDONTWRITEBYTECODE, set on one runner and not on another, decided whether
# debpython's modules were left as timestamped .pyc (written when py3compile imported them) or
# compiled with checked hashes, two digests for one key.
PASSED_ON = ("LD_PRELOAD", "FAKETIME", "NO_FAKE_STAT", "FAKETIME_DONT_FAKE_MONOTONIC")


def build_environment(environ: dict[str, str], epoch: int) -> dict[str, str]:
    """The environment debootstrap runs in, the same on every machine: dated epoch (the
    maintainer scripts inherit it through chroot), dpkg told to skip its fsyncs, Python to
    write no .pyc on import (py3compile writes them, with checked hashes), a fixed PATH; of
    the caller's, only PASSED_ON. Locale and umask need no pin: debootstrap sets LANG=C and
    umask 022 itself, and tests/test_reproducible.py varies both (TZ too) to hold it so."""
    return {
        **{name: environ[name] for name in PASSED_ON if name in environ},
        "PATH": PATH,
        "SOURCE_DATE_EPOCH": str(epoch),
        "DPKG_FORCE": DPKG_FORCE,
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def debootstrap(
    spec: LocalBase, arch: str, names: list[str], mirror: str, rootfs: Path, epoch: int
) -> None:
    """Make the rootfs with debootstrap from a repository of exactly the locked .debs (checked
    by sha256 before, so no signature is asked of it), dated epoch; a failure shows the tail of
    its log."""
    command = ["debootstrap", f"--variant={spec.variant}", f"--arch={arch}", "--no-check-gpg"]
    command.append("--include=" + ",".join(names))  # every locked package, nothing resolved anew
    command += [spec.suite, str(rootfs), mirror]
    if shutil.which("debootstrap") is None:
        raise ImageError("debootstrap not found: `scripts/install` installs it")
    env = build_environment(dict(os.environ), epoch)
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        tail = " | ".join((result.stdout + result.stderr).strip().splitlines()[-5:])
        raise ImageError(f"debootstrap {spec.suite} failed (exit {result.returncode}): {tail}")
    for rel in PRUNE:
        path = rootfs / rel
        if path.is_dir() and not path.is_symlink():
            for child in path.iterdir():
                shutil.rmtree(
                    child
                ) if child.is_dir() and not child.is_symlink() else child.unlink()
        elif path.exists():
            path.unlink()


def rootfs_members(rootfs: Path, epoch: int) -> Iterator[TarEntry]:
    """(header, data) of every path below rootfs in sorted order; repeated inodes as links."""
    seen: dict[tuple[int, int], str] = {}
    paths = []
    for dirpath, dirnames, filenames in os.walk(rootfs):
        dirnames.sort()
        for name in dirnames + filenames:
            paths.append(Path(dirpath, name))
    for path in sorted(paths, key=lambda p: p.relative_to(rootfs).as_posix()):
        rel = path.relative_to(rootfs).as_posix()
        st = os.lstat(path)
        info = tarfile.TarInfo(rel)
        info.mode = stat.S_IMODE(st.st_mode)
        info.mtime = int(st.st_mtime)
        if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) in seen:
            info.type, info.linkname = tarfile.LNKTYPE, seen[(st.st_dev, st.st_ino)]
            yield normal_info(info, epoch), None
            continue
        if stat.S_ISREG(st.st_mode):
            if st.st_nlink > 1:
                seen[(st.st_dev, st.st_ino)] = rel
            info.size = st.st_size
            with open(path, "rb") as data:
                yield normal_info(info, epoch), data
            continue
        if stat.S_ISDIR(st.st_mode):
            info.type = tarfile.DIRTYPE
        elif stat.S_ISLNK(st.st_mode):
            info.type, info.linkname = tarfile.SYMTYPE, os.readlink(path)
        elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            info.type = tarfile.CHRTYPE if stat.S_ISCHR(st.st_mode) else tarfile.BLKTYPE
            info.devmajor, info.devminor = os.major(st.st_rdev), os.minor(st.st_rdev)
        elif stat.S_ISFIFO(st.st_mode):
            info.type = tarfile.FIFOTYPE
        else:
            continue  # sockets have no place in an image
        yield normal_info(info, epoch), None


def build_base(spec: LocalBase, lock: Path, arch: str, epoch: int, work: Path, debs: Path) -> Image:
    """The one-layer image of a fresh debootstrap rootfs for arch made from the lock's .debs
    (cached in debs by sha256), normalized, its blobs in work."""
    require_emulation(arch, debian_arch())
    refresh = f"doit lock_base (for {lock.parent.name})"
    locked = load_debian_lock(lock)
    wanted = locked.debs(spec, arch, lock, refresh)
    say("image", f"base: {len(wanted)} locked .debs, {human_bytes(sum(d.size for d in wanted))}")
    files = fetch_debs(locked, wanted, debs, str(lock), refresh)
    rootfs = work / "rootfs"
    repository = local_repository(locked, arch, files, work / "repo")
    debootstrap(spec, arch, [d.name for d in wanted], repository, rootfs, epoch)
    shutil.rmtree(work / "repo")
    layer, diff_id = write_layer(rootfs_members(rootfs, epoch), work)
    shutil.rmtree(rootfs)
    config = {
        "architecture": arch,
        "os": "linux",
        "created": epoch_iso(epoch),
        "config": {"Env": [f"PATH={PATH}"], "Cmd": ["/bin/sh"]},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [
            {
                "created": epoch_iso(epoch),
                "created_by": f"debootstrap --variant={spec.variant} {spec.suite}"
                + (f" --include={','.join(spec.packages)}" if spec.packages else ""),
            }
        ],
    }
    return assemble(config, [layer], work)
