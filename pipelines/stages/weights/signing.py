"""The model's signature (OpenSSF model signing, in signature.py): where it lives, signing the
lock's manifest with the model key (`doit sign_weights`), and checking it before a deploy."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pipelines.core.errors import BadInput, PipelineError
from pipelines.core.files import MiB, read_capped, write_atomic
from pipelines.core.modellock import Lock, lock_path
from pipelines.core.progress import say
from pipelines.core.settings import Settings

if TYPE_CHECKING:
    from pipelines.core.profiles import Profile
    from pipelines.engine.store import Store


# A lock of 54 files or a signature bundle: some KiB; no verdict is kept for a bigger one.
FILE_MAX_BYTES = 64 * MiB


class ModelSignature:
    """One profile's model signature: made from the lock, checked against the lock and the
    staged folders (their plan of files and overrides, asked for when checked)."""

    def __init__(
        self,
        profile: Profile,
        store: Store,
        settings: Settings,
        complete_lock: Callable[[], Lock],
        plan: Callable[[], dict[str, str]],
        folders: Callable[[], list[Path]],
    ):
        self.profile, self.store, self.settings = profile, store, settings
        self.complete_lock, self.plan, self.folders = complete_lock, plan, folders

    def lock_file(self) -> Path:
        """The profile's lock file."""
        return lock_path(self.profile.model.lock)

    def can_sign(self) -> bool:
        """Whether this run has a model signing key (the environment's, or the local stack's)."""
        from pipelines.stages.weights.modelkeys import model_signer

        return model_signer(self.settings, self._local_keys()) is not None

    def _local_keys(self) -> Path | None:
        """The store's key folder for a local-stack profile (its own model key), else None."""
        return self.store.area("keys") if self.profile.local_stack else None

    @property
    def signature_file(self) -> Path:
        """Where the model's signature lives: beside the lock in the repo, reviewed and shipped
        with it; a local-stack profile's (signed by this machine's key) in the store."""
        name = f"{self.profile.model.lock}.sig"
        if self.profile.local_stack:
            return self.store.area("signatures") / name
        return self.lock_file().with_name(name)

    def sign(self) -> None:
        """Sign the lock's manifest with the model key (`doit sign_weights`)."""
        from pipelines.stages.weights.modelkeys import SIGNING_ENV, model_signer
        from pipelines.stages.weights.signature import sign_lock

        key = model_signer(self.settings, self._local_keys())
        if key is None:
            raise BadInput(
                f"sign_weights: no model signing key: set {SIGNING_ENV} (docs/provenance.md)"
            )
        lock = self.complete_lock()
        sign_lock(lock, key, self.signature_file)
        say("sign_weights", f"{self.signature_file} ({len(lock.files)} files, key {key.name})")

    def signed(self) -> bool:
        """True when the signature verifies and signs the lock as it is.

        The verdict is kept in the store under the hash of what decides it (the signature's
        bytes, the lock's, the trusted keys): a no-op build asks again without loading the model
        signing library (some 0.4 s), and any change to one of them asks the library anew.
        """
        verdict = self._verdict()
        if verdict is not None and verdict.exists():
            return True
        if self.problems(folders=False):
            return False
        if verdict is not None:
            write_atomic(verdict, b"verified\n")
        return True

    def _verdict(self) -> Path | None:
        """Where a verified signature of the lock as it is now is noted (None: nothing to key
        it by, the signature or the lock unreadable, or no trusted key)."""
        from pipelines.stages.weights.modelkeys import model_trusted

        try:
            trusted = model_trusted(self.settings, self._local_keys())
            material = {
                # Read as any file from outside: a FIFO or a device here is refused, not waited on.
                "signature": hashlib.sha256(
                    read_capped(self.signature_file, FILE_MAX_BYTES, PipelineError)
                ).hexdigest(),
                "lock": hashlib.sha256(
                    read_capped(self.lock_file(), FILE_MAX_BYTES, PipelineError)
                ).hexdigest(),
                "trusted": sorted(key.text for key in trusted.values()),
            }
        except (PipelineError, OSError):
            return None
        key = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
        return self.store.area("verified") / key

    def problems(self, folders: bool = True) -> list[str]:
        """One line when the model's signature does not verify: a trusted key, the lock's
        files, and (folders) every staged folder on this machine, hashed by the library."""
        from pipelines.stages.weights.modelkeys import model_trusted
        from pipelines.stages.weights.signature import (
            check_folder,
            check_lock_signed,
            signed_manifest,
        )

        try:
            lock = self.complete_lock()
            trusted = model_trusted(self.settings, self._local_keys())
            signer, manifest = signed_manifest(self.signature_file, trusted)
            check_lock_signed(lock, manifest, self.signature_file)
            if folders:
                plan = self.plan()
                for folder in self.folders():
                    check_folder(folder, lock, plan, manifest, signer)
        except PipelineError as err:
            return [str(err)]
        return []
