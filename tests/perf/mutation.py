"""Mutation testing (mutmut) of one group of modules: the score per module and the survivors.

Run: .venv/bin/python tests/perf/mutation.py [engine|fetch|validators|all ...]
         [--again] [--workdir DIR] [--max-children N] [--diffs]

Too slow for CI (minutes per group on 2 cores): run it after changing a module or its tests.
Each group runs in its own scratch copy of the checkout (tracked and untracked-not-ignored
files) under --workdir, default $TMPDIR/sparkforge-mutation/GROUP; mutmut writes its mutants/
there, so nothing lands in the repository and the repository's .store is never read (the runs
get a store of their own). The [tool.mutmut] section of pyproject.toml is copied with
only_mutate and the test selection narrowed to the group. Tests reach the local stack that
scripts/stack runs ($SPARKFORGE_STACK_DIR, else the checkout's .stack/), shared by every run
as $SPARKFORGE_TEST_STACK_DIR: used as it is, never started or stopped by a run.

mutmut runs a mutant only against the tests that called the mutated function, and it sees
calls in its own process only. Most of the engine runs in the doit subprocesses the tests
start, so the copy gets two hooks (WORKDIR/hooks, on PYTHONPATH): a sitecustomize that, in a
subprocess started by a test during mutmut's stats run, hands the functions it called back to
that test, and a pytest plugin that tells mutmut. A mutant still without a test ("no tests")
is run against the group's whole selection (MUTANT_UNDER_TEST reaches the subprocesses too).
For `fetch`, the synthetic model is uploaded once under a prefix of the run's own
($SPARKFORGE_TEST_SYNTHETIC for tests/test_weights.py) and deleted at the end; processes a
timed-out mutant run left behind are killed.

Score: killed (a test failed, or the run timed out) / all mutants of the module. Survivors are
listed by name; their diffs are written to WORKDIR/survivors.diff (--diffs prints them).
`cd WORKDIR && mutmut show NAME` shows one. --again reuses the scratch copy, takes the current
tests and re-tests only the mutants that were not killed (a changed module means a fresh run).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

GROUPS: dict[str, tuple[list[str], list[str]]] = {
    # group: (modules to mutate, the tests that cover them)
    "engine": (
        [
            "pipelines/engine/keys.py",
            "pipelines/engine/store.py",
            "pipelines/engine/statcache.py",
            "pipelines/engine/steps.py",
        ],
        ["tests/test_steps.py", "tests/test_breakages.py"],
    ),
    "fetch": (
        [
            "pipelines/stages/weights/fetch.py",
            "pipelines/stages/weights/ranges.py",
            "pipelines/stages/weights/blobs.py",
        ],
        ["tests/test_weights.py", "tests/test_weights_ranges.py"],
    ),
    # validate.py and the layers it calls: the CRD schemas, the operator's rules, policy.
    "validators": (
        [
            "pipelines/stages/render/validate.py",
            "pipelines/stages/render/operator_rules.py",
            "pipelines/stages/render/crd_schema.py",
            "pipelines/stages/render/cache_mounts.py",
            "pipelines/stages/render/violations.py",
        ],
        ["tests/test_render.py", "tests/test_operator.py"],
    ),
}

# Groups whose tests fetch the synthetic model: uploaded once per run, not once per test run.
SHARED_MODEL = {"fetch"}

# mutmut's exit codes (mutmut.stats.status_by_exit_code); killed and timeout count as killed.
KILLED = {1, 3, 36, 24, -24, 152, 255}
NO_TESTS = {5, 33}


# Imported by every Python process whose PYTHONPATH has WORKDIR/hooks: in one started by a
# test during mutmut's stats run, keep the functions it called for the plugin below.
SITECUSTOMIZE = """
import atexit, json, os, sys

