"""The partial file a fetch appends to: direct writes where the filesystem has them, the page
cache for the rest, and a resume point that direct writes can go on from."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import shutil
import tempfile
import threading
from pathlib import Path

import pytest

from pipelines.stages.weights.partial import (
    ALIGN,
    PartialFile,
    WriteBehind,
    WriteError,
    aligned_buffer,
)

MiB = 1 << 20


def cached_bytes(path: Path) -> int:
    """Bytes of path in the page cache now (mincore(2) over a private mapping; nothing read)."""
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as file, mmap.mmap(file.fileno(), size, access=mmap.ACCESS_COPY) as m:
        start = ctypes.c_char.from_buffer(m)
        try:
            address = ctypes.c_void_p(ctypes.addressof(start))
            if libc.mincore(address, ctypes.c_size_t(size), vector):
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            del start  # the mapping cannot close while ctypes holds it
    return sum(page & 1 for page in vector) * mmap.PAGESIZE


def direct_io_here(folder: Path) -> bool:
    """Whether folder's filesystem takes direct writes (tmpfs before Linux 6.6 does not); asked
    of the kernel, not of partial.py, so that a partial.py that never writes directly fails."""
    probe = folder / "direct-io-probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A folder whose filesystem takes direct writes (the case this module is about)."""
    if not direct_io_here(tmp_path):
        pytest.skip(f"{tmp_path}: no direct I/O on this filesystem")
    return tmp_path


def test_range_buffers_are_private_page_aligned_memory():
    # A shared mapping (mmap's default) is shmem: twice the cost to fault in and to unmap.
    buffer = aligned_buffer(MiB)
    pointer = ctypes.c_char.from_buffer(buffer)
    address = ctypes.addressof(pointer)
    del pointer
    assert address % ALIGN == 0
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        low, high = (int(x, 16) for x in span.split("-"))
        if low <= address < high:
            assert perms == "rw-p", line
            return
    pytest.fail(f"no mapping holds {address:#x}")


def test_aligned_ranges_reach_the_disk_without_the_page_cache_and_the_tail_through_it(folder):
    path = folder / "blob.part"
    size = 3 * MiB + 1000  # three aligned ranges, then a tail shorter than a block
    data = os.urandom(size)
    buffer = aligned_buffer(MiB)
    partial = PartialFile(path)
    try:
        for start in range(0, size, MiB):
            chunk = data[start : start + MiB]
            buffer[: len(chunk)] = chunk
            partial.write(buffer[: len(chunk)], start)
        assert partial.direct is not None  # no write was refused
    finally:
        partial.close()
    assert cached_bytes(path) <= ALIGN  # only the tail's page went through the cache
    assert path.read_bytes() == data


def test_an_unaligned_buffer_falls_back_to_the_page_cache_with_the_same_bytes(folder):
    path = folder / "blob.part"
    data = os.urandom(2 * MiB)
    unaligned = memoryview(bytearray(len(data) + 1))[1:]  # one byte off any page
    unaligned[:] = data
    partial = PartialFile(path)
    try:
        partial.write(unaligned, 0)
        assert partial.direct is None  # refused once, buffered from then on
        partial.write(unaligned[:ALIGN], len(data))
    finally:
        partial.close()
    assert path.read_bytes() == data + data[:ALIGN]


def test_resume_point_cuts_a_length_back_to_where_direct_writes_can_go_on(folder):
    path = folder / "blob.part"
    path.write_bytes(b"a" * (2 * ALIGN + 100))  # as a buffered writer of an older run left it
    partial = PartialFile(path)
    try:
        assert partial.resume_point(10 * ALIGN) == 2 * ALIGN
        assert path.stat().st_size == 2 * ALIGN
        assert partial.resume_point(2 * ALIGN) == 2 * ALIGN  # whole: nothing cut
        assert partial.resume_point(ALIGN) == 0  # longer than the file: not its bytes
        assert path.stat().st_size == 0
    finally:
        partial.close()


