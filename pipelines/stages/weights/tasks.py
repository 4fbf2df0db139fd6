"""The weights stage as doit tasks: upload (synthetic), lock, fetch, patch, stage, verify.

Words: the *lock* is the lock file (`weights/<model>.lock.yaml`); *hashing the bucket* writes
it; a blob has *one writer* at a time (an flock); nothing else here is called a lock.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelines.core.errors import PipelineError
from pipelines.core.modellock import (
    Lock,
    LockError,
    cache_key,
    load_lock,
    lock_path,
    require_locked,
    write_lock,
)
from pipelines.core.paths import PATCH_SOURCE
from pipelines.core.progress import say, show
from pipelines.engine.stage import Context
from pipelines.engine.steps import Step, StepRun, side_task
from pipelines.stages.weights.blobs import BlobStore
from pipelines.stages.weights.options import WeightsSettings
from pipelines.stages.weights.patch import (
    ORIG_SUFFIX,
    config_bytes,
    patch_tp3,
    read_config,
    read_overrides,
)
from pipelines.stages.weights.signing import ModelSignature
from pipelines.stages.weights.stage import is_staged, stage, stage_plan, staged_from

if TYPE_CHECKING:
    from types_boto3_s3 import S3Client

    from pipelines.stages.weights.ringplan import RingPlan

SYNTHETIC_LOCK = "dsv41-flash-synthetic"


@dataclass(frozen=True)
class ModelOutputs:
    """What the weights stage publishes for other stages: the lock and the patch program."""

    lock_file: Path
    patch_source: Path
    weights: Weights

    @property
    def node_weights_root(self) -> str:
        """Where the members keep the weights: this machine's store for local-stack profiles."""
        profile = self.weights.profile
        return str(self.weights.settings.root) if profile.local_stack else profile.node_weights_root

    # The task that leaves the model staged on this machine (what `doit build` needs).
    stage_task = "stage_weights"

    @property
    def source_tasks(self) -> tuple[str, ...]:
        """The tasks that put the model into its bucket (the local stack's synthetic model)."""
        return ("synthetic_model",) if self.weights.profile.model.lock == SYNTHETIC_LOCK else ()

    def is_locked(self) -> bool:
        """Whether the lock names every file's size and sha256 (what a ring plan needs)."""
        try:
            return all(e.sha256 and e.size is not None for e in self.read_lock().files)
        except (PipelineError, OSError):
            return False

    def member_roots(self) -> list[str]:
        """Each member's weights folder, by rank: its own where the profile names one."""
        root = self.node_weights_root
        return [m.weights_root or root for m in self.weights.profile.members]

    def model_folder(self) -> str:
        """The staged model's folder under a weights root (models/<cacheKey>)."""
        return f"models/{cache_key(self.weights.profile.model.source)}"

    def ring_plan_json(self) -> str:
        """The ring's staging plan (`doit plan_weights`), as its members read it."""
        from pipelines.stages.weights.ringplan import plan_json

        return plan_json(self.weights.ring_plan())

    def read_lock(self) -> Lock:
        """The profile's lock, checked against the profile's source."""
        return self.weights.read_lock()

    def signature_problems(self) -> list[str]:
        """One line when the model's signature does not verify (deploy asks before it touches
        any member): the lock signed by a trusted key, this machine's staged folders as signed."""
        return self.weights.signature.problems()

    def patch_source_text(self) -> str:
        """The config patch program, as the patch Job runs it."""
        return self.patch_source.read_text()