def _hand_back_hits():
    if os.environ.get("MUTANT_UNDER_TEST") != "stats" or "mutmut.state" not in sys.modules:
        return
    hits = sorted(sys.modules["mutmut.state"].state()._stats)
    if hits:
        path = os.path.join(os.environ["SPARKFORGE_MUTATION_HITS"], f"{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"test": os.environ["SPARKFORGE_MUTATION_TEST"], "hits": hits}, f)
        os.rename(path + ".tmp", path)

if os.environ.get("SPARKFORGE_MUTATION_TEST") and os.environ.get("SPARKFORGE_MUTATION_HITS"):
    atexit.register(_hand_back_hits)
"""

# A pytest plugin (-p mutation_hits): names the running test to the subprocesses it starts,
# and adds what they called to mutmut's record of the test (before mutmut reads it). With a
# mutant on, it runs the quickest tests first: a killed mutant is then known sooner.
PLUGIN = """
import json, os
from pathlib import Path

import pytest

# pipelines.core.progress takes sys.stderr as a default argument when first imported: imported by
# a test module inside one pytest session it would keep that session's capture stream, closed
# when the session ends, for the later sessions mutmut runs in the same process.
import pipelines.core.progress  # noqa: F401

@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    if "__mutmut_" not in os.environ.get("MUTANT_UNDER_TEST", ""):
        return
    from mutmut.state import state
    durations = state().duration_by_test
    items.sort(key=lambda item: durations.get(item.nodeid, 0.0))

@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    os.environ["SPARKFORGE_MUTATION_TEST"] = item.nodeid

@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    folder = os.environ.get("SPARKFORGE_MUTATION_HITS")
    if not folder or os.environ.get("MUTANT_UNDER_TEST") != "stats":
        return
    from mutmut.state import state
    for path in Path(folder).glob("*.json"):
        data = json.loads(path.read_text())
        if data["test"] == item.nodeid:
            state()._stats.update(data["hits"])
            path.unlink()
"""


def log(message: str) -> None:
    print(message, flush=True)


def checkout_files() -> list[str]:
    """The checkout's files: tracked, and untracked ones git does not ignore (new tests)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    return sorted({name for name in out.decode().split("\0") if name and (REPO / name).is_file()})


def sync_copy(work: Path) -> None:
    """Copy the checkout into work, keeping mtimes (mutmut compares them with its mutants')."""
    for name in checkout_files():
        source, target = REPO / name, work / name
        if target.is_file() and target.read_bytes() == source.read_bytes():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


def toml_value(value) -> str:
    """A TOML value for the strings, lists and scalars of [tool.mutmut] (JSON is valid there)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value)


def write_config(work: Path, modules: list[str], tests: list[str]) -> None:
    """The copy's pyproject.toml with [tool.mutmut] narrowed to one group (kept last: the
    doit projects that tests/test_steps.py makes copy the file from [tool.doit] on, and a
    mutated function called there during mutmut's stats run reads this section)."""
    text = (REPO / "pyproject.toml").read_text()
    config = dict(tomllib.loads(text)["tool"]["mutmut"])
    config.update(only_mutate=modules, pytest_add_cli_args_test_selection=tests)
    config["pytest_add_cli_args"] = [*config.get("pytest_add_cli_args", []), "-p", "mutation_hits"]
    start = text.index("[tool.mutmut]")
    following = text.find("\n[", start + 1)
    rest = "" if following < 0 else text[following:]
    section = "[tool.mutmut]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in config.items())
    (work / "pyproject.toml").write_text(text[:start] + rest.lstrip("\n") + "\n" + section)


def module_digest(modules: list[str]) -> str:
    """One digest of the group's source files (a change means its mutants change)."""
    digest = hashlib.sha256()
    for module in modules:
        digest.update(module.encode() + b"\0" + (REPO / module).read_bytes())
    return digest.hexdigest()


@contextlib.contextmanager
def shared_synthetic() -> Iterator[dict[str, str]]:
    """The synthetic model uploaded once, under a prefix of its own, for every test run of a
    group (tests/test_weights.py would upload it per run: 5 s each); deleted afterwards."""
    sys.path.insert(0, str(REPO))
    import devstack
    from devstack.settings import StackDown
    from pipelines.stages.weights.synthetic import SyntheticShape, upload_synthetic

    stack_dir = stack_folder()
    try:
        endpoints = devstack.read_endpoints(stack_dir)
    except StackDown as down:
        raise SystemExit(f"mutation: {down}") from None
    client = devstack.s3_client(endpoints, devstack.s3_credentials(stack_dir))
    prefix = f"mutation-{uuid.uuid4().hex[:8]}"
    source = f"s3://models/{prefix}/DeepSeek-V4.1-Flash-synthetic"
    try:
        upload_synthetic(client, source, SyntheticShape())
        yield {"SPARKFORGE_TEST_SYNTHETIC": source}
    finally:
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket="models", Prefix=f"{prefix}/"
        ):
            keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket="models", Delete={"Objects": keys, "Quiet": True})
        # SeaweedFS keeps the emptied folders as entries of their own.
        for folder in (f"{source.removeprefix('s3://models/')}/", f"{prefix}/"):
            client.delete_object(Bucket="models", Key=folder)


def stack_folder() -> str:
    """The local stack the tests use: $SPARKFORGE_STACK_DIR, else the checkout's .stack/."""
    return os.environ.get("SPARKFORGE_STACK_DIR") or str(REPO / ".stack")


