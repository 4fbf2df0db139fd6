"""Locked wheels for an image's context: downloaded by pip for the image's platform, hashes
checked against the requirements file (whose digest is already in the image's key)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pipelines.stages.images.spec import ImageError

LOG_TAIL = 5
# OCI platform -> the manylinux tags its wheels carry (glibc 2.17 and up: bookworm has 2.36).
PLATFORM_TAGS = {
    "linux/amd64": ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_28_x86_64"),
    "linux/arm64": ("manylinux_2_17_aarch64", "manylinux2014_aarch64", "manylinux_2_28_aarch64"),
}


def download_command(requirements: Path, platform: str, python: str, dest: Path) -> list[str]:
    """The pip invocation: binary wheels only, no resolver (the file lists every package), every
    file checked against its hash."""
    if platform not in PLATFORM_TAGS:
        raise ImageError(f"wheels for {platform}: expected one of {', '.join(PLATFORM_TAGS)}")
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
    command += ["--only-binary=:all:", "--require-hashes", "--dest", str(dest)]
    for tag in PLATFORM_TAGS[platform]:
        command += ["--platform", tag]
    return command + ["--python-version", python, "--implementation", "cp", "-r", str(requirements)]


def download_wheels(requirements: Path, platform: str, python: str, dest: Path) -> dict[str, Path]:
    """Context name (wheels/<file>) -> downloaded wheel; one line naming the file on failure."""
    dest.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        download_command(requirements, platform, python, dest), capture_output=True, text=True
    )
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if not line.startswith("WARNING")]
        tail = " | ".join(lines[-LOG_TAIL:])
        raise ImageError(f"{requirements}: pip download for {platform} failed: {tail}")
    return {f"wheels/{p.name}": p for p in sorted(dest.glob("*.whl"))}
