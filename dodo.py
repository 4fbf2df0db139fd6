"""The sparkforge task graph: `doit list` shows the stages; `doit build profile=NAME` runs them.

Settings are read here, once, into one Context; each stage is made from it and from what the
stages before it publish, and doit finds each stage's tasks through its `create_doit_tasks`.
A stage with nothing to do for the profile yields no tasks.
"""

import atexit
import os

from doit import get_var

# The stages by package, not by class: doit takes every name here with a create_doit_tasks
# for a task creator, a stage's class included.
from pipelines import gc
from pipelines.core.collector import tune_collector
from pipelines.core.errors import PipelineError, exit_with
from pipelines.core.profiles import load_profile
from pipelines.core.settings import read_settings
from pipelines.core.site import Site
from pipelines.engine.remote import remote_cache
from pipelines.engine.stage import Context
from pipelines.engine.steps import Engine
from pipelines.engine.store import Store
from pipelines.engine.variables import VARIABLES as ALL_VARIABLES
from pipelines.engine.variables import reading
from pipelines.stages import bench, deploy, fabric, images, provenance, render, weights
from pipelines.stages import profile as profile_stage  # `profile` is the profile itself below
from pipelines.stages.deploy.records import who_ran

# doit's name=value arguments a stage reads (engine/variables.py says what each means; `doit
# help TASK` names those the task reads): profile= here, the others into the Context.
VARIABLES = tuple(name for name in ALL_VARIABLES if name != "profile")

tune_collector()


def stack_endpoints():
    """The local stack's registry and engines (a task that needs them asks, not `doit list`)."""
    import devstack  # test equipment: only a local_stack profile reaches for it

    endpoints = devstack.read_endpoints()
    return endpoints.registry, endpoints.docker_hosts or (endpoints.docker_host,)


def site_of(profile, settings) -> Site:
    """Where the profile's images go and its members run: the local stack's, or its own."""
    if not profile.local_stack:
        return Site.named(profile.registry, settings.registry_namespace)
    import devstack

    # Its S3 and ssh keys into the environment: a no-op while the stack is down.
    devstack.export_s3_environment()
    devstack.export_ssh_environment()
    return Site(stack_endpoints, settings.registry_namespace or "")


def run_context(profile_name: str) -> Context:
    """This run's profile, engine (with the remote cache), settings, site and arguments."""
    settings = read_settings(os.environ)
    profile = load_profile(profile_name, settings.profiles)
    remote = remote_cache(
        settings.remote_cache,
        settings.cache_signing_key,
        settings.cache_trusted_keys,
        settings.cache_readonly,
    )
    return Context(
        profile=profile,
        engine=Engine(Store(settings.store), remote=remote),
        settings=settings,
        site=site_of(profile, settings),
        variables={name: get_var(name, "") for name in VARIABLES},
        who=who_ran(os.environ),
        git=images.git_revision,
    )


# The table of stages, in the order a build runs them; each takes what earlier ones publish.
try:
    CONTEXT = run_context(get_var("profile", "local"))
    # Closed at exit, before the collector is told to walk nothing (tune_collector's handler
    # runs after this one): no collection would close it then.
    atexit.register(CONTEXT.engine.store.statcache.close)
    PROFILE = profile_stage.ProfileCheck(CONTEXT)
    WEIGHTS = weights.Weights(CONTEXT)
    IMAGES = images.Images(CONTEXT)
    STAGER = images.Images.stager(CONTEXT, runtime=IMAGES)  # a ring's weights-stager image
    RENDER = render.Render(
        CONTEXT, model=WEIGHTS.outputs, image=IMAGES.published, stager=STAGER.published
    )
    # What a deploy trusts: the image's attestation, signed by a trusted key, of today's inputs.
    TRUST = provenance.ImageTrust(
        CONTEXT, attestation=IMAGES.attestation_of, key=IMAGES.current_key
    )
    DEPLOY = deploy.Deploy(
        CONTEXT,
        render=RENDER.step,
        tags=IMAGES.tags,
        model=WEIGHTS.outputs,
        stager=STAGER.published,
        provenance=TRUST.problems,
    )
    PROVENANCE = provenance.Provenance(
        CONTEXT,
        trust=TRUST,
        live=DEPLOY.live_record,
        candidate=IMAGES.published.ref,
        model=WEIGHTS.outputs.signature_problems,
    )
    # Rings with a data plane to check; a check older than the live deployment is stale.
    FABRIC = fabric.Fabric(CONTEXT, render=RENDER.step, live=DEPLOY.live_record)
    BENCH = bench.Bench(CONTEXT, live=DEPLOY.live, fabric_refusal=FABRIC.refusal)
    GC = gc.Gc(CONTEXT, image=IMAGES.published, repository=IMAGES.repository)  # `doit gc`
except PipelineError as err:
    # Before any task: one line and the error's code (2 for a bad profile or setting, README's
    # "Exit codes"); SystemExit passes through doit's loader untouched.
    exit_with(err)
except OSError as err:  # the disk's own (full, read-only), as a step reports it: 1
    exit_with(PipelineError(f"{type(err).__name__}: {err}"))

DOIT_CONFIG = {"default_tasks": ["build"], "dep_file": str(CONTEXT.settings.store / "doit.sqlite3")}


def task_build():
    """build everything the chosen profile deploys (profile=NAME, default local)"""
    deps = [PROFILE.step.name, IMAGES.image_step.name, WEIGHTS.outputs.stage_task]
    deps += [RENDER.step.name, *STAGER.published.tasks]
    reads = reading(("image_digest", "stager_digest", "platform"))
    return {"actions": [GC.log_build], "uptodate": [GC.build_logged], "task_dep": deps, **reads}
