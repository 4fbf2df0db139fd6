"""The weights stage as doit tasks: upload (synthetic), lock, fetch, patch, stage, verify."""

from __future__ import annotations

import json
import os
from functools import cached_property
from pathlib import Path
from typing import Any

from pipelines.errors import PipelineError
from pipelines.profiles import Profile
from pipelines.s3 import S3Url, describe_s3_error, s3_client
from pipelines.steps import Engine, Step, StepRun, side_task
from pipelines.weights.fetch import BlobStore, FetchOptions, fetch_lock
from pipelines.weights.lock import (
    Lock,
    LockError,
    cache_key,
    load_lock,
    lock_path,
    require_locked,
    write_lock,
)
from pipelines.weights.locking import list_objects, lock_from_bucket
from pipelines.weights.patch import ORIG_SUFFIX, config_bytes, patch_tp3, read_config
from pipelines.weights.stage import is_staged, stage, stage_plan
from pipelines.weights.synthetic import SyntheticShape, upload_synthetic

WEIGHTS_ENV = "SPARKFORGE_WEIGHTS"
SYNTHETIC_LOCK = "dsv41-flash-synthetic"


def weights_root(engine: Engine) -> Path:
    """Blobs and staged models: $SPARKFORGE_WEIGHTS, else `weights/` in the store folder."""
    return Path(os.environ.get(WEIGHTS_ENV) or engine.store.root / "weights").absolute()


def fetch_options_from_env() -> FetchOptions:
    """Fetch tuning, per node: SPARKFORGE_FETCH_{PART_MIB,WORKERS,MAX_MBPS,FSYNC}."""
    defaults = FetchOptions()

    def number(name: str, default: float) -> float:
        value = os.environ.get(name)
        if not value:
            return default
        try:
            parsed = float(value)
        except ValueError:
            parsed = 0
        if parsed <= 0:
            raise PipelineError(f"environment {name}={value!r}: expected a positive number")
        return parsed

    rate = number("SPARKFORGE_FETCH_MAX_MBPS", 0)
    return FetchOptions(
        part_size=int(
            number("SPARKFORGE_FETCH_PART_MIB", defaults.part_size / (1 << 20)) * (1 << 20)
        ),
        workers=int(number("SPARKFORGE_FETCH_WORKERS", defaults.workers)),
        max_rate=rate * 1e6 if rate else None,
        durable=os.environ.get("SPARKFORGE_FETCH_FSYNC", "1") != "0",
    )


