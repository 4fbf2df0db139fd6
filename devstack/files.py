"""The files in the stack folder: S3 keys, endpoints.json, pid and log files, the lock."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from devstack.settings import Endpoints, StackDown, StackError, resolve_dir

CREDENTIALS_FILE = "s3-credentials.json"
ENDPOINTS_FILE = "endpoints.json"
CREDENTIAL_FIELDS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


def pid_file(directory: Path, name: str) -> Path:
    """Where the pid of this stack's `name` service is kept."""
    return directory / f"{name}.pid"


def log_file(directory: Path, name: str) -> Path:
    """Where the output of this stack's `name` service goes."""
    return directory / f"{name}.log"


def ensure_credentials(directory: Path) -> dict[str, str]:
    """The stack's S3 keys, generated on first use into a file only the owner can read."""
    path = directory / CREDENTIALS_FILE
    if not path.exists():
        keys = {
            "AWS_ACCESS_KEY_ID": secrets.token_hex(10),
            "AWS_SECRET_ACCESS_KEY": secrets.token_hex(20),
        }
        tmp = path.with_name(path.name + ".tmp")
        tmp.unlink(missing_ok=True)
        # Created 0600 from the start: a chmod afterwards would leave a readable window.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(keys, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    return s3_credentials(directory)


def s3_credentials(stack_dir: Path | str | None = None) -> dict[str, str]:
    """The stack's S3 keys as environment variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)."""
    path = resolve_dir(stack_dir) / CREDENTIALS_FILE
    try:
        keys = json.loads(path.read_text())
    except FileNotFoundError:
        raise StackDown(f"{path}: missing; run `scripts/stack up` first") from None
    except ValueError:
        raise StackError(f"{path}: not valid JSON; delete it and run `scripts/stack up`") from None
    for field in CREDENTIAL_FIELDS:
        if not isinstance(keys.get(field), str) or not keys[field]:
            raise StackError(f"{path}: field {field}: expected a non-empty string")
    return {field: keys[field] for field in CREDENTIAL_FIELDS}


def read_endpoints(stack_dir: Path | str | None = None) -> Endpoints:
    """The endpoints the last `up` wrote for this stack folder."""
    path = resolve_dir(stack_dir) / ENDPOINTS_FILE
    try:
        raw = json.loads(path.read_text())
        return Endpoints(
            s3_url=raw["s3_url"],
            s3_region=raw["s3_region"],
            registry=raw["registry"],
            docker_host=raw["docker_host"],
            started=tuple(raw["started"]),
            s3_buckets=tuple(raw["s3_buckets"]),
            docker_hosts=tuple(raw.get("docker_hosts", ())),
            ssh=raw.get("ssh", ""),
            ssh_identity=raw.get("ssh_identity", ""),
            ssh_known_hosts=raw.get("ssh_known_hosts", ""),
        )
    except FileNotFoundError:
        raise StackDown(f"{path}: missing; run `scripts/stack up` first") from None
    except (ValueError, KeyError, TypeError) as error:
        raise StackDown(f"{path}: unreadable ({error!r}); run `scripts/stack up`") from None


def recorded_endpoints(directory: Path) -> Endpoints | None:
    """The endpoints from the last `up`, or None when there are none."""
    try:
        return read_endpoints(directory)
    except StackError:
        return None


def write_endpoints(directory: Path, endpoints: Endpoints) -> None:
    """Write endpoints.json atomically, so readers never see half a file."""
    path = directory / ENDPOINTS_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(endpoints), indent=2) + "\n")
    os.replace(tmp, path)


def forget_endpoints(directory: Path) -> None:
    """Remove endpoints.json: nothing of this stack runs any more."""
    (directory / ENDPOINTS_FILE).unlink(missing_ok=True)


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Hold the stack folder's lock, so concurrent `up`/`down` calls take turns."""
    with (directory / ".lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
