"""The session's hooks: its name, the skip policy, the lanes' marks and pytest-xdist's scheduling;
the fixtures live in tests/support/ (the stack in support/stack.py)."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

# pytest keeps each test module's rewritten asserts as bytecode only where Python may write it;
# with PYTHONDONTWRITEBYTECODE set (as on this project's machines) every worker rewrote every
# test and support module anew, 4 to 5 CPU s each. This process only: the commands the tests
# run keep the setting.
sys.dont_write_bytecode = False

import devstack as local_stack  # noqa: E402

# The measurement helpers of tests/perf/ (read_chars, the full-size model shape) serve the tests.
sys.path.insert(0, str(Path(__file__).resolve().parent / "perf"))

# The support modules hold fixtures whose asserts should explain themselves (pytest rewrites
# them), and conftest imports some before pytest loads them as plugins.
pytest.register_assert_rewrite("support")
from support.deploying import remove_source_images  # noqa: E402
from support.skips import SkipPolicy  # noqa: E402
from support.stack import SESSION_ENV, stop_if_started_here  # noqa: E402

# pytester: the skip policy's own test runs a small session of its own. support.deploying and
# support.model_bucket: the deploy and weights tests' fixtures, module ones made per test module;
# support.stack: the stack and the fixtures that reach it. support.leftovers: what a test that
# timed out started and left running ends with it.
pytest_plugins = [
    "pytester",
    "support.stack",
    "support.deploying",
    "support.model_bucket",
    "support.leftovers",
]


def is_controller(config: pytest.Config) -> bool:
    """Whether this process runs the session itself (alone, or as pytest-xdist's controller)."""
    return not hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    """Name the session; fail it for any skip on CI's machine kind (tests/support/skips.py)."""
    if is_controller(config):
        os.environ[SESSION_ENV] = uuid.uuid4().hex
    config.pluginmanager.register(SkipPolicy(local_stack.REPO_ROOT), "sparkforge-skips")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Once every worker is done: remove the session's builds of the images the deploy
    modules copied (support/deploying.py), and stop the tests' stack if this session started
    it."""
    if is_controller(session.config):
        remove_source_images()
        stop_if_started_here()


# Fixtures that start real services: the local stack, and the ring tests' three members
# behind their own S3 in network namespaces (tests/test_weights_ring.py).
SERVICE_FIXTURES = {"stack", "ring"}


# Files whose tests build a ring in network namespaces: one ring at a time fits on a host (its
# subnets are fixed), so pytest-xdist runs these files on one worker, one after the other.
RING_FILES = {"test_ringnet.py", "test_weights_ring.py"}


# The files that take longest (minutes each, `--durations` of fresh-clone runs on 2 cores),
# longest first: started first, they do not run on alone at the end (test_weights_ring.py, 100 s
# with test_ringnet.py, handed out later, ran on alone for the last 20 s of one run).
LONGEST_FIRST = (
    "test_act_workflows.py",
    "test_reproducible_arm64.py",
    "test_reproducible_arm64_bases.py",
    "test_reproducible.py",
    "test_deploy_diff.py",
    "test_debian_lock.py",
    "test_images.py",
    "test_weights_ring.py",
    "test_deploy_ring.py",
    "test_deploy_staging.py",
    "test_deploy_bench.py",
    "test_deploy_rollback.py",
    "test_gc.py",
)


# The files without services that take longest (test time summed, fast lane on 2 cores),
# longest first: the last file a worker is handed in the fast lane is then a short one (with
# test_steps.py handed last, one worker ran 49 s of tests where the four averaged 39).
LONGEST_WITHOUT_SERVICES = (
    "test_steps.py",
    "test_deploy_kubernetes.py",
    "test_contracts.py",
    "test_operator.py",
    "test_render_structure.py",
    "test_render.py",
    "test_leftovers.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `stack` every test that reaches a fixture starting services, however indirectly
    (the fast lane is `pytest -m "not stack"`, which starts none); then order the files for
    pytest-xdist, which hands them out in this order: the longest first, then the other files
    with such tests, then the rest (their longest first), each file's tests in their order."""
    for item in items:
        if SERVICE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.stack)
    with_services = {item.path for item in items if item.get_closest_marker("stack")}
    items.sort(key=lambda item: run_order(item.path.name, item.path in with_services))


def run_order(name: str, with_services: bool) -> tuple[int, bool, int]:
    """Where a file goes in the run: its place among the longest, then services first, then
    its place among the longest of those without."""

    def place(longest: tuple[str, ...]) -> int:
        return longest.index(name) if name in longest else len(longest)

    return place(LONGEST_FIRST), not with_services, place(LONGEST_WITHOUT_SERVICES)


# Files whose parametrized builds each take minutes: each parameter is a scope of its own, so
# several workers share the file (the builds they share are made once per session:
# support/reproducible.py).
SPLIT_FILES = {"test_reproducible.py", "test_reproducible_arm64_bases.py"}


def xdist_scope(nodeid: str) -> str:
    """The scope pytest-xdist keeps on one worker: a test's file (its module fixtures are made
    once), the ring files together, a split file's tests by their parameter."""
    path, _, rest = nodeid.partition("::")
    name = Path(path).name
    if name in RING_FILES:
        return "ring files"
    if name in SPLIT_FILES and "[" in rest:
        return f"{path}[{rest.partition('[')[2]}"
    return path


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """pytest-xdist's scheduling by scope, with xdist_scope as the scope, in the order
    pytest_collection_modifyitems left (not reordered by how many tests a scope has)."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return ByFile(config, log)
