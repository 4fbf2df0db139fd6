"""Build conditions that must not reach an image's bytes, varied the way Debian's
reproducible-builds tools do (reprotest's variations): the clock (libfaketime, inside
debootstrap's chroot too), time zone, locale, umask, hostname, the user's environment, CPUs, and
the order directories list their files in (disorderfs). Not the kernel's reported version:
reprotest's `setarch --uname-2.6` makes libc6's preinst refuse to install ("requires kernel
version 3.2 or later"), so no base could be built under it."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

LIBFAKETIME = Path("/usr/lib") / f"{platform.machine()}-linux-gnu/faketime/libfaketime.so.1"


@dataclass(frozen=True)
class Variation:
    """One set of build conditions."""

    name: str
    clock: str = ""  # libfaketime's FAKETIME offset ("+40d"); "" for the real clock
    tz: str = ""
    lang: str = ""
    umask: int = 0o022
    hostname: str = ""
    cpus: str = ""  # taskset's list; "" for all
    shuffled: bool = False  # directories list their files in another order (disorderfs)
    home: str = ""
    # Variables of a user's environment that the tools inside read: set (a value) or removed
    # (None), whatever this machine has. A runner's PYTHONDONTWRITEBYTECODE once decided
    # whether a base's debpython .pyc were timestamped.
    variables: tuple[tuple[str, str | None], ...] = ()

    def describe(self) -> str:
        """What this variation changes, for records and failure lines."""
        parts = [
            f"clock {self.clock}" if self.clock else "",
            f"TZ={self.tz}" if self.tz else "",
            f"LANG={self.lang}" if self.lang else "",
            f"umask {self.umask:03o}" if self.umask != 0o022 else "",
            f"hostname {self.hostname}" if self.hostname else "",
            f"CPUs {self.cpus}" if self.cpus else "",
            "HOME/USER elsewhere" if self.home else "",
            *(
                f"{name} unset" if value is None else f"{name}={value}"
                for name, value in self.variables
            ),
            "files listed in another order (disorderfs)" if self.shuffled else "",
        ]
        return ", ".join(p for p in parts if p) or "as the machine is"

    def command(self, argv: list[str]) -> list[str]:
        """argv run under this variation's process conditions."""
        prefix: list[str] = []
        if self.cpus:
            prefix += ["taskset", "-c", self.cpus]
        # A UTS namespace of its own: the machine's hostname is left alone.
        script = 'umask "$1"; [ -z "$2" ] || hostname "$2"; shift 2; exec "$@"'
        umask = f"{self.umask:03o}"
        wrapped = ["sh", "-c", script, "sh", umask, self.hostname, *prefix, *argv]
        return ["unshare", "--uts", *wrapped] if self.hostname else wrapped

    def environment(self, base: dict[str, str]) -> dict[str, str]:
        """The environment of a build under this variation."""
        env = dict(base)
        if self.tz:
            env["TZ"] = self.tz
        if self.lang:
            env.update(LANG=self.lang, LC_ALL=self.lang, LANGUAGE=self.lang.split(".")[0])
        if self.home:
            env.update(HOME=self.home, USER="builder", LOGNAME="builder")
        for name, value in self.variables:
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        if self.clock:
            # Through /proc/PID/root of this long-lived process, the same path names the library
            # outside and inside debootstrap's chroot (once it mounts /proc): the maintainer
            # scripts see the moved clock too. NO_FAKE_STAT: a real clock change does not move
            # the times files already have.
            env.update(
                LD_PRELOAD=f"/proc/{os.getpid()}/root{LIBFAKETIME}",
                FAKETIME=self.clock,
                NO_FAKE_STAT="1",
                FAKETIME_DONT_FAKE_MONOTONIC="1",
            )
        return env


PLAIN = Variation("plain")
DAYS = Variation(
    "days",
    clock="+40d",
    tz="Pacific/Kiritimati",
    lang="fr_FR.UTF-8",
    umask=0o077,
    hostname="another-builder",
    cpus="0",
    shuffled=True,
    home="/tmp",
    variables=(("PYTHONDONTWRITEBYTECODE", None), ("PYTHONHASHSEED", "random")),
)
YEARS = Variation(
    "years",
    clock="+1130d",
    tz="America/Anchorage",
    lang="C.UTF-8",  # a locale every Debian has, the chroot's too
    umask=0o027,
    hostname="builder-of-2029",
    shuffled=True,
    home="/var/tmp",
    variables=(("PYTHONDONTWRITEBYTECODE", "1"), ("PYTHONHASHSEED", "0")),
)


def missing_tools() -> list[str]:
    """The programs the variations need that this machine lacks (scripts/install adds them)."""
    tools = ["unshare", "taskset", "disorderfs", "fusermount"]
    absent = [t for t in tools if shutil.which(t) is None]
    return absent + ([] if LIBFAKETIME.exists() else [str(LIBFAKETIME)])


@contextlib.contextmanager
def listed_in_another_order(folder: Path, where: Path) -> Iterator[Path]:
    """folder as seen through disorderfs at where/<name>: its directories list their entries
    in shuffled order; unmounted after."""
    mount = where / folder.name
    mount.mkdir(parents=True)
    subprocess.run(
        ["disorderfs", "--shuffle-dirents=yes", "--quiet", str(folder), str(mount)], check=True
    )
    try:
        yield mount
    finally:
        subprocess.run(["fusermount", "-u", str(mount)], check=False)