def environment(work: Path) -> dict[str, str]:
    """Env of every run: the mutated package first on the path (subprocesses too), the
    stack's folder, a store of the run's own."""
    env = {k: v for k, v in os.environ.items() if k != "MUTANT_UNDER_TEST"}
    env["PYTHONPATH"] = os.pathsep.join([str(work / "mutants"), str(work / "hooks")])
    env["SPARKFORGE_MUTATION_HITS"] = str(work / "hits")
    env["SPARKFORGE_STACK_DIR"] = stack_folder()
    env["SPARKFORGE_TEST_STACK_DIR"] = stack_folder()  # tests/conftest.py: the shared stack
    env["SPARKFORGE_STORE"] = str(work / "store")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def reap_leftovers(work: Path) -> None:
    """Kill what tests of this run started and a killed mutant run left behind (a subprocess
    whose test timed out): processes whose environment carries this run's hits folder."""
    marker = f"SPARKFORGE_MUTATION_HITS={work / 'hits'}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if marker in (proc / "environ").read_bytes().split(b"\0"):
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:
            continue


def read_results(work: Path, modules: list[str]) -> dict[str, dict[str, int | None]]:
    """Module -> mutant name -> exit code, from mutmut's meta files."""
    results = {}
    for module in modules:
        meta = work / "mutants" / f"{module}.meta"
        results[module] = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
    return results


def write_results(work: Path, module: str, codes: dict[str, int]) -> None:
    """Record exit codes in mutmut's meta file (so `mutmut results` and --again see them)."""
    meta_path = work / "mutants" / f"{module}.meta"
    meta = json.loads(meta_path.read_text())
    meta["exit_code_by_key"].update(codes)
    meta_path.write_text(json.dumps(meta, indent=4))


def pytest_argv(tests: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]


def whole_selection_pass(
    work: Path, env: dict[str, str], tests: list[str], names: list[str], children: int
) -> dict[str, int]:
    """Exit code of the whole selection with each mutant on (mutants no test calls in-process)."""
    started = time.monotonic()
    clean = subprocess.run(
        pytest_argv(tests), cwd=work / "mutants", env=env, capture_output=True, text=True
    )
    if clean.returncode != 0:
        sys.exit(f"the selection fails without a mutant:\n{clean.stdout[-3000:]}")
    limit = max(60.0, 5 * (time.monotonic() - started))

    def one(name: str) -> int:
        try:
            return subprocess.run(
                pytest_argv(tests),
                cwd=work / "mutants",
                env={**env, "MUTANT_UNDER_TEST": name},
                capture_output=True,
                timeout=limit,
            ).returncode
        except subprocess.TimeoutExpired:
            return 36

    with concurrent.futures.ThreadPoolExecutor(children) as pool:
        return dict(zip(names, pool.map(one, names), strict=True))


SHOW = """
import sys
from mutmut.__main__ import show
for name in sys.argv[1:]:
    show.callback(name)
"""


