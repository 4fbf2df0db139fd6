"""pip-compile style requirements files as the tests read and write them: pins and hashes."""

from __future__ import annotations

import re

PIN = re.compile(r"^([A-Za-z0-9_.-]+)==(\S+)")


def pins_with_hashes(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """name -> (version, hashes) of a pip-compile style requirements text."""
    found: dict[str, tuple[str, frozenset[str]]] = {}
    name = None
    for line in text.splitlines():
        match = PIN.match(line)
        if match:
            name = match.group(1).lower()
            found[name] = (match.group(2), frozenset())
        elif name and "--hash=sha256:" in line:
            version, hashes = found[name]
            found[name] = (version, hashes | {line.split("--hash=sha256:")[1].strip(" \\")})
    return found


def requirements_text(pins: dict[str, tuple[str, frozenset[str]]]) -> str:
    """The requirements text of pins, each with its --hash lines, as pip-compile writes them."""
    entries = []
    for name, (version, hashes) in sorted(pins.items()):
        lines = [f"{name}=={version}", *(f"    --hash=sha256:{h}" for h in sorted(hashes))]
        entries.append(" \\\n".join(lines) + "\n")
    return "".join(entries)