def test_a_part_file_left_read_only_by_a_killed_publish_is_resumed(tmp_path):
    """publish_many makes a file read-only, then renames it: a kill in between must not leave a
    part file that a fetch not run as root can never open again."""
    # As root, a folder outside pytest's (whose parents only root may enter) for nobody to use.
    folder = Path(tempfile.mkdtemp(prefix="partial-")) if os.geteuid() == 0 else tmp_path
    path = folder / "blob.part"
    path.write_bytes(b"a" * ALIGN)
    path.chmod(0o444)
    if os.geteuid() == 0:  # root opens anything: resume as nobody, as a fetch node's user would
        os.chown(folder, NOBODY, NOBODY)
        os.chown(path, NOBODY, NOBODY)
        read, write = os.pipe()
        if (pid := os.fork()) == 0:
            os.close(read)
            try:
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                resume(path)
                os._exit(0)
            except BaseException as err:
                os.write(write, repr(err).encode())
                os._exit(1)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            error = pipe.read().decode()
        os.waitpid(pid, 0)
        shutil.rmtree(folder)
        assert error == ""
    else:
        resume(path)


NOBODY = 65534


def resume(path: Path) -> None:
    """Open a part file, go on from its prefix, and check its bytes and its mode."""
    partial = PartialFile(path)
    try:
        assert partial.resume_point(2 * ALIGN) == ALIGN
        partial.write(memoryview(b"b" * ALIGN), ALIGN)
    finally:
        partial.close()
    assert path.read_bytes() == b"a" * ALIGN + b"b" * ALIGN
    assert path.stat().st_mode & 0o777 == 0o644


class GatedPartial(PartialFile):
    """A partial file whose writes wait for a gate, and whose write at fail_at fails once as a
    full disk would."""

    def __init__(self, path: Path, fail_at: int | None = None):
        super().__init__(path)
        self.gate = threading.Event()
        self.fail_at = fail_at
        self.writers: set[str] = set()

    def write(self, view: memoryview, at: int) -> None:
        assert self.gate.wait(10), "the caller waited for a write it should have left behind"
        self.writers.add(threading.current_thread().name)
        if at == self.fail_at:
            self.fail_at = None
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        super().write(view, at)


def write_ranges(partial: PartialFile, data: bytes, size: int) -> tuple[WriteBehind, list]:
    """Queue data in ranges of size on a WriteBehind, each from its own buffer; returns it and
    the buffers it has released."""
    released: list[memoryview] = []
    writes = WriteBehind(partial, released.append)
    for start in range(0, len(data), size):
        buffer = aligned_buffer(size)
        buffer[: len(data[start : start + size])] = data[start : start + size]
        writes.write(buffer, buffer[: len(data[start : start + size])], start)
    return writes, released


def test_writes_go_on_behind_the_caller_in_order_and_release_every_buffer(tmp_path):
    data = os.urandom(4 * MiB + 123)
    partial = GatedPartial(tmp_path / "blob.part")
    try:
        writes, released = write_ranges(partial, data, MiB)  # returns with every write waiting
        assert released == []
        partial.gate.set()
        writes.finish()
    finally:
        partial.close()
    assert len(released) == 5
    assert partial.writers and threading.current_thread().name not in partial.writers
    assert (tmp_path / "blob.part").read_bytes() == data


def test_a_failed_write_stops_the_writes_after_it_so_the_file_stays_a_prefix(tmp_path):
    data = os.urandom(4 * MiB)
    partial = GatedPartial(tmp_path / "blob.part", fail_at=2 * MiB)
    try:
        writes, released = write_ranges(partial, data, MiB)  # all queued before the failure
        partial.gate.set()
        with pytest.raises(WriteError, match=r"writing .*blob\.part: No space left on device"):
            writes.finish()
    finally:
        partial.close()
    assert len(released) == 4  # the skipped ones too: no buffer is lost to the pool
    assert (tmp_path / "blob.part").read_bytes() == data[: 2 * MiB]
