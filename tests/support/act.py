"""The one way the tests run a workflow: act, on the self-hosted platform (the job runs on this
machine, as on a lab's runner), every action mapped to its stand-in in tests/actions/, nothing
fetched, secrets and variables from files, its HOME and caches under a folder of the test's own."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent.parent
ACT = Path(sys.executable).parent / "act"
STAND_INS = REPO / "tests" / "actions"
# Which stand-in answers for which action; the exact refs come from the workflows themselves.
STAND_IN_FOR = {
    "actions/checkout": "checkout",
    "actions/upload-artifact": "upload-artifact",
    "actions/setup-python": "setup-python",
    "docker/login-action": "login-action",
    "docker/setup-buildx-action": "setup-buildx",
}
USES = re.compile(r"uses: ([\w.-]+/[\w.-]+)@([0-9a-f]{40})")
# act prints each step's summary in its log: `[job]   ⚙  Summary - FIRST LINE`, then the other
# lines as they are, up to the next line of the log (which starts with `[job]`).
SUMMARY = re.compile(r"^\[[^\]]+\]\s+\u2699\s+Summary - (.*)$")
TIMEOUT_S = 900


@dataclass(frozen=True)
class ActRun:
    """What one act run left: its exit code, its log, the job summaries, the artifacts folder."""

    returncode: int
    log: str
    summary: str
    artifacts: Path


@dataclass(frozen=True)
class Started:
    """An act run under way: its process, its folder (the log is folder/act.log), and how it
    was started (to start it again, see finish)."""

    process: subprocess.Popen[bytes]
    folder: Path
    command: list[str]
    cwd: Path
    env: dict[str, str]

    def log(self) -> str:
        """What act printed so far."""
        return (self.folder / "act.log").read_text(errors="replace")

    def again(self) -> Started:
        """The same act command started once more, in the same folder (its log anew, the first
        run's artifacts moved to artifacts.lost, so a test counts only the second run's)."""
        artifacts = self.folder / "artifacts"
        artifacts.rename(self.folder / "artifacts.lost")
        artifacts.mkdir()
        return launch(self.command, self.cwd, self.env, self.folder)


def launch(command: list[str], cwd: Path, env: dict[str, str], folder: Path) -> Started:
    """act's command started in cwd with env, its output to folder/act.log."""
    with (folder / "act.log").open("w") as log:
        process = subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return Started(process, folder, command, cwd, env)


# act logs a step as `[job] ⭐ Run Main NAME`, its output, then `[job]   ❌  Failure - Main NAME
# [duration]` when it failed.
STEP_RUN = re.compile(r"^(\[[^\]]+\]) \u2b50 Run (.+)$")
STEP_FAILED = re.compile(r"^(\[[^\]]+\])\s+\u274c\s+Failure - (.+) \[[^\]]*\]$")
JOB = re.compile(r"^(\[[^\]]+\])")


def silent_failure(log: str) -> str | None:
    """The first step that failed with no line of output between its start and its failure in
    act's log (`[job] step`), or None.

    Every failing step of these workflows prints its `::error::` line first, so such a step is
    act losing it: on the host, act returns from a step that exits non-zero without waiting for
    the copy of its terminal's output (pkg/container/host_environment.go, exec: the wait on the
    copy comes after `if err != nil { return err }`), and a step failing within milliseconds can
    lose all of it.
    """
    before: dict[str, str] = {}  # each job's previous line (jobs of a matrix interleave)
    for line in log.splitlines():
        failed = STEP_FAILED.match(line)
        if failed:
            ran = STEP_RUN.match(before.get(failed[1], ""))
            if ran and ran[2] == failed[2]:
                return f"{failed[1]} {failed[2]}"
        job = JOB.match(line)
        if job:
            before[job[1]] = line
    return None


def pinned_actions() -> set[tuple[str, str]]:
    """Every (owner/name, sha) the workflows use."""
    return {
        match
        for workflow in (REPO / ".github" / "workflows").glob("*.yml")
        for match in USES.findall(workflow.read_text())
    }


def local_repositories() -> list[str]:
    """act's --local-repository flags: each pinned action to its stand-in (an unknown one fails
    here, by name, rather than being fetched)."""
    flags = []
    for action, sha in sorted(pinned_actions()):
        if action in STAND_IN_FOR:
            flags += ["--local-repository", f"{action}@{sha}={STAND_INS / STAND_IN_FOR[action]}"]
    return flags


def wheelhouse() -> Path:
    """uv's wheel (the lock's pin, with its hashes) in a folder of the checkout's cache, fetched
    once (by the first worker to ask; the others wait for it): the runner's wheelhouse, from
    which each job's pip installs uv before uv installs the rest of the lock (uv_settings)."""
    import fcntl
    import hashlib
    import shutil

    # The lock's entry for uv, as scripts/venv took it from the lock for the venv running this.
    requirement = Path(sys.prefix) / "uv.requirements"
    digest = hashlib.sha256(requirement.read_bytes()).hexdigest()[:16]
    folder = REPO / ".cache" / f"wheelhouse-uv-{digest}"
    folder.parent.mkdir(exist_ok=True)
    with open(REPO / ".cache" / "wheelhouse.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if not folder.is_dir():
            partial = folder.with_name(folder.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--quiet",
                    "--no-deps",
                    "--only-binary=:all:",
                    "--require-hashes",
                    "-r",
                    str(requirement),
                    "--dest",
                    str(partial),
                ],  # fmt: skip
                check=True,
            )
            partial.rename(folder)  # complete, or absent
    return folder


