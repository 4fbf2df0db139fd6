"""Where a fetch reads a file's bytes from: the S3 bucket, or a ring peer's blob server.

Both fill a range into a caller's buffer and report bytes as they arrive; neither decides
whether the bytes are right (the fetch hashes the whole file against the lock, whatever the
source). A peer that does not have the file yet, or cannot be reached, says NotServed, so the
fetch can ask another.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import urllib3

from pipelines.core.errors import PipelineError
from pipelines.core.modellock import LockEntry
from pipelines.stages.weights.ranges import BROKEN_BODY, RETRIES, RangeError, read_body, read_range
from pipelines.stages.weights.s3 import S3Url

if TYPE_CHECKING:
    from types_boto3_s3 import S3Client

OnBytes = Callable[[int], None]


# A peer serves from its own disk over a direct link: one that sends nothing for this long
# mid-body is hung, and asking it again would cost each range this long once more.
PEER_READ_TIMEOUT_S = 15


class NotServed(PipelineError):
    """The source does not serve this file (not there yet, refused, or unreachable)."""


class PeerStalled(RangeError):
    """A peer that sent nothing for PEER_READ_TIMEOUT_S: no answer, or a body stopped halfway."""


class Source(Protocol):
    """Where a fetch reads ranges of a file from (S3Source, PeerSource)."""

    origin: str  # "s3" or "peers": how the fetch counts its bytes
    label: str  # for messages: "S3", or the peer's node

    def read(
        self,
        entry: LockEntry,
        start: int,
        view: memoryview,
        stop: threading.Event,
        on_bytes: OnBytes,
        throttle: OnBytes | None,
    ) -> None:
        """Fill view with entry's bytes from start."""


class S3Source:
    """The model's bucket."""

    origin = "s3"

    def __init__(self, client: S3Client, url: S3Url, retries: int = RETRIES):
        self.client, self.url, self.retries = client, url, retries
        self.label = "S3"

    def read(
        self,
        entry: LockEntry,
        start: int,
        view: memoryview,
        stop: threading.Event,
        on_bytes: OnBytes,
        throttle: OnBytes | None,
    ) -> None:
        """Fill view with entry's bytes from start (read_range retries broken bodies)."""
        read_range(
            self.client,
            self.url,
            entry.name,
            start,
            view,
            entry.locked_size,
            self.retries,
            stop,
            on_bytes,
            throttle,
        )


class PeerSource:
    """A ring member's blob server: GET /sha256/<sha256> with a Range, read-only."""

    origin = "peers"

    def __init__(self, pool: urllib3.PoolManager, base: str, label: str, retries: int = RETRIES):
        self.pool, self.base, self.label, self.retries = pool, base.rstrip("/"), label, retries

    def read(
        self,
        entry: LockEntry,
        start: int,
        view: memoryview,
        stop: threading.Event,
        on_bytes: OnBytes,
        throttle: OnBytes | None,
    ) -> None:
        """Fill view with entry's bytes from start, checking the server's Content-Range."""
        end = start + len(view) - 1
        what = f"{entry.name} from {self.label}"
        for attempt in range(self.retries + 1):
            try:
                response = self.pool.request(
                    "GET",
                    f"{self.base}/sha256/{entry.sha256}",
                    headers={"Range": f"bytes={start}-{end}"},
                    preload_content=False,
                    retries=False,
                )
            except urllib3.exceptions.ReadTimeoutError:
                raise PeerStalled(f"{what}: sent no answer for {PEER_READ_TIMEOUT_S} s") from None
            except urllib3.exceptions.HTTPError as err:
                raise NotServed(f"{what}: unreachable ({type(err).__name__})") from None
            try:
                self._check(response, entry, start, end, what)
                read_body(response.readinto, view, what, stop, on_bytes, throttle)
                return
            except (urllib3.exceptions.ReadTimeoutError, TimeoutError):
                raise PeerStalled(
                    f"{what}: sent nothing for {PEER_READ_TIMEOUT_S} s in bytes {start}-{end}"
                ) from None
            except BROKEN_BODY as err:
                if attempt == self.retries:
                    raise RangeError(
                        f"{what}: bytes {start}-{end} broke {self.retries + 1} times"
                        f" ({type(err).__name__})"
                    ) from None
                time.sleep(min(2**attempt * 0.2, 5))
            finally:
                response.release_conn()

    @staticmethod
    def _check(
        response: urllib3.BaseHTTPResponse, entry: LockEntry, start: int, end: int, what: str
    ) -> None:
        """The answer is the asked range of a file of the locked size, or NotServed."""
        if response.status in (403, 404):
            response.drain_conn()
            raise NotServed(f"{what}: HTTP {response.status}")
        expected = f"bytes {start}-{end}/{entry.size}"
        got = response.headers.get("Content-Range")
        if response.status != 206 or got != expected:
            response.drain_conn()
            raise NotServed(
                f"{what}: HTTP {response.status} Content-Range {got!r}, expected {expected!r}"
            )
