"""Tests that each fail when one guard of the pipeline breaks (each was once unguarded).

Each goes through the path a user takes (a doit task, or the stage's public function) and
asserts what the user would see: the one-line message, the digest, the bytes sent.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import time
from pathlib import Path

import pytest
from support.doit import run_doit
from support.stages import image_copy

from pipelines.core.paths import IMAGES_DIR, LOCKS_DIR, RECEIPT
from pipelines.engine import statcache
from pipelines.stages.images.build import buildx_build, plan_image
from pipelines.stages.images.context import BuildContext, context_tar
from pipelines.stages.images.spec import ImageError, load_image

FAKE_DIGEST = "sha256:" + "ab" * 32
KEY = "0" * 64


# --- the stat cache's racy-clean wait (RACY_NS) ----------------------------------------------


TICK_NS = 4_000_000  # one tick of the kernel's coarse clock at CONFIG_HZ=250


class CoarseStat:
    """A stat result with mtime and ctime in whole ticks, as a coarse-clock kernel stamps them."""

    def __init__(self, st: os.stat_result):
        self._st = st

    def __getattr__(self, name: str):
        value = getattr(self._st, name)
        return value // TICK_NS * TICK_NS if name in ("st_mtime_ns", "st_ctime_ns") else value


class CoarseClockOs:
    """The os module as the stat cache sees it on a kernel that stamps files from a coarse clock.

    Linux 6.13+ (ext4, xfs, btrfs, tmpfs) gives a file whose times were read since its last
    change a fine-grained stamp on the next change, so a rewrite right after hashing always
    moves ctime there and the race never shows; older kernels (CI runners') and other
    filesystems stamp from the tick clock. This replays such a clock on any kernel.
    """

    def __getattr__(self, name: str):
        return getattr(os, name)

    def stat(self, path, *args, **kwargs):
        return CoarseStat(os.stat(path, *args, **kwargs))


@pytest.mark.parametrize("clock", ["kernel", "coarse"])
def test_stat_cache_sees_a_same_size_rewrite_that_keeps_the_mtime(tmp_path, monkeypatch, clock):
    """A rewrite right after hashing, same size, mtime put back: the new bytes' digest comes out.

    Without the racy-clean wait the entry is recorded in the same clock tick as the rewrite,
    whose ctime then equals the recorded one: the stale digest would be answered.
    """
    if clock == "coarse":
        monkeypatch.setattr(statcache, "os", CoarseClockOs())
    cache = statcache.StatCache(tmp_path / "c.sqlite3")
    for i in range(20):
        path = tmp_path / f"file-{i}.bin"
        path.write_bytes(b"old %03d" % i)
        assert cache.digest_file(path) == hashlib.sha256(b"old %03d" % i).hexdigest()
        st = os.stat(path)
        new = b"new %03d" % i
        path.write_bytes(new)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert os.stat(path).st_size == st.st_size
        assert cache.digest_file(path) == hashlib.sha256(new).hexdigest(), f"iteration {i}"


@pytest.mark.parametrize("given", [True, False], ids=["clock-given", "cache-folder-as-clock"])
@pytest.mark.parametrize("clock", ["kernel", "coarse"])
def test_stat_cache_with_a_clock_folder_sees_a_rewrite_yet_waits_less_than_racy_ns(
    tmp_path, monkeypatch, clock, given
):
    """With a clock folder (the blob store's, or the cache's own when the files share its
    filesystem), recording waits for the filesystem's own stamps.

    Same rewrite as above, right after recording: the entry must not answer for the new bytes.
    RACY_NS is made 1 s so that the fixed wait would stand out: 20 records take under one.
    """
    if clock == "coarse":
        monkeypatch.setattr(statcache, "os", CoarseClockOs())
    monkeypatch.setattr(statcache, "RACY_NS", 1_000_000_000)
    cache = statcache.StatCache(tmp_path / "c.sqlite3")
    began = time.monotonic()
    for i in range(20):
        path = tmp_path / f"file-{i}.bin"
        path.write_bytes(b"old %03d" % i)
        key = statcache.stat_key(statcache.os.stat(path))
        sha = hashlib.sha256(b"old %03d" % i).hexdigest()
        cache.record([(path, key, sha)], clock=tmp_path if given else None)
        st = os.stat(path)
        new = b"new %03d" % i
        path.write_bytes(new)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert cache.lookup(path, statcache.os.stat(path)) is None, f"iteration {i}"
    assert time.monotonic() - began < 1.0


class FakeNanoClock:
    """time as the stat cache sees it: now in ns, moved only by a sleep (each one recorded)."""

    def __init__(self, now_ns: int):
        self.now_ns = now_ns
        self.sleeps: list[float] = []

    def time_ns(self) -> int:
        return self.now_ns

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now_ns += round(seconds * 1e9)


@pytest.mark.parametrize("folder", [None, "no-such-folder"])
def test_stat_cache_records_a_digest_only_once_the_files_ctime_is_racy_ns_old(
    tmp_path, monkeypatch, folder
):
    # A clock folder that cannot be written falls back to the same wait: the blobs are in the
    # store by then, so it must neither fail their publication nor record them unchecked.
    path = tmp_path / "f.bin"
    path.write_bytes(b"f")
    st = os.stat(path)
    sha = hashlib.sha256(b"f").hexdigest()
    cache = statcache.StatCache(tmp_path / "c.sqlite3")
    # The cache kept on another filesystem than the file: its folder's stamps are no clock for it.
    monkeypatch.setattr(cache, "_db_device", lambda: os.stat(path).st_dev + 1)
    for age_ns, waited in (
        (10_000_000, [0.04]),  # 10 ms old: waits the other 40 ms
        (statcache.RACY_NS - 1, [1e-9]),  # one ns short: waits that ns
        (statcache.RACY_NS, []),  # old enough: no wait at all
        (10 * statcache.RACY_NS, []),
    ):
        clock = FakeNanoClock(st.st_ctime_ns + age_ns)
        monkeypatch.setattr(statcache, "time", clock)
        clock_folder = folder and tmp_path / folder
        cache.record([(path, statcache.stat_key(st), sha)], clock=clock_folder)
        assert clock.sleeps == waited, age_ns
        assert cache.lookup(path, st) == sha


# --- fetch_weights refuses a lock that is not locked yet -------------------------------------


def test_fetch_weights_refuses_an_unlocked_lock_in_one_line(tmp_path):
    """`doit fetch_weights profile=tp3-ring`: its lock has no sha256 yet; one line, no traceback."""
    env = {**os.environ, "SPARKFORGE_STORE": str(tmp_path / "store")}
    result = run_doit("fetch_weights", "profile=tp3-ring", env=env, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "Traceback" not in output
    lock_file = LOCKS_DIR / "dsv41-flash-exl3.lock.yaml"
    errors = [line for line in output.splitlines() if "not locked yet" in line]
    assert len(errors) == 1, output
    assert errors[0].startswith(f"{lock_file}: "), errors[0]
    assert "sha256: not locked yet" in errors[0]


# --- .dockerignore in the build context ------------------------------------------------------


def test_build_context_leaves_out_what_dockerignore_lists(tmp_path):
    """secret.txt, listed in .dockerignore, is neither sent to the engine nor in the key."""
    folder = tmp_path / "image"
    folder.mkdir()
    (folder / "Dockerfile").write_text("FROM scratch\nCOPY app.py /app.py\n")
    (folder / ".dockerignore").write_text("secret.txt\n")
    (folder / "app.py").write_text("print('hello')\n")
    (folder / "secret.txt").write_text("hunter2\n")

    with tarfile.open(fileobj=context_tar(folder, 1764460800, {})) as tar:
        sent = {member.name: tar.extractfile(member).read() for member in tar.getmembers()}
    assert "secret.txt" not in sent
    assert sent["Dockerfile"] == b"FROM scratch\nCOPY app.py /app.py\n"
    assert sent["app.py"] == b"print('hello')\n"
    assert not any(b"hunter2" in data for data in sent.values())

    cache = statcache.StatCache(tmp_path / "c.sqlite3")
    context = BuildContext(folder, {})
    before, listing = context.digest(cache)
    assert "secret.txt" not in listing
    (folder / "secret.txt").write_text("a different secret, longer\n")
    assert context.digest(cache)[0] == before
    (folder / "app.py").write_text("print('changed')\n")
    assert context.digest(cache)[0] != before  # the digest does follow what is sent


# --- plan_image's static checks --------------------------------------------------------------


@pytest.fixture
def exl3_image(tmp_path):
    """A copy of images/vllm-gb10-dsv41-exl3 to edit: (images folder, Dockerfile path)."""
    name = "vllm-gb10-dsv41-exl3"
    shutil.copytree(IMAGES_DIR / name, tmp_path / name)
    return tmp_path, tmp_path / name / "Dockerfile"


def plan_exl3(images: Path):
    """plan_image of the copied exl3 image, with the base its image.yaml pins."""
    image = load_image("vllm-gb10-dsv41-exl3", folder=images)
    return plan_image(image, "registry.example:5000", image.spec.base.image, KEY, {})


def test_plan_image_refuses_a_from_not_pinned_by_digest(exl3_image):
    images, dockerfile = exl3_image
    plan_exl3(images)  # the image as committed plans fine
    text = dockerfile.read_text()
    assert "FROM ${BASE}\n" in text
    dockerfile.write_text(text.replace("FROM ${BASE}\n", "FROM ubuntu:22.04\n"))
    line = text[: text.index("FROM ${BASE}")].count("\n") + 1
    with pytest.raises(ImageError) as err:
        plan_exl3(images)
    assert str(err.value) == (
        f"{dockerfile}:{line}: FROM ubuntu:22.04 resolves to 'ubuntu:22.04': expected an image"
        " pinned by digest (name@sha256:<64 hex>)"
    )


def test_plan_image_refuses_a_dockerfile_without_max_jobs_from_its_checks(exl3_image):
    images, dockerfile = exl3_image
    text = dockerfile.read_text()
    assert "    MAX_JOBS=1 \\\n" in text
    dockerfile.write_text(text.replace("    MAX_JOBS=1 \\\n", ""))
    with pytest.raises(ImageError) as err:
        plan_exl3(images)
    assert str(err.value) == f"{dockerfile}: expected the Dockerfile to contain 'MAX_JOBS=1'"


# --- buildx builds from the normalized context -----------------------------------------------


def test_buildx_is_given_the_normalized_context(tmp_path, monkeypatch):
    """The folder buildx receives has the receipt writer, mtimes at the epoch, modes 644/755."""
    # This shim stands in for the buildx CLI because no buildx exists on these machines (the
    # first arm64 CI run is the real test): it keeps a copy of the context (the last argument)
    # and fails, as a build would.
    received = tmp_path / "received"
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "docker").write_text(
        "#!/bin/sh\n"
        'if [ "$1" = buildx ] && [ "$2" = build ]; then\n'
        "  for last; do :; done\n"
        f'  cp -a "$last" "{received}"\n'
        "  echo 'shim: no buildx here' >&2\n"
        "fi\n"
        "exit 1\n"
    )
    (shim / "docker").chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim}{os.pathsep}{os.environ['PATH']}")

    # A copy of images/local-sim whose modes a checkout's umask could give: 600 and 700.
    folder = image_copy("local-sim", tmp_path / "images")
    package = sorted(p.relative_to(folder).as_posix() for p in (folder / "sim").rglob("*.py"))
    assert "sim/__main__.py" in package
    for name in package:
        (folder / name).chmod(0o600)
    (folder / "sim").chmod(0o700)
    (folder / "entry.sh").write_text("#!/bin/sh\nexec python3 -m sim\n")
    (folder / "entry.sh").chmod(0o700)
    image = load_image("local-sim", folder=tmp_path / "images")
    plan = plan_image(image, "127.0.0.1:5000", f"127.0.0.1:5000/x@{FAKE_DIGEST}", KEY, {})
    (tmp_path / "out").mkdir()
    with pytest.raises(ImageError, match=r"buildx failed \(exit 1\)"):
        buildx_build(None, plan, tmp_path / "out" / "saved.tar")

    files = {p.relative_to(received).as_posix(): p for p in received.rglob("*") if p.is_file()}
    modes = {name: os.lstat(path).st_mode & 0o7777 for name, path in files.items()}
    assert modes == {
        "Dockerfile": 0o644,
        "image.yaml": 0o644,
        **dict.fromkeys(package, 0o644),
        "entry.sh": 0o755,
        "sparkforge-receipt.py": 0o644,
    }
    assert os.lstat(received / "sim").st_mode & 0o7777 == 0o755  # the package's folder too
    epoch = image.spec.source_date_epoch
    assert {name: os.lstat(path).st_mtime for name, path in files.items()} == dict.fromkeys(
        files, epoch
    )
    assert (received / "sparkforge-receipt.py").read_bytes() == RECEIPT.read_bytes()