class Weights:
    """The weights of one profile: its lock, blob store, staged folder and the tasks on them."""

    name = "weights"

    def __init__(self, context: Context):
        profile, engine = context.profile, context.engine
        settings = WeightsSettings.of(context.settings, engine.store.area("weights"))
        self.profile = profile
        self.engine = engine
        self.settings = settings
        self.engine_settings = context.settings
        self.lock_file = lock_path(profile.model.lock)
        self.blobs = BlobStore(settings.root, engine.store.statcache)
        self.patch = self._patch_step() if profile.model.config_patch == "tp3-heads" else None
        self.outputs = ModelOutputs(self.lock_file, PATCH_SOURCE, self)
        self._lock: tuple[Any, Lock] | None = None
        self.signature = ModelSignature(
            profile,
            engine.store,
            context.settings,
            self.complete_lock,
            lambda: stage_plan(self.complete_lock(), self.overrides()),
            self.local_folders,
        )

    @cached_property
    def client(self) -> S3Client:
        """The S3 client (created on first use: no-op runs never need one)."""
        from pipelines.stages.weights.s3 import s3_client

        return s3_client()

    def read_lock(self) -> Lock:
        """The profile's lock, checked against the profile's source (parsed once per version)."""
        try:
            st = self.lock_file.stat()
            version = (st.st_ino, st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            version = None
        if self._lock is None or self._lock[0] != version:
            self._lock = (version, load_lock(self.lock_file))
        lock = self._lock[1]
        if lock.source != self.profile.model.source:
            raise LockError(
                f"{self.lock_file}: field 'source': expected {self.profile.model.source!r}"
                f" (profile {self.profile.name} model.source), got {lock.source!r}"
            )
        return lock

    def complete_lock(self) -> Lock:
        """The lock, refusing entries without a hash."""
        lock = self.read_lock()
        require_locked(lock, self.lock_file)
        return lock

    @property
    def folder(self) -> Path:
        """The staged model folder, named like the operator's cache: sha256(source)[:16]."""
        return self.blobs.models / cache_key(self.profile.model.source)

    # --- synthetic model (local profile) -------------------------------------------------

    def synthetic_uploaded(self) -> bool:
        """True when the bucket holds exactly the locked synthetic files (one LIST call)."""
        from pipelines.core.s3 import s3_errors
        from pipelines.stages.weights.bucket import list_objects
        from pipelines.stages.weights.s3 import S3Url

        lock = self.read_lock()
        if lock.unlocked():
            return False
        with s3_errors(lock.source):
            objects = list_objects(self.client, S3Url.parse(lock.source))
        return all(objects.get(e.name) == {"size": e.size, "etag": e.etag} for e in lock.files)

    def upload_synthetic(self) -> None:
        """Generate the synthetic model and put it in the bucket."""
        from pipelines.core.s3 import s3_errors
        from pipelines.stages.weights.synthetic import SyntheticShape, upload_synthetic

        source = self.profile.model.source
        with s3_errors(source):
            sent = upload_synthetic(self.client, source, SyntheticShape())
        say("synthetic_model", f"uploaded {sent / (1 << 20):.1f} MiB to {source}")

    # --- hashing the bucket into the lock file ---------------------------------------------

    def write_lock_from_bucket(self) -> None:
        """Hash every object under the source once and write the lock."""
        from pipelines.core.s3 import s3_errors
        from pipelines.stages.weights.bucket import hash_bucket

        previous = load_lock(self.lock_file) if self.lock_file.exists() else None
        source = self.profile.model.source
        with s3_errors(source):
            lock = hash_bucket(self.client, self.profile.model.lock, source, previous)
        write_lock(lock, self.lock_file)
        say("lock_weights", f"wrote {self.lock_file} ({len(lock.files)} files, {lock.size:,} B)")
        if self.signature.can_sign():
            self.signature.sign()

    def local_folders(self) -> list[Path]:
        """The staged folders of this profile on this machine (a local-stack profile's members'
        roots), each once; a ring's own members verify theirs against the lock's record."""
        if not self.profile.local_stack:
            return []
        roots = dict.fromkeys(Path(r) for r in self.outputs.member_roots())
        folders = [root / self.outputs.model_folder() for root in roots]
        return [f for f in folders if f.is_dir()]

    # --- fetch -----------------------------------------------------------------------------

    def fetched(self) -> bool:
        """True when every locked file's blob is intact (stats only, for unchanged blobs)."""
        return not self.blobs.missing(self.complete_lock())

    def fetch(self) -> None:
        """Fetch what the blob store lacks."""
        from pipelines.core.s3 import s3_errors
        from pipelines.stages.weights.fetch import fetch_lock

        lock = self.complete_lock()
        with s3_errors(lock.source):
            report = fetch_lock(self.client, lock, self.blobs, self.settings.fetch)
        show(
            f"fetch_weights: {len(report.fetched)} fetched, {len(report.reused)} already stored,"
            f" {report.downloaded:,} B downloaded, {report.read_back:,} B read back to resume"
        )

    # --- TP3 patch -------------------------------------------------------------------------

    def _patch_step(self) -> Step:
        """The keyed step writing the padded config.json as a new blob (the fetched one stays)."""

        def write_patched(run: StepRun) -> None:
            config_sha = run.params["config_sha256"]
            config = read_config(self.blobs.blob(config_sha))
            patched = config_bytes(patch_tp3(config, "config.json"))
            (run.out / "config.json").write_bytes(patched)
            patched_sha = self.blobs.add_bytes(patched)
            overrides = {"config.json": patched_sha, "config.json" + ORIG_SUFFIX: config_sha}
            (run.out / "overrides.json").write_text(json.dumps(overrides, indent=2))

        return Step(
            name="patch_config",
            recipe="tp3-heads",
            version=1,
            doc="pad config.json for TP3 (64 -> 72 heads, 8 -> 9 o_groups) as a new blob",
            action=write_patched,
            # The locked config's hash; an unusable lock fails here, in one line, not later.
            params=lambda: {"config_sha256": self.complete_lock().entry("config.json").sha256},
            after=("fetch_weights",),
        )

    def overrides(self) -> dict[str, str]:
        """Files the patch step swapped in, or none."""
        if self.patch is None:
            return {}
        return read_overrides(self.engine.output(self.patch) / "overrides.json")

    def restore_patched_blob(self) -> None:
        """Put the patched config back in the blob store from the step's output if it went."""
        if self.patch is not None:
            self.blobs.add_bytes((self.engine.output(self.patch) / "config.json").read_bytes())

    # --- stage -----------------------------------------------------------------------------

    def staged(self) -> bool:
        """True when the model folder is exactly the plan (stats only)."""
        if self.patch is not None and not self.engine.is_done(self.patch):
            return False
        plan = stage_plan(self.complete_lock(), self.overrides())
        return is_staged(self.folder, plan, self.blobs) and staged_from(self.folder) == (
            self.lock_sha256()
        )

    def lock_sha256(self) -> str:
        """The sha256 of the lock file's bytes: what a staged folder records it came from."""
        return hashlib.sha256(self.lock_file.read_bytes()).hexdigest()

    def stage(self) -> None:
        """Link the model folder to the blobs, then record the lock it was staged from."""
        self.restore_patched_blob()
        plan = stage_plan(self.complete_lock(), self.overrides())
        linked = stage(self.folder, plan, self.blobs, self.lock_sha256())
        say("stage_weights", f"{self.folder} ({len(linked)} names linked)")

    # --- verify ----------------------------------------------------------------------------

    def verify(self) -> None:
        """Re-hash every blob of the lock now (in parallel, past the stat cache); drop bad ones."""
        from pipelines.stages.weights.verify import verify_model

        verify_model(
            self.complete_lock(), self.lock_file.name, self.blobs, self.folder, self.staged
        )

    # --- ring staging ----------------------------------------------------------------------

    def ring_plan(self) -> RingPlan:
        """Who fetches which file from S3 and from which peers (a pure function of the lock)."""
        from pipelines.stages.weights.ringtasks import profile_ring_plan

        return profile_ring_plan(self.profile, self.complete_lock(), self.lock_sha256())

    def print_ring_plan(self) -> None:
        """Print the ring staging plan and write it where each member's run can read it."""
        from pipelines.stages.weights.ringtasks import write_ring_plan

        path = self.engine.store.root / "ring" / f"{self.profile.name}.plan.json"
        write_ring_plan(self.ring_plan(), path, self.outputs.node_weights_root)

    # --- doit tasks ------------------------------------------------------------------------

    def create_doit_tasks(self) -> Iterator[dict[str, Any]]:
        """The doit task dicts of the weights stage for this profile."""
        tasks = []
        fetch_setup = []
        if self.profile.model.lock == SYNTHETIC_LOCK:
            tasks.append(
                side_task(
                    "synthetic_model",
                    "generate the small synthetic model and upload it to the local S3",
                    self.upload_synthetic,
                    uptodate=answer_or_run(self.synthetic_uploaded),
                )
            )
            fetch_setup.append("synthetic_model")
        tasks.append(
            side_task(
                "lock_weights",
                "hash every object of the model's source once and write its lock file",
                self.write_lock_from_bucket,
                deps=list(fetch_setup),
            )
        )
        tasks.append(
            side_task(
                "sign_weights",
                "sign the lock's manifest (OpenSSF model signing) with the model key",
                self.signature.sign,
                uptodate=answer_or_run(self.signature.signed),
            )
        )
        fetch = side_task(
            "fetch_weights",
            "fetch the locked files from S3 into the blob store, sha256-checked",
            self.fetch,
            uptodate=answer_or_run(self.fetched),
        )
        # A doit setup task runs only when fetch_weights itself must: a build whose blobs are
        # all here never asks the bucket whether the synthetic model is uploaded.
        fetch["setup"] = fetch_setup
        tasks.append(fetch)
        stage_deps = ["fetch_weights"]
        if self.profile.local_stack:
            # This machine's key signs a local-stack model: a build leaves it signed.
            stage_deps.append("sign_weights")
        if self.patch is not None:
            tasks.append(self.engine.task(self.patch))
            stage_deps.append(self.patch.name)
        tasks.append(
            side_task(
                "stage_weights",
                "link the model folder <weights>/models/<cacheKey> to the verified blobs",
                self.stage,
                uptodate=answer_or_run(self.staged),
                deps=stage_deps,
            )
        )
        tasks.append(
            side_task(
                "plan_weights",
                "print who fetches each file from S3 and from which peers (ring staging)",
                self.print_ring_plan,
            )
        )
        tasks.append(
            side_task(
                "verify_weights",
                "re-hash every blob and staged file of the model now, in parallel",
                self.verify,
            )
        )
        yield from tasks


def answer_or_run(check: Callable[[], bool]) -> Callable[[], bool]:
    """An uptodate check that says 'run' when it cannot answer: the action then says why."""

    def uptodate() -> bool:
        try:
            return check()
        except (PipelineError, FileNotFoundError):
            return False

    return uptodate
