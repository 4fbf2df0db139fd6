"""Building for an architecture other than this machine's: the kernel runs the foreign binaries
(debootstrap's maintainer scripts, an image's RUN steps) through qemu-user-static's binfmt_misc
handler, registered with the F flag so that a chroot or a container finds the interpreter
without a copy of it inside."""

from __future__ import annotations

from pathlib import Path

from pipelines.stages.images.spec import ImageError

BINFMT = Path("/proc/sys/fs/binfmt_misc")
# Debian architecture -> the name qemu-user-static registers its handler under.
QEMU_NAMES = {"arm64": "aarch64", "amd64": "x86_64"}
ENTRY_CAP = 4096  # a handler's entry is a few lines


def emulation_problem(arch: str, native: str) -> str | None:
    """Why this machine cannot run arch's binaries, or None when it can (arch is native, or its
    handler is registered, enabled and fixed)."""
    if arch == native:
        return None
    name = QEMU_NAMES.get(arch)
    if name is None:
        return f"no emulator is known for {arch}: expected one of {', '.join(QEMU_NAMES)}"
    entry = BINFMT / f"qemu-{name}"
    try:
        with open(entry, encoding="ascii", errors="replace") as f:
            lines = f.read(ENTRY_CAP).splitlines()
    except OSError:
        return f"{entry} is not registered"
    if lines[:1] != ["enabled"]:
        return f"{entry} is registered but not enabled"
    flags = next((line.split(":", 1)[1] for line in lines if line.startswith("flags:")), "")
    if "F" not in flags:
        return f"{entry} is registered without the F flag (a chroot would not find qemu)"
    return None


def require_emulation(arch: str, native: str) -> None:
    """Return when this machine runs arch's binaries; else one line saying what to do."""
    problem = emulation_problem(arch, native)
    if problem is not None:
        raise ImageError(
            f"building for linux/{arch} on this {native} machine needs qemu-user-static's"
            f" binfmt_misc handler: {problem}; `bash scripts/install` installs qemu-user-static,"
            " mounts binfmt_misc and registers it"
        )