def uv_settings() -> dict[str, str]:
    """A job's uv (scripts/venv) as a lab runner may set it: offline, from this machine's uv
    cache, which scripts/install filled with every wheel of the lock but uv (pip installs that
    one, from the wheelhouse). No index is asked and no wheel fetched again: each job's venv
    links the wheels uv unpacked once. The UV_* settings the install ran with go along, so the
    job's uv looks for the same index entries in the cache."""
    import os

    cache = subprocess.run(
        [str(Path(sys.executable).parent / "uv"), "cache", "dir"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    passed = {k: v for k, v in os.environ.items() if k.startswith("UV_")}
    return {**passed, "UV_OFFLINE": "1", "UV_CACHE_DIR": cache}


def dotenv(values: dict[str, str]) -> str:
    """KEY="value" lines act's --secret-file and --var-file read (multi-line values escaped)."""
    return "".join(f"{name}={json.dumps(value)}\n" for name, value in values.items())


def start_act(
    workflow: str,
    event: str,
    payload: dict,
    *,
    folder: Path,
    secrets: dict[str, str],
    variables: dict[str, str],
    env: dict[str, str],
    repository: str,
    platforms: tuple[str, ...] = ("self-hosted",),
    job: str | None = None,
    checkout: Path = REPO,
    other_repositories: dict[str, Path] | None = None,
) -> Started:
    """`act EVENT -W .github/workflows/WORKFLOW` with the payload, on the host, started in folder
    (its HOME, caches, secret and variable files, log and artifacts are all there), from the
    checkout (github.sha its HEAD); another repository a job checks out (owner/name) comes from
    its folder in other_repositories."""
    folder.mkdir(parents=True, exist_ok=True)
    home, artifacts = folder / "home", folder / "artifacts"
    for made in (home, artifacts):
        made.mkdir(exist_ok=True)
    (folder / "event.json").write_text(json.dumps(payload))
    (folder / "secrets").write_text(dotenv(secrets))
    (folder / "secrets").chmod(0o600)
    (folder / "vars").write_text(dotenv(variables))
    command = [
        str(ACT),
        event,
        "-W",
        f".github/workflows/{workflow}",
        "-e",
        str(folder / "event.json"),
        "--secret-file",
        str(folder / "secrets"),
        "--var-file",
        str(folder / "vars"),
        # Named, so a stray .env or .input in the checkout is never read.
        "--env-file",
        str(folder / "no.env"),
        "--input-file",
        str(folder / "no.input"),
        "--action-cache-path",
        str(folder / "act-cache"),
        "--cache-server-path",
        str(folder / "act-cache-server"),
        "--no-cache-server",
        "--action-offline-mode",
        # github.repository (act would make one of the checkout's remote)
        "--env",
        f"GITHUB_REPOSITORY={repository}",
        "--no-skip-checkout",
        *[flag for label in platforms for flag in ("-P", f"{label}=-self-hosted")],
        *(["-j", job] if job else []),
        *local_repositories(),
    ]
    environment = {
        **env,
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        # The runner's python3: the one the tests run on (Debian's 3.11.2 lacks tarfile's
        # extraction filters, which the image normalizer uses).
        "PATH": f"{Path(sys.base_prefix) / 'bin'}:/usr/sbin:/usr/bin:/sbin:/bin",
        "STANDIN_REPOSITORY": str(checkout),
        "STANDIN_ARTIFACTS": str(artifacts),
    }
    for name, where in (other_repositories or {}).items():  # as the checkout stand-in names it
        environment["STANDIN_" + re.sub(r"[^A-Z0-9]", "_", name.upper())] = str(where)
    return launch(command, checkout, environment, folder)


def finish(started: Started, timeout: float = TIMEOUT_S, rerun_lost: bool = True) -> ActRun:
    """The run once act has exited (killed past timeout); run once more where act lost the
    output of a failed step (silent_failure), its first log kept as act.lost.log."""
    try:
        returncode = started.process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        started.process.kill()
        started.process.wait()
        raise
    log = started.log()
    lost = silent_failure(log)
    if lost is not None and rerun_lost:
        print(f"act lost the output of the failed step {lost}: running the workflow again")
        (started.folder / "act.lost.log").write_text(log)
        return finish(started.again(), timeout, rerun_lost=False)
    return ActRun(returncode, log, job_summaries(log), started.folder / "artifacts")


def run_act(workflow: str, event: str, payload: dict, **options: Any) -> ActRun:
    """start_act's run, finished."""
    return finish(start_act(workflow, event, payload, **options))


def job_summaries(log: str) -> str:
    """The summaries the job's steps wrote, in order, as act's log shows them."""
    lines: list[str] = []
    taking = False
    for line in log.splitlines():
        if started := SUMMARY.match(line):
            lines.append(started[1])
            taking = True
        elif line.startswith("["):
            taking = False
        elif taking:
            lines.append(line)
    return "\n".join(lines) + "\n" if lines else ""