class Weights:
    """The weights of one profile: its lock, blob store, staged folder and the tasks on them."""

    def __init__(self, profile: Profile, engine: Engine, client_factory=s3_client):
        self.profile = profile
        self.engine = engine
        self.lock_file = lock_path(profile.model.lock)
        self.blobs = BlobStore(weights_root(engine), engine.store.statcache)
        self._client_factory = client_factory
        self._patch = self.patch_step() if profile.model.config_patch == "tp3-heads" else None

    @cached_property
    def client(self):
        """The S3 client (created on first use: no-op runs never need one)."""
        return self._client_factory()

    def lock(self) -> Lock:
        """The profile's lock, checked against the profile's source."""
        lock = load_lock(self.lock_file)
        if lock.source != self.profile.model.source:
            raise LockError(
                f"{self.lock_file}: field 'source': expected {self.profile.model.source!r}"
                f" (profile {self.profile.name} model.source), got {lock.source!r}"
            )
        return lock

    def locked(self) -> Lock:
        """The lock, refusing entries without a hash."""
        lock = self.lock()
        require_locked(lock, self.lock_file)
        return lock

    @property
    def folder(self) -> Path:
        """The staged model folder, named like the operator's cache: sha256(source)[:16]."""
        return self.blobs.models / cache_key(self.profile.model.source)

    # --- synthetic model (local profile) -------------------------------------------------

    def synthetic_uploaded(self) -> bool:
        """True when the bucket holds exactly the locked synthetic files (one LIST call)."""
        lock = self.lock()
        if lock.unlocked():
            return False
        try:
            objects = list_objects(self.client, S3Url.parse(lock.source))
        except Exception:  # an unreachable store: the action says so in one line
            return False
        return all(objects.get(e.name) == {"size": e.size, "etag": e.etag} for e in lock.files)

    def upload_synthetic(self) -> None:
        """Generate the synthetic model and put it in the bucket."""
        try:
            sent = upload_synthetic(self.client, self.profile.model.source, SyntheticShape())
        except PipelineError:
            raise
        except Exception as err:
            raise PipelineError(describe_s3_error(err, self.profile.model.source)) from None
        print(
            f"synthetic_model: uploaded {sent / (1 << 20):.1f} MiB to {self.profile.model.source}"
        )

    # --- lock ------------------------------------------------------------------------------

    def write_lock_from_bucket(self) -> None:
        """Hash every object under the source once and write the lock."""
        previous = load_lock(self.lock_file) if self.lock_file.exists() else None
        lock = lock_from_bucket(
            self.client, self.profile.model.lock, self.profile.model.source, previous
        )
        write_lock(lock, self.lock_file)
        print(f"lock_weights: wrote {self.lock_file} ({len(lock.files)} files, {lock.size:,} B)")

    # --- fetch -----------------------------------------------------------------------------

    def fetched(self) -> bool:
        """True when every locked file's blob is intact (stats only, for unchanged blobs)."""
        try:
            return not self.blobs.missing(self.locked())
        except PipelineError:
            return False

    def fetch(self) -> None:
        """Fetch what the blob store lacks."""
        report = fetch_lock(self.client, self.locked(), self.blobs, fetch_options_from_env())
        print(
            f"fetch_weights: {len(report.fetched)} fetched, {len(report.reused)} already stored,"
            f" {report.downloaded:,} B downloaded, {report.read_back:,} B read back to resume"
        )

    # --- TP3 patch -------------------------------------------------------------------------

    def patch_step(self) -> Step:
        """The keyed step writing the padded config.json as a new blob (the fetched one stays)."""
        config_sha = self.locked_config_sha()

        def write_patched(run: StepRun) -> None:
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
            params={"config_sha256": config_sha},
        )

    def locked_config_sha(self) -> str:
        """The locked sha256 of config.json ('' while the lock is unusable; fetch reports why)."""
        try:
            return self.locked().entry("config.json").sha256
        except PipelineError:
            return ""

    def overrides(self, patch: Step | None) -> dict[str, str]:
        """Files the patch step swapped in, or none."""
        if patch is None:
            return {}
        return json.loads((self.engine.output(patch) / "overrides.json").read_text())

    def restore_patched_blob(self, patch: Step | None) -> None:
        """Put the patched config back in the blob store from the step's output if it went."""
        if patch is not None:
            self.blobs.add_bytes((self.engine.output(patch) / "config.json").read_bytes())

    # --- stage -----------------------------------------------------------------------------

    def staged(self, patch: Step | None) -> bool:
        """True when the model folder is exactly the plan (stats only)."""
        try:
            if patch is not None and not self.engine.is_done(patch):
                return False
            plan = stage_plan(self.locked(), self.overrides(patch))
            return is_staged(self.folder, plan, self.blobs)
        except (PipelineError, FileNotFoundError):
            return False

    def stage(self, patch: Step | None) -> None:
        """Link the model folder to the blobs."""
        self.restore_patched_blob(patch)
        linked = stage(self.folder, stage_plan(self.locked(), self.overrides(patch)), self.blobs)
        print(f"stage_weights: {self.folder} ({len(linked)} names linked)")

    # --- verify ----------------------------------------------------------------------------

    def verify(self) -> None:
        """Re-hash every blob of the lock now (in parallel, past the stat cache); drop bad ones."""
        lock = self.locked()
        blobs = {e.name: self.blobs.blob(e.sha256).absolute() for e in lock.files}
        digests = self.blobs.statcache.digest_files(
            [path for path in blobs.values() if path.exists()], fresh=True
        )
        bad = [e for e in lock.files if digests.get(blobs[e.name]) != e.sha256]
        for e in bad:
            # Neither the blob nor a staged name of its inode may be trusted again.
            for path in (self.folder / e.name, blobs[e.name]):
                path.unlink(missing_ok=True)
        if bad:
            raise PipelineError(
                "verify_weights: "
                + "; ".join(
                    f"{e.name}: expected {e.sha256}, got {digests.get(blobs[e.name], 'no blob')}"
                    for e in bad
                )
                + " (removed; `doit build` fetches them again)"
            )
        if self.folder.exists() and not self.staged(self._patch):
            raise PipelineError(
                f"verify_weights: {self.folder} differs from the lock; run `doit stage_weights`"
            )
        print(f"verify_weights: {len(lock.files)} files re-hashed, all match {self.lock_file.name}")

    # --- doit tasks ------------------------------------------------------------------------

    def tasks(self) -> list[dict[str, Any]]:
        """The doit task dicts of the weights stage for this profile."""
        tasks = []
        fetch_deps = []
        if self.profile.model.lock == SYNTHETIC_LOCK:
            tasks.append(
                side_task(
                    "synthetic_model",
                    "generate the small synthetic model and upload it to the local S3",
                    self.upload_synthetic,
                    uptodate=self.synthetic_uploaded,
                )
            )
            fetch_deps.append("synthetic_model")
        tasks.append(
            side_task(
                "lock_weights",
                "hash every object of the model's source once and write its lock file",
                self.write_lock_from_bucket,
                deps=list(fetch_deps),
            )
        )
        tasks.append(
            side_task(
                "fetch_weights",
                "fetch the locked files from S3 into the blob store, sha256-checked",
                self.fetch,
                uptodate=self.fetched,
                deps=fetch_deps,
            )
        )
        patch = self._patch
        stage_deps = ["fetch_weights"]
        if patch is not None:
            task = self.engine.task(patch)
            task["task_dep"] = ["fetch_weights"]
            tasks.append(task)
            stage_deps.append(patch.name)
        tasks.append(
            side_task(
                "stage_weights",
                "link the model folder <weights>/models/<cacheKey> to the verified blobs",
                lambda: self.stage(patch),
                uptodate=lambda: self.staged(patch),
                deps=stage_deps,
            )
        )
        tasks.append(
            side_task(
                "verify_weights",
                "re-hash every blob and staged file of the model now, in parallel",
                self.verify,
            )
        )
        return tasks
