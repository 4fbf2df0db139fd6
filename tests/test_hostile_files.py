"""Nothing put where a file was expected hangs, crashes or wedges a command: a FIFO, a device,
/proc's files and links to them are refused in one line before a byte is read."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.core.errors import BadInput, PipelineError
from pipelines.core.files import read_capped
from pipelines.core.settings import read_settings
from pipelines.stages.weights.modelkeys import model_signer
from pipelines.stages.weights.stage import record_staged, staged_from, staged_record

REPO = Path(__file__).resolve().parent.parent


class Refused(PipelineError):
    """What read_capped raises in these tests."""


def fifo(path: Path) -> Path:
    """A FIFO at path, nobody writing to it: a plain open() of it never returns."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


def linked(path: Path, target: str) -> Path:
    """path, a link to target."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)
    return path


@pytest.mark.timeout(10)  # the old open() of a FIFO never returned: the timeout is the red
@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda p: fifo(p), "a FIFO, expected a regular file"),
        (lambda p: linked(p, "/dev/zero"), "a character device, expected a regular file"),
        (lambda p: linked(p, "/dev/null"), "a character device, expected a regular file"),
        (lambda p: linked(p, "/proc/self/mem"), "cannot be read: Input/output error"),
        (lambda p: linked(p, p.name), "cannot be opened: Too many levels of symbolic links"),
        (lambda p: p.mkdir(parents=True), "a folder, expected a file"),
    ],
    ids=["fifo", "dev-zero", "dev-null", "proc-mem", "loop", "folder"],
)
def test_what_is_not_a_regular_file_is_one_line(tmp_path, make, said):
    path = tmp_path / "records" / "x.json"
    make(path)
    with pytest.raises(Refused) as refused:
        read_capped(path, 1 << 20, Refused)
    assert str(refused.value) == f"{path}: {said}"


@pytest.mark.timeout(10)
def test_a_key_file_that_is_a_fifo_or_a_gigabyte_is_refused_unread(tmp_path):
    for path, said in [
        (fifo(tmp_path / "fifo.key"), "a FIFO, expected a regular file"),
        (tmp_path / "big.key", "larger than 65536 bytes; refused unread"),
    ]:
        if not path.exists():
            with open(path, "wb") as f:
                f.truncate(1 << 30)  # sparse: 1 GB that the reader must not take whole
        settings = read_settings({"SPARKFORGE_MODEL_SIGNING_KEY_FILE": str(path)})
        with pytest.raises(BadInput) as refused:
            model_signer(settings, None)
        assert str(refused.value) == (
            f"environment SPARKFORGE_MODEL_SIGNING_KEY_FILE={path}: cannot read the key file"
            f" ({said})"
        )


def doit(store: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """doit on tp4-ring (no local stack to read) and a store of the test's own, at most 60 s."""
    env = {**os.environ, "SPARKFORGE_STORE": str(store)}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "doit",
            *args,
            "profile=tp4-ring",
            f"image_digest=sha256:{'0' * 64}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_fifos_in_the_store_stop_no_command(tmp_path):
    store = tmp_path / "store"
    record = fifo(store / "records" / "render" / f"{'a' * 64}.json")
    deployment = fifo(store / "deployments" / "tp4-ring" / "1796000000000000000.json")
    fifo(store / "bench" / "tp4-ring" / "20260101T000000Z" / "results.json")

    explained = doit(store, "explain", "render")
    assert explained.returncode == 0, explained.stderr
    assert f"render: skipped a record: {record}: a FIFO, expected a regular file" in (
        explained.stdout
    )
    status = doit(store, "status")
    assert status.returncode == 0, status.stderr
    assert f"skipped {deployment}: a FIFO, expected a regular file" in status.stderr
    collected = doit(store, "gc")
    assert collected.returncode == 2
    assert (
        f"gc refused: {deployment}: a FIFO, expected a regular file; it is newer than every"
        " record that can be read"
    ) in collected.stdout + collected.stderr


@pytest.mark.timeout(10)  # the old read_text() of a FIFO never returned: the timeout is the red
@pytest.mark.parametrize(
    ("kind", "make"),
    [
        ("a FIFO", fifo),
        ("a link to /dev/zero", lambda p: linked(p, "/dev/zero")),
        ("a folder", lambda p: (p.mkdir(parents=True), p)[1]),
        ("not JSON", lambda p: (p.write_text("[" * 100_000), p)[1]),
        ("a number for its sha256", lambda p: (p.write_text('{"lock_sha256": 7}'), p)[1]),
    ],
)
def test_a_staged_record_that_is_no_record_means_not_staged_and_never_hangs(tmp_path, kind, make):
    folder = tmp_path / "models" / "abc"
    folder.mkdir(parents=True)
    make(staged_record(folder))
    assert staged_from(folder) is None  # the no-op check says "stage again", at once
    if kind == "a folder":  # staging cannot write its record there: one line
        with pytest.raises(PipelineError, match=r"\.staged\.json: cannot record the staged lock"):
            record_staged(folder, "a" * 64)
    else:  # staging writes the record anew, over whatever was there
        record_staged(folder, "a" * 64)
        assert staged_from(folder) == "a" * 64
