"""Durable file writes, bounded reads and content hashing: the one place that fsyncs, renames,
hashes and reads local state (records, results) with a cap on its size."""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import secrets
import stat
from pathlib import Path
from typing import Any

import msgspec

from pipelines.core.errors import PipelineError

CHUNK = 4 << 20
MiB = 1 << 20


def hash_file(path: Path) -> str:
    """sha256 of a file, read in large chunks (hashlib releases the GIL for them)."""
    digest = hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    """sha256 of bytes in memory, as hex."""
    return hashlib.sha256(data).hexdigest()


def fsync_fd(fd: int) -> None:
    """Flush one open file's bytes to disk."""
    os.fsync(fd)


def sync_files(anchor_fd: int, paths: list[Path]) -> None:
    """Make the bytes of paths durable in one wait: syncfs(2) of the filesystem holding anchor_fd.

    syncfs, not sync(2): it waits only for the store's own filesystem (not every mount of the
    node), and since Linux 5.8 it reports writeback errors on that filesystem since anchor_fd
    was opened (open it before the writes it covers), where sync(2) reports nothing. A libc
    without syncfs gets one fsync per file, which is as safe, only slower.
    """
    syncfs = getattr(_libc(), "syncfs", None)
    if syncfs is None:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return
    if syncfs(anchor_fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"syncfs: {os.strerror(err)}")


def _libc() -> ctypes.CDLL:
    """The C library of this process, with errno kept for ctypes.get_errno."""
    return ctypes.CDLL(None, use_errno=True)


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (new names, renames) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file and folder below root to disk, so a rename publishes durable bytes."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def flock_held(path: Path) -> bool:
    """True when another process holds path's flock now (a missing file: nobody)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing lets go of a flock taken here
    return False


def write_temp(path: Path, data: bytes, mode: int) -> Path:
    """A new file beside path (a hidden temp name of its own) holding data, fsynced; nothing is
    left behind when the write fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A random part: two writers of one path (processes or threads) never share a temp file.
    temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    # Created with its final mode: a chmod afterwards would leave a readable window.
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return temp


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write a file whole or not at all: a new temp file (created with mode), fsync, rename.

    A new inode each time, so a hard link to the old file is never written through.
    """
    temp = write_temp(path, data, mode)
    try:
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def create_once(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Create path holding data unless it exists: written whole under a temp name (mode from
    the start), then linked in; of two makers at once the second's link fails and the first's
    file stays (a key is never replaced, and no reader sees half of it)."""
    temp = write_temp(path, data, mode)
    try:
        # link, not rename: an existing file is never replaced.
        os.link(temp, path)
    except FileExistsError:
        pass
    finally:
        temp.unlink()
    fsync_dir(path.parent)


def read_capped(path: Path, cap: int, error: type[PipelineError]) -> bytes:
    """A regular file's bytes, or error naming it when it holds more than cap (never reads past
    cap+1: a file of any size costs at most cap bytes of memory) or is no regular file.

    Opened without blocking and checked before a byte is read: a FIFO, a device or a socket
    put where a record or a key was expected is refused at once instead of hanging the command.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise error(f"{path}: file not found") from None
    except OSError as err:
        raise error(f"{path}: cannot be opened: {err.strerror}") from None
    found = os.fstat(fd)
    if not stat.S_ISREG(found.st_mode):
        os.close(fd)
        if stat.S_ISDIR(found.st_mode):
            raise error(f"{path}: a folder, expected a file") from None
        raise error(f"{path}: {file_kind(found.st_mode)}, expected a regular file") from None
    with os.fdopen(fd, "rb") as f:
        try:
            # Sized by the file, not the cap: a read of cap+1 bytes allocates them all first.
            data = f.read(min(found.st_size, cap) + 1)
            if found.st_size < len(data) <= cap:  # grown since, or a file that reports no size
                data += f.read(cap + 1 - len(data))
        except OSError as err:
            raise error(f"{path}: cannot be read: {err.strerror}") from None
    if len(data) > cap:
        raise error(f"{path}: larger than {size_text(cap)}; refused unread") from None
    return data


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, in a word or two."""
    kinds = [
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ]
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def free_space_note(path: Path) -> str:
    """' (the disk is full: N bytes free)' when path's filesystem has under 1 MiB left, else ''
    (what to say after an error that a full disk may have caused)."""
    try:
        fs = os.statvfs(path if path.is_dir() else path.parent)
    except OSError:
        return ""
    free = fs.f_bavail * fs.f_frsize
    return f" (the disk is full: {free:,} bytes free)" if free < MiB else ""


def last_line(log: Path) -> str | None:
    """A log's last non-empty line; None when the log is empty or cannot be read."""
    try:
        lines = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return None
    return lines[-1] if lines else None


def size_text(n: int) -> str:
    """A cap as people write it: whole MiB, else bytes."""
    return f"{n // MiB} MiB" if n % MiB == 0 else f"{n} bytes"


def decode_json(data: bytes, where: str, error: type[PipelineError], model: Any = Any) -> Any:
    """JSON bytes as model (plain data by default), or error with one line saying where."""
    try:
        return msgspec.json.decode(data, type=model)
    except msgspec.ValidationError as err:
        raise error(f"{where}: {describe_json_error(str(err))}") from None
    except msgspec.DecodeError as err:
        raise error(f"{where}: not valid JSON: {describe_json_error(str(err))}") from None
    except RecursionError:  # msgspec's guard against deep nesting: the stack is never at risk
        raise error(f"{where}: not valid JSON: nested too deep") from None


def describe_json_error(message: str) -> str:
    """msgspec's message, its 'truncated' made plain and its `$.a.b` path as field a.b."""
    message = message.replace("Input data was truncated", "ends early (truncated)")
    message = message.removeprefix("JSON is malformed: ")
    what, _, at = message.partition(" - at `$")
    if not at:
        return what[:1].lower() + what[1:]
    field = at.rstrip("`").lstrip(".").replace("[", ".").replace("]", "")
    return f"field {field!r}: {what[:1].lower()}{what[1:]}"


def load_json(path: Path, cap: int, error: type[PipelineError], model: Any = Any) -> Any:
    """A JSON file of at most cap bytes, decoded as model, or error with one line naming it."""
    return decode_json(read_capped(path, cap, error), str(path), error, model)


def load_json_object(
    path: Path, cap: int, error: type[PipelineError], fields: type[msgspec.Struct]
) -> dict[str, Any]:
    """A JSON object of at most cap bytes whose fields a reader uses are checked against fields
    (a Struct of those only), returned whole; else error with one line naming the file."""
    data = load_json(path, cap, error)
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object")
    try:
        msgspec.convert(data, fields)
    except msgspec.ValidationError as err:
        raise error(f"{path}: {describe_json_error(str(err))}") from None
    return data
