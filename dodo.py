"""The sparkforge task graph: `doit list` shows the stages; `doit build profile=NAME` runs them.

Settings and the local stack's endpoints are read here, once, and handed to the stages; the
stages meet only through what each publishes (a lock, an image reference, a manifests step).
"""

import os

from doit import get_var

from pipelines.bench import Bench, BenchSettings
from pipelines.cache import remote_cache
from pipelines.deploy import Deploy, DeploySettings, KubeAccess, RingStaging
from pipelines.deploy.records import who_ran
from pipelines.errors import PipelineError, exit_with
from pipelines.fabric import Fabric, FabricSettings, fabric_refusal
from pipelines.images import Images, ImageSettings, git_revision
from pipelines.profile_check import ProfileCheck
from pipelines.profiles import load_profile
from pipelines.render import Render
from pipelines.settings import read_settings
from pipelines.site import Site
from pipelines.steps import Engine
from pipelines.store import Store
from pipelines.weights import FetchOptions, Weights, WeightsSettings

PROFILE_NAME = get_var("profile", "local")
IMAGE_DIGEST = get_var("image_digest", "")
STAGER_DIGEST = get_var("stager_digest", "")  # the weights-stager image CI pushed
FABRIC_EXPECT = get_var("expect", "")  # `doit fabric expect=P2P>=200`: a hand-given expectation


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


def fetch_options(settings) -> FetchOptions:
    """This node's fetch tuning: the environment's, else the defaults."""
    default = FetchOptions()
    mib = settings.fetch_part_mib
    return FetchOptions(
        part_size=int(mib * (1 << 20)) if mib else default.part_size,
        workers=settings.fetch_workers or default.workers,
        max_rate=settings.fetch_max_mbps * 1e6 if settings.fetch_max_mbps else None,
        durable=settings.fetch_durable,
    )


try:
    SETTINGS = read_settings(os.environ)
    PROFILE = load_profile(PROFILE_NAME, SETTINGS.profiles)
    REMOTE = remote_cache(
        SETTINGS.remote_cache,
        SETTINGS.cache_signing_key,
        SETTINGS.cache_trusted_keys,
        SETTINGS.cache_readonly,
    )
    ENGINE = Engine(Store(SETTINGS.store), remote=REMOTE)
    SITE = site_of(PROFILE, SETTINGS)
    PROFILE_CHECK = ProfileCheck(PROFILE_NAME, ENGINE, SETTINGS.profiles)
    WEIGHTS = Weights(
        PROFILE,
        ENGINE,
        WeightsSettings(SETTINGS.weights or ENGINE.store.area("weights"), fetch_options(SETTINGS)),
    )
    IMAGES = Images(PROFILE, ENGINE, ImageSettings(SITE, SETTINGS.builder))
    KUBERNETES = PROFILE.deploy == "kubernetes"
    # A ring stages its weights member to member, in its own image (images/weights-stager).
    STAGER = (
        Images(
            PROFILE,
            ENGINE,
            ImageSettings(SITE, SETTINGS.builder),
            image=PROFILE.staging.image,
            prefix="stager_",
            digest_var="stager_digest",
            platform=IMAGES.platform,  # the ring's: the runtime image's platform
        )
        if len(PROFILE.members) > 1
        else None
    )
    # A Kubernetes ring stages in Jobs once its lock is complete (the plan needs every hash).
    K8S_STAGING = bool(STAGER) and KUBERNETES and WEIGHTS.outputs.is_locked()
    RENDER = Render(
        PROFILE,
        ENGINE,
        WEIGHTS.outputs,
        lambda: IMAGES.image_ref(IMAGE_DIGEST),
        list(SETTINGS.secrets),
        after=(() if IMAGE_DIGEST else ("image",))
        + (("stager_image",) if K8S_STAGING and not STAGER_DIGEST else ()),
        stager_image=(lambda: STAGER.image_ref(STAGER_DIGEST)) if K8S_STAGING else None,
    )
    DEPLOY = (
        Deploy(
            PROFILE,
            ENGINE,
            RENDER.step,
            IMAGES,
            WEIGHTS.lock_file,
            DeploySettings(
                SITE,
                SETTINGS.deploy_timeout_s,
                who_ran(os.environ),
                git_revision,
                KubeAccess(
                    SETTINGS.kubeconfig,
                    SETTINGS.kube_context,
                    SETTINGS.kube_dry_run,
                    stage_timeout_s=SETTINGS.stage_timeout_s,
                ),
            ),
            RingStaging(
                lambda: STAGER.image_ref(STAGER_DIGEST),
                WEIGHTS.outputs.ring_plan_json,
                WEIGHTS.outputs.member_roots,
                WEIGHTS.outputs.model_folder,
                after=(
                    *WEIGHTS.outputs.source_tasks,
                    *(() if STAGER_DIGEST else ("stager_image",)),
                ),
            )
            if STAGER
            else None,
        )
        if RENDER.step
        else None
    )
    # The fabric check, for rings with a data plane to check (after deploy, before the bench).
    FABRIC = (
        Fabric(
            PROFILE,
            ENGINE,
            RENDER.step,
            FabricSettings(
                SITE,
                who_ran(os.environ),
                git_revision,
                KubeAccess(SETTINGS.kubeconfig, SETTINGS.kube_context),
                expect=FABRIC_EXPECT,
            ),
        )
        if RENDER.step and PROFILE.fabric
        else None
    )
    # The bench: what deploy says is live, refused while a ring's fabric check has not passed.
    BENCH = (
        Bench(
            PROFILE,
            ENGINE,
            BenchSettings(
                DEPLOY.live,
                (lambda: fabric_refusal(ENGINE.store, PROFILE.name)) if FABRIC else None,
                git_revision,
                SETTINGS.bench_url,
            ),
        )
        if DEPLOY
        else None
    )
except PipelineError as err:
    # Before any task: one line and the error's code (2 for a bad profile or setting, README's
    # "Exit codes"); SystemExit passes through doit's loader untouched.
    exit_with(err)

# The table of contents: each stage yields its doit tasks, in the order a build runs them.
STAGES = (
    (PROFILE_CHECK, WEIGHTS, IMAGES)
    + ((STAGER,) if STAGER else ())
    + ((RENDER, DEPLOY) if RENDER.step else ())
)
STAGES += (FABRIC,) if FABRIC else ()
STAGES += (BENCH,) if BENCH else ()

DOIT_CONFIG = {"default_tasks": ["build"], "dep_file": str(ENGINE.store.root / "doit.sqlite3")}


# doit finds tasks as task_* names: one per stage, each yielding that stage's tasks.
for _stage in STAGES:
    globals()[f"task_{_stage.name}"] = _stage.tasks


def task_build():
    """build everything the chosen profile deploys (profile=NAME, default local)"""
    deps = ["profile", "image", "stage_weights"] + (["render"] if RENDER.step else [])
    deps += ["stager_image"] if STAGER and not STAGER_DIGEST else []
    return {"actions": None, "task_dep": deps}
