"""A skip is a test that did not run: allowed where the machine lacks something, never on CI's.

CI runs on one machine kind (2 cores, root, the checkout on ext4). A test that skips there
never runs anywhere that counts, so the session fails and names it; elsewhere (one core, no
root, another filesystem) a machine-dependent skip stays a skip. `-rs` prints each reason.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CI_CORES = 2
CI_FILESYSTEM = "ext4"


def filesystem_of(path: Path) -> str:
    """The type of the filesystem path lives on, from /proc/self/mountinfo ("" if unknown)."""
    path = path.resolve()
    best, kind = -1, ""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        fields = line.split()
        if "-" not in fields:
            continue
        # Octal escapes (\040 for a space) as the kernel writes mount points.
        mount = Path(fields[4].encode().decode("unicode_escape"))
        fstype = fields[fields.index("-") + 1]
        if (path == mount or mount in path.parents) and len(mount.parts) > best:
            best, kind = len(mount.parts), fstype
    return kind


def is_ci_kind(cores: int | None, uid: int, filesystem: str) -> bool:
    """Whether a machine with these facts is of the kind CI runs the suite on."""
    return cores == CI_CORES and uid == 0 and filesystem == CI_FILESYSTEM


def this_machine_is_ci_kind(checkout: Path) -> bool:
    """Whether this machine, with the checkout where it is, is of CI's kind."""
    return is_ci_kind(os.cpu_count(), os.geteuid(), filesystem_of(checkout))


class SkipPolicy:
    """Collects skipped tests and fails the session for them on CI's machine kind."""

    def __init__(self, checkout: Path):
        self.checkout = checkout
        self.skipped: list[str] = []

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Note each test that skipped (in setup or in its body)."""
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skipped.append(report.nodeid)

    @pytest.hookimpl
    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        """Note each module skipped whole while it was collected (a module-level skip)."""
        if report.skipped:
            self.skipped.append(report.nodeid)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Fail a session that skipped a test on CI's machine kind (a worse end stays as is)."""
        ok = session.exitstatus == pytest.ExitCode.OK
        if ok and self.skipped and this_machine_is_ci_kind(self.checkout):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter) -> None:
        """Say why the session fails for its skips."""
        if self.skipped and this_machine_is_ci_kind(self.checkout):
            terminalreporter.write_line(
                f"error: {len(self.skipped)} test(s) skipped on the machine kind CI uses"
                f" ({CI_CORES} cores, root, {CI_FILESYSTEM}), where every test must run:"
                f" {', '.join(self.skipped)}",
                red=True,
            )