def survivor_diffs(work: Path, env: dict[str, str], names: list[str]) -> str:
    """`mutmut show` of each survivor, in one process."""
    if not names:
        return ""
    shown = subprocess.run(
        [sys.executable, "-c", SHOW, *names],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    return shown.stdout + shown.stderr


def status(code: int | None) -> str:
    if code in KILLED:
        return "killed" if code in (1, 3) else "timeout"
    if code == 0:
        return "survived"
    if code in NO_TESTS:
        return "no tests"
    return "not checked" if code is None else f"suspicious (exit {code})"


def run_group(group: str, args: argparse.Namespace) -> dict:
    with contextlib.ExitStack() as cleanup:
        modules, tests = GROUPS[group]
        extra = cleanup.enter_context(shared_synthetic()) if group in SHARED_MODEL else {}
        return run_in_copy(group, modules, tests, extra, args)


def run_mutmut(group: str, work: Path, env: dict[str, str], children: int, names: list[str]):
    """`mutmut run` in work (of the named mutants, else of every one without a verdict)."""
    argv = [str(BIN / "mutmut"), "run", "--max-children", str(children), *names]
    log(f"{group}: {' '.join(argv[:4])}{f' ({len(names)} mutants)' if names else ''}")
    with (work / "mutmut.log").open("a") as out:
        result = subprocess.run(argv, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)
    reap_leftovers(work)
    if result.returncode != 0:
        tail = (work / "mutmut.log").read_text()[-4000:]
        sys.exit(f"{group}: mutmut failed (exit {result.returncode}):\n{tail}")


def run_in_copy(
    group: str, modules: list[str], tests: list[str], extra: dict[str, str], args
) -> dict:
    work = (args.workdir or Path(tempfile.gettempdir()) / "sparkforge-mutation") / group
    digest = module_digest(modules)
    stamp = work / "sources.sha256"
    again = args.again and stamp.exists() and stamp.read_text() == digest
    if args.again and not again:
        log(f"{group}: no earlier run of these sources in {work}: a fresh run")
    if not again:
        shutil.rmtree(work, ignore_errors=True)
    # mutants/ exists before mutmut starts: a PYTHONPATH entry missing at start-up is cached
    # as "no such folder" and the package would then come from the editable install.
    (work / "mutants").mkdir(parents=True, exist_ok=True)
    (work / "hits").mkdir(exist_ok=True)
    (work / "hooks").mkdir(exist_ok=True)
    (work / "hooks" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (work / "hooks" / "mutation_hits.py").write_text(PLUGIN)
    sync_copy(work)
    env = environment(work) | extra
    write_config(work, modules, tests)
    names: list[str] = []
    if again:
        previous = read_results(work, modules)
        names = [n for codes in previous.values() for n, c in codes.items() if c not in KILLED]
        if not names:
            log(f"{group}: every mutant was already killed")
    started = time.monotonic()
    if not again or names:
        run_mutmut(group, work, env, args.max_children, names)
        # A changed setting (pytest arguments, timeouts) makes mutmut forget earlier verdicts:
        # the mutants it was not asked about are then tested too.
        if names and any(
            c is None for codes in read_results(work, modules).values() for c in codes.values()
        ):
            run_mutmut(group, work, env, args.max_children, [])
    mutmut_s = time.monotonic() - started

    started = time.monotonic()
    results = read_results(work, modules)
    orphans = {n: m for m, codes in results.items() for n, c in codes.items() if c in NO_TESTS}
    if orphans:
        log(f"{group}: {len(orphans)} mutants without an in-process test: the whole selection")
        codes = whole_selection_pass(work, env, tests, sorted(orphans), args.max_children)
        reap_leftovers(work)
        for module in modules:
            mine = {n: c for n, c in codes.items() if orphans[n] == module}
            if mine:
                write_results(work, module, mine)
        results = read_results(work, modules)
    selection_s = time.monotonic() - started
    stamp.write_text(digest)

    survivors = [n for codes in results.values() for n, c in codes.items() if c not in KILLED]
    diffs = survivor_diffs(work, env, survivors)
    (work / "survivors.diff").write_text(diffs)

    summary = {
        "group": group,
        "workdir": str(work),
        "again": again,
        "mutmut_s": round(mutmut_s, 1),
        "whole_selection_s": round(selection_s, 1),
        "modules": {},
    }
    total = killed = 0
    log("")
    for module, codes in results.items():
        dead = sum(1 for c in codes.values() if c in KILLED)
        total, killed = total + len(codes), killed + dead
        pct = 100 * dead / len(codes) if codes else 100.0
        left = {n: status(c) for n, c in sorted(codes.items()) if c not in KILLED}
        summary["modules"][module] = {"killed": dead, "total": len(codes), "survivors": left}
        log(f"{module:<32} {dead:>4} / {len(codes):<4} killed  {pct:5.1f}%")
        for name, state in left.items():
            log(f"    {state:<10} {name}")
    pct = 100 * killed / total if total else 100.0
    summary.update(killed=killed, total=total)
    log(
        f"{group}: {killed} / {total} killed ({pct:.1f}%); mutmut {mutmut_s:.0f} s, whole-selection"
        f" pass {selection_s:.0f} s; diffs of survivors: {work / 'survivors.diff'}"
    )
    if args.diffs:
        log(diffs)
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("groups", nargs="*", default=["all"], choices=[*GROUPS, "all"])
    parser.add_argument("--workdir", type=Path, help="scratch folder (one subfolder per group)")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--again", action="store_true", help="re-test the last run's survivors")
    parser.add_argument("--diffs", action="store_true", help="print the survivors' diffs")
    args = parser.parse_args()
    groups = list(GROUPS) if "all" in args.groups else list(dict.fromkeys(args.groups))
    summaries = [run_group(group, args) for group in groups]
    if len(summaries) > 1:
        log("")
        for s in summaries:
            pct = 100 * s["killed"] / s["total"] if s["total"] else 100.0
            log(f"{s['group']:<11} {s['killed']:>4} / {s['total']:<4} killed  {pct:5.1f}%")


if __name__ == "__main__":
    main()
