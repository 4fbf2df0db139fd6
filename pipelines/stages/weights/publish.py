"""Batched publication: verified files enter the blob store after one sync for the whole batch.

A writer that has verified a file hands it over, with the flock that makes it the file's only
writer, and goes on with its next file. One thread publishes: it takes every file handed over
so far, waits once for the store's filesystem to be durable (syncfs), then renames each into
blobs/sha256/, fsyncs that folder once and records the batch in the stat cache; files handed
over while it waits form the next batch (group commit). So no name under blobs/ ever points
to bytes that are unverified or not yet on disk, and a kill at any point leaves at worst a
whole, verified partial file, which the next fetch reads back and publishes.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from pipelines.core.errors import PipelineError
from pipelines.core.files import sync_files
from pipelines.stages.weights.blobs import BlobStore


class PublishError(PipelineError):
    """A verified file could not be made durable or renamed into the store."""


@dataclass
class Verified:
    """A partial file whose sha256 matched, waiting to enter the store."""

    name: str
    part: Path
    sha256: str
    writer: IO[str]  # the open flock of its one writer, released once it is published or dropped
    done: Future[None] = field(default_factory=Future)


class Publisher:
    """Publishes verified partial files in batches: one sync, the renames, one folder fsync."""

    def __init__(self, blobs: BlobStore, durable: bool):
        self.blobs = blobs
        self.durable = durable
        # Opened before any byte of this fetch is written: syncfs reports the filesystem's
        # writeback errors since this open (a failed write is then never published).
        self._anchor = os.open(blobs.root, os.O_RDONLY | os.O_DIRECTORY) if durable else None
        self.sync_failed: Exception | None = None  # the first sync error of this fetch
        self._queue: queue.SimpleQueue[Verified | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="publish", daemon=True)
        self._thread.start()

    def submit(self, name: str, part: Path, sha256: str, writer: IO[str]) -> Future[None]:
        """Hand over a verified file and its writer's flock; done once it is in the store."""
        item = Verified(name, part, sha256, writer)
        self._queue.put(item)
        return item.done

    def close(self) -> None:
        """Publish everything handed over, then stop (idempotent)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self._anchor is not None:
            os.close(self._anchor)
            self._anchor = None

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            with contextlib.suppress(queue.Empty):
                while True:
                    batch.append(self._queue.get_nowait())
            files = [item for item in batch if item is not None]
            if files:
                self._publish(files)
            if None in batch:
                return

    def _publish(self, files: list[Verified]) -> None:
        """Sync, then rename: a file whose bytes are not known durable is never published."""
        if self.sync_failed is not None:
            # syncfs reports a writeback error once per open anchor, for the whole filesystem:
            # the file that failed may be in this batch, and no later sync would say so again.
            self._drop(files, f"an earlier sync of this fetch failed ({self.sync_failed})")
            return
        try:
            if self._anchor is not None:
                sync_files(self._anchor, [item.part for item in files])
        except Exception as err:  # a writeback error (EIO) above all; every writer hears back
            self.sync_failed = err
            self._drop(files, err)
            return
        try:
            self.blobs.publish_many([(item.part, item.sha256) for item in files])
        except Exception as err:  # every writer must hear back, whatever went wrong
            self._finish(files, err)
            return
        self._finish(files, None)

    def _drop(self, files: list[Verified], error: Exception | str) -> None:
        """Remove the batch's part files and tell each writer: none of them is published."""
        # Bytes that may not be on disk must not be read back as a verified prefix either.
        for item in files:
            item.part.unlink(missing_ok=True)
        self._finish(files, error)

    @staticmethod
    def _finish(files: list[Verified], error: Exception | str | None) -> None:
        """Release each file's flock, then tell its writer how publication went."""
        for item in files:
            item.writer.close()
            if error is None:
                item.done.set_result(None)
            else:
                item.done.set_exception(PublishError(f"{item.name}: not stored: {error}"))
