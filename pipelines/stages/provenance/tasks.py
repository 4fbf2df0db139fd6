"""`doit provenance`: what a profile deploys, who built it, from what, and whether each check
passes (the image's attestation, the model's signature); and the image check deploy's
preflight makes before it touches any member."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from functools import cached_property
from typing import Any

from pipelines.core.progress import show
from pipelines.core.signing.keyring import deploy_trusted
from pipelines.core.signing.namedkeys import PublicKey
from pipelines.engine.stage import Context
from pipelines.engine.steps import side_task
from pipelines.stages.provenance.checks import ImageCheck, check_image


class ImageTrust:
    """Judges an image by its attestation in the registry against the keys a deploy trusts
    and the inputs key this checkout computes (both published by the images stage)."""

    def __init__(
        self,
        context: Context,
        *,
        attestation: Callable[[str], bytes | None],
        key: Callable[[], str],
    ):
        self.settings = context.settings
        # A local-stack profile trusts the key its store signs with (keyring.py).
        local = context.profile.local_stack
        self.local_keys = (lambda: context.engine.store.area("keys")) if local else None
        self.attestation = attestation  # the envelope attached to an image ref, or None
        self.key = key  # the image's inputs key now

    @cached_property
    def trusted(self) -> dict[str, PublicKey]:
        """The keys whose attestations are accepted (read when first needed)."""
        return deploy_trusted(self.settings, self.local_keys() if self.local_keys else None)

    def check(self, ref: str) -> ImageCheck:
        """The image's attestation, judged (the trusted keys parsed first: a bad setting is
        one line before any registry call)."""
        trusted = self.trusted
        return check_image(ref, self.attestation(ref), self.key(), trusted)

    def problems(self, ref: str) -> list[str]:
        """One line per failed check of the image ref (none: it may be deployed)."""
        problem = self.check(ref).problem
        return [problem] if problem else []


class Provenance:
    """The `provenance` task of a profile: the image deployed (or, with nothing deployed, the
    one a deploy would take) and what its attestation says."""

    name = "provenance"

    def __init__(
        self,
        context: Context,
        *,
        trust: ImageTrust,
        live: Callable[[], dict[str, Any] | None],
        candidate: Callable[[], str],
        model: Callable[[], list[str]],
    ):
        self.profile = context.profile
        self.model = model  # one line when the model's signature does not verify, else none
        self.trust = trust
        self.live = live  # the live deployment's record, or None
        self.candidate = candidate  # the image this checkout would deploy, pinned by digest

    def report(self) -> dict[str, Any]:
        """What is deployed and what its attestation says, with each check's outcome."""
        live = self.live()
        ref = live["deployment"]["image"] if live else self.candidate()
        check = self.trust.check(ref)
        predicate = check.predicate
        definition = predicate.get("buildDefinition", {})
        run = predicate.get("runDetails", {})
        return {
            "profile": self.profile.name,
            "image": ref,
            "deployed": bool(live),
            "signed_by": check.opened.signer if check.opened else None,
            "built_by": run.get("builder", {}).get("id"),
            "built": run.get("metadata"),
            "source": definition.get("externalParameters", {}).get("source"),
            "inputs_key": definition.get("externalParameters", {}).get("key"),
            "inputs": definition.get("resolvedDependencies"),
            "checks": {
                "attestation": check.problem
                or "passes: present, signed by a trusted key,"
                " about this digest, from the inputs this checkout computes",
                "model_signature": "; ".join(self.model())
                or "passes: signed by a trusted model key, of this lock's files, and the"
                " folders staged on this machine hash as signed",
            },
            "trusted_keys": sorted(self.trust.trusted),
        }

    def show(self) -> None:
        """Print the report (JSON: a user reads it, a script parses it)."""
        show(json.dumps(self.report(), indent=2))

    def create_doit_tasks(self) -> Iterator[dict[str, Any]]:
        """The one `provenance` task."""
        yield side_task(
            "provenance",
            "print what the profile deploys, who built it, from what, and each check's outcome",
            self.show,
            variables=("image_digest",),
        )
