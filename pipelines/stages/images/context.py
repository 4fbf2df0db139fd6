"""Build contexts: the files `.dockerignore` lets through, digested and sent as a normal tar."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

from pipelines.engine.keys import canonical_json
from pipelines.engine.statcache import StatCache


def dockerignore_patterns(root: Path) -> list[str]:
    """The patterns of root/.dockerignore (none when absent)."""
    path = root / ".dockerignore"
    if not path.is_file():
        return []
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


def context_files(root: Path, extra: dict[str, Path]) -> dict[str, Path]:
    """Context name -> source path, sorted: the folder (.dockerignore applied) plus extra files."""
    patterns = dockerignore_patterns(root)
    if patterns:
        from docker.utils.build import exclude_paths  # Docker's own .dockerignore rules

        names = exclude_paths(str(root), patterns, dockerfile="Dockerfile")
    else:
        # Without patterns Docker sends everything: no need to load its SDK to know that.
        names = {
            os.path.relpath(os.path.join(folder, name), root)
            for folder, dirs, files in os.walk(root)
            for name in dirs + files
        }
    files = {name: root / name for name in names}
    files.update(extra)
    return dict(sorted(files.items()))


def normal_mode(mode: int) -> int:
    """0755 or 0644 by the executable bit: a checkout's umask must not change an image."""
    return 0o755 if mode & 0o111 else 0o644


@dataclass(frozen=True)
class BuildContext:
    """An image's build context as a step input: digested as the engine would receive it."""

    root: Path
    extra: dict[str, Path]

    def digest(self, statcache: StatCache) -> tuple[str, dict[str, str]]:
        """(context digest, name -> file digest) for the key and for `explain`."""
        return context_listing(self.root, statcache, self.extra)


def context_listing(
    root: Path, statcache: StatCache, extra: dict[str, Path]
) -> tuple[str, dict[str, str]]:
    """(digest of names, modes and contents, name -> file digest or kind)."""
    files = context_files(root, extra)
    regular = [p for p in files.values() if p.is_file() and not p.is_symlink()]
    digests = statcache.digest_files(regular)
    listing: list[list[str | int]] = []  # [name, kind, (mode,) target or digest]
    for name, path in files.items():
        st = os.lstat(path)
        if path.is_symlink():
            listing.append([name, "link", os.readlink(path)])
        elif path.is_dir():
            listing.append([name, "dir"])
        else:
            listing.append([name, "file", normal_mode(st.st_mode), digests[path.absolute()]])
    digest = hashlib.sha256(canonical_json(listing)).hexdigest()
    return digest, {str(entry[0]): str(entry[-1]) for entry in listing}


def context_tar(root: Path, epoch: int, extra: dict[str, Path]) -> io.BytesIO:
    """The build context as a tar with sorted entries, owner 0 and mtimes at the epoch."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, path in context_files(root, extra).items():
            info = tar.gettarinfo(str(path), arcname=name)
            info.mtime = epoch
            info.mode = 0o755 if info.isdir() else normal_mode(info.mode)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if info.isreg():
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    buf.seek(0)
    return buf
