"""The Kubernetes backend through the Deploy stage, against the API double (tests/kube_api.py):
a real HTTP server the official client talks to, not a cluster."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from kube_api import KubeDouble, KubeServer, b64, job_status, service_status
from staged_tp3 import staged_tp3_render
from support import stages

from pipelines.core.errors import DeployError, PipelineError
from pipelines.core.profiles import load_profile
from pipelines.core.settings import read_settings
from pipelines.core.site import Site
from pipelines.engine.steps import Engine
from pipelines.engine.store import Store
from pipelines.stages.deploy import Deploy, DeploySettings
from pipelines.stages.deploy.kubeobjects import LAST_APPLIED, compact, owned
from pipelines.stages.deploy.plan import Deployment
from pipelines.stages.deploy.records import Records
from pipelines.stages.weights import Weights
from pipelines.targets.kubeapi import KubeAccess
from pipelines.targets.pruning import OWNER_LABEL

REPO = Path(__file__).resolve().parent.parent
IMAGE_A = "ghcr.io/lab/sparkforge/vllm-gb10-dsv41-exl3@sha256:" + "a" * 64
IMAGE_B = "ghcr.io/lab/sparkforge/vllm-gb10-dsv41-exl3@sha256:" + "b" * 64
SECRET = "s3cr3t-Value-9d1e"  # what the model's source Secret would hold
NODES = ("spark-1", "spark-2", "spark-3")
# The domain's order: caches, the Model, the TP3 patch Jobs, node prep, the group.
ORDER = [
    "ConfigMap/sparkforge-tp3-patch",
    *(
        f"{kind}/dsv41-cache-{n}"
        for n in NODES
        for kind in ("PersistentVolume", "PersistentVolumeClaim")
    ),
    "Model/dsv41-flash-exl3",
    *(f"Job/dsv41-flash-tp3-patch-{r}" for r in range(3)),
    *(f"Job/dsv41-flash-node-prep-{r}" for r in range(3)),
    "InferenceService/dsv41-flash",
]


@dataclass
class Tags:
    """The images stage as deploy sees it: where `:stable` points."""

    stable: str | None = None
    moves: list[str] = field(default_factory=list)

    def promote(self, digest: str) -> str:
        self.moves.append(digest)
        self.stable = digest
        return f":stable -> {digest[:19]}"

    def restore_stable(self, digest: str) -> str:
        self.moves.append(digest)
        self.stable = digest
        return f":stable -> {digest[:19]}, the restored deployment's image"

    def stable_digest(self) -> str | None:
        return self.stable


@dataclass
class World:
    """The double, its server, a kubeconfig naming it, a store, and `:stable`."""

    double: KubeDouble
    server: KubeServer
    kubeconfig: Path
    store: Path  # the render steps' (shared by the module's tests)
    records: Path  # this test's deployment records
    tags: Tags


def seed(double: KubeDouble) -> None:
    """What the lab's cluster has before any deploy: the namespace, the model source's Secret
    (made by the lab, never by a deploy) and three Ready nodes."""
    double.add({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "dsv41"}})
    meta = {"name": "dsv41-model-source", "namespace": "dsv41"}
    data = {"AWS_ACCESS_KEY_ID": b64("lab-key-id"), "AWS_SECRET_ACCESS_KEY": b64(SECRET)}
    double.add({"apiVersion": "v1", "kind": "Secret", "metadata": meta, "data": data})
    for node in NODES:
        ready = {"conditions": [{"type": "Ready", "status": "True"}], "nodeInfo": {}}
        double.add(
            {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}, "status": ready}
        )


@pytest.fixture(scope="module")
def renders(tmp_path_factory) -> Path:
    """One store for the module's render steps: each image is rendered once."""
    return tmp_path_factory.mktemp("renders")


@pytest.fixture
def world(tmp_path, renders):
    double = KubeDouble(secret_values=[SECRET])
    seed(double)
    server = KubeServer(double)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(server.kubeconfig()))
    yield World(double, server, kubeconfig, renders, tmp_path / "records", Tags())
    server.close()


def deploy_stage(world: World, image: str, timeout_s: float = 5.0, **kube) -> Deploy:
    """The Deploy stage of tp3-ring as dodo wires it, its render step run for image."""
    profile = load_profile("tp3-ring")
    engine = Engine(Store(world.store), root=REPO)
    render = stages.render_stage(profile, engine, image, [SECRET])
    engine.run(render.step)
    run = stages.context(profile, engine, Site.named("ghcr.io/lab"), [SECRET])
    model = Weights(run).outputs
    # Provenance is not what this test is about: its own tests are tests/test_provenance.py.
    stage = Deploy(
        run,
        render=render.step,
        tags=world.tags,
        model=model,
        stager=stages.NO_STAGER,
        provenance=lambda ref: [],
    )
    # Nor the model's signature (tp3-ring's lock is not signed here): tests/test_model_signature.py.
    stage.model_signature = lambda: []
    access = KubeAccess(str(world.kubeconfig), **{"poll_s": 0.001, **kube})
    site = stage.settings.site
    stage.settings = DeploySettings(site, timeout_s, "test", lambda: "0" * 40, access)
    # The store is shared, the history is the test's (the stage writes it, its view reads it).
    stage.records = stage.deployed.records = Records(world.records)
    return stage


def deploy(world: World, image: str, **options) -> Deploy:
    """One deploy of image (closing its API connections as the doit task does)."""
    stage = deploy_stage(world, image, **options)
    try:
        stage.deploy()
    finally:
        stage.backend.close()
    return stage


def outcomes(stage: Deploy) -> list[str]:
    return [r["outcome"] for r in stage.records.history()]


def stored_configs(double: KubeDouble) -> dict[str, str]:
    """kind/name -> the configuration sparkforge last applied, for every object it applied."""
    return {
        f"{kind}/{name}": body["metadata"]["annotations"][LAST_APPLIED]
        for (_, kind, _, name), body in double.objects.items()
        if LAST_APPLIED in body["metadata"].get("annotations", {})
    }


def configs_of(deployment: Deployment) -> dict[str, str]:
    """kind/name -> the configuration a deploy applies (the render's, with the ownership label)."""
    return {
        f"{d['kind']}/{d['metadata']['name']}": compact(owned(d, OWNER_LABEL, deployment.profile))
        for d in deployment.documents
    }


def test_deploy_applies_in_the_domains_order_waiting_for_each_phase(world):
    stage = deploy(world, IMAGE_A)
    d = world.double
    assert [e.split()[1] for e in d.applied()] == ORDER
    events = d.events
    # Each phase starts only once the one before finished: Model Ready before any patch Job,
    # every patch Job Complete before node prep, every node-prep Job Complete before the group.
    first = {e.split()[1]: i for i, e in reversed(list(enumerate(events))) if e.startswith("apply")}
    last_done = {}
    for i, e in enumerate(events):
        if e.startswith("status") and e.split()[2] in ("Ready", "Complete"):
            last_done[e.split()[1]] = i
    assert last_done["Model/dsv41-flash-exl3"] < first["Job/dsv41-flash-tp3-patch-0"]
    patch_done = max(last_done[f"Job/dsv41-flash-tp3-patch-{r}"] for r in range(3))
    assert patch_done < first["Job/dsv41-flash-node-prep-0"]
    prep_done = max(last_done[f"Job/dsv41-flash-node-prep-{r}"] for r in range(3))
    assert prep_done < first["InferenceService/dsv41-flash"]
    assert events[-1] == "status InferenceService/dsv41-flash Ready 3"
    # Server-side apply as sparkforge, taking over conflicts, strict field validation.
    patches = [r for r in d.requests if r.method == "PATCH"]
    assert patches and all(r.content_type == "application/apply-patch+yaml" for r in patches)
    assert all(
        r.query["fieldManager"] == "sparkforge" and r.query["force"] == "true" for r in patches
    )
    assert all(r.query["fieldValidation"] == "Strict" for r in patches)
    assert world.tags.moves == ["sha256:" + "a" * 64]
    assert outcomes(stage) == ["deployed"]


def test_a_second_deploy_of_the_same_render_changes_nothing(world, capsys):
    deploy(world, IMAGE_A)
    versions = {k: b["metadata"]["resourceVersion"] for k, b in world.double.objects.items()}
    applied = len(world.double.applied())
    stage = deploy(world, IMAGE_A)
    assert len(world.double.applied()) == applied  # nothing stored anew, nothing deleted
    assert versions == {
        k: b["metadata"]["resourceVersion"] for k, b in world.double.objects.items()
    }
    out = capsys.readouterr().out
    assert out.count(" unchanged") == len(ORDER)
    assert "nothing restarted" in out
    assert outcomes(stage) == ["deployed", "unchanged"]


def test_a_new_image_replaces_the_jobs_and_reconfigures_the_group(world):
    deploy(world, IMAGE_A)
    d = world.double
    applied = len(d.applied())
    stage = deploy(world, IMAGE_B)
    new = d.applied()[applied:]
    # A Job's template cannot change: each is deleted and created anew (the double refuses a
    # changed template with 422, as an API server does).
    for r in range(3):
        assert new.index(f"delete Job/dsv41-flash-tp3-patch-{r}") < new.index(
            f"apply Job/dsv41-flash-tp3-patch-{r}"
        )
    service = d.find("InferenceService", "dsv41-flash")
    assert service["spec"]["image"] == IMAGE_B and service["metadata"]["generation"] == 2
    assert stored_configs(d) == configs_of(stage.deployed.candidate())
    assert world.tags.moves[-1] == "sha256:" + "b" * 64


def test_a_failed_patch_job_names_its_member_and_log_and_the_earlier_state_is_restored(world):
    before = configs_of(deploy(world, IMAGE_A).deployed.candidate())
    d = world.double
    d.script(
        "Job",
        "dsv41-flash-tp3-patch-1",
        [job_status("Running"), job_status("Failed", "BackoffLimitExceeded")],
    )
    d.logs["dsv41-flash-tp3-patch-1"] = (
        "reading config.json\nrefusing: heads 72, o_groups 9 is not (64, 8)\n"
    )
    stage = deploy_stage(world, IMAGE_B)
    with pytest.raises(DeployError) as err:
        stage.deploy()
    [line] = str(err.value).splitlines()
    assert "member spark-2: Job dsv41-flash-tp3-patch-1 failed: BackoffLimitExceeded" in line
    assert "log: reading config.json | refusing: heads 72, o_groups 9 is not (64, 8)" in line
    assert "the previous deployment was restored" in line
    assert "apply InferenceService/dsv41-flash" not in d.applied()[len(ORDER) :]
    assert stored_configs(d) == before
    assert d.find("InferenceService", "dsv41-flash")["spec"]["image"] == IMAGE_A
    assert world.tags.moves == ["sha256:" + "a" * 64]
    assert outcomes(stage) == ["deployed", "rolled back"]


def test_a_group_that_is_not_ready_in_time_is_rolled_back(world):
    before = configs_of(deploy(world, IMAGE_A).deployed.candidate())
    d = world.double
    d.script("InferenceService", "dsv41-flash", [service_status("Progressing", 2)])
    stage = deploy_stage(world, IMAGE_B, timeout_s=0.2)
    with pytest.raises(DeployError) as err:
        stage.deploy()
    [line] = str(err.value).splitlines()
    assert (
        "InferenceService/dsv41-flash: not done after 0.2 s (phase Progressing, 2/3 members ready)"
        in line
    )
    assert stored_configs(d) == before
    assert d.find("InferenceService", "dsv41-flash")["spec"]["image"] == IMAGE_A
    assert world.tags.moves == ["sha256:" + "a" * 64]
    assert outcomes(stage) == ["deployed", "rolled back"]


def test_a_restore_the_api_server_refuses_is_recorded_with_what_failed_first(world):
    deploy(world, IMAGE_A)
    d = world.double
    d.script("InferenceService", "dsv41-flash", [service_status("Progressing", 2)])
    applied = d.events.count("apply InferenceService/dsv41-flash")

    def refuse_once_the_new_group_is_applied() -> None:
        # From then on, every write to the group is refused: restore cannot put it back.
        while d.events.count("apply InferenceService/dsv41-flash") == applied:
            time.sleep(0.001)
        d.refuse[("PATCH", "inferenceservices")] = 403

    watcher = threading.Thread(target=refuse_once_the_new_group_is_applied, daemon=True)
    watcher.start()
    stage = deploy_stage(world, IMAGE_B, timeout_s=0.5)
    try:
        with pytest.raises(DeployError) as err:
            stage.deploy()
    finally:
        stage.backend.close()
        d.refuse.clear()
    [line] = str(err.value).splitlines()
    assert line.startswith("deploy tp3-ring: InferenceService/dsv41-flash: not done after 0.5 s")
    assert "; putting the previous deployment back failed: restore incomplete: " in line
    last = stage.records.history()[-1]
    assert last["outcome"] == "rolled back" and last["reason"].startswith("InferenceService/")
    assert last["restore"].startswith("restore incomplete: ")


def test_a_stable_tag_that_cannot_move_is_recorded_on_a_deployment_that_serves(world):
    def refuse(digest: str) -> str:
        raise PipelineError("registry ghcr.io: 503 Service Unavailable: nothing promoted")

    world.tags.promote = refuse  # the registry's answer, as the images stage says it
    stage = deploy_stage(world, IMAGE_A)
    try:
        with pytest.raises(DeployError) as err:
            stage.deploy()
    finally:
        stage.backend.close()
    assert "serves, but :stable was not moved: registry ghcr.io: 503" in str(err.value)
    [last] = stage.records.history()
    assert last["outcome"] == "deployed"
    assert (
        last["stable"] == "not moved: registry ghcr.io: 503 Service Unavailable: nothing promoted"
    )


def test_a_status_written_for_the_previous_spec_is_not_taken_for_ready(world):
    deploy(world, IMAGE_A)
    stale = service_status("Ready", 3, generation=1)  # the operator has not seen generation 2
    world.double.script("InferenceService", "dsv41-flash", [stale])
    stage = deploy_stage(world, IMAGE_B, timeout_s=0.2)
    with pytest.raises(DeployError, match="status of generation 1 < 2"):
        stage.deploy()
    assert world.tags.moves == ["sha256:" + "a" * 64]


def test_ctrl_c_during_a_wait_deletes_what_the_deploy_created(world, monkeypatch):
    import pipelines.stages.deploy.kubewaits as backend

    def interrupt(_seconds):
        raise KeyboardInterrupt

    stage = deploy_stage(world, IMAGE_A)
    monkeypatch.setattr(backend.time, "sleep", interrupt)  # the first wait is the Model's
    with pytest.raises(KeyboardInterrupt):
        stage.deploy()
    d = world.double
    made = ORDER[: ORDER.index("Model/dsv41-flash-exl3") + 1]
    assert d.applied() == [f"apply {o}" for o in made] + [f"delete {o}" for o in reversed(made)]
    assert stored_configs(d) == {}
    assert outcomes(stage) == ["rolled back"]
    assert world.tags.moves == []


def test_strict_field_validation_refuses_an_unknown_field_before_anything_is_touched(world):
    stage = deploy_stage(world, IMAGE_A)
    good = stage.deployed.candidate()
    docs = [json.loads(json.dumps(doc)) for doc in good.documents]
    service = next(doc for doc in docs if doc["kind"] == "InferenceService")
    service["spec"]["multiNode"]["members"][1]["fabric"]["ibHca"] = "rocep1s0f0"  # a typo
    bad = Deployment(good.profile, good.key, tuple(docs), good.image)
    problems = stage.backend.preflight(bad, swap_off=True, min_free=0)
    stage.backend.close()
    assert problems == [
        f"kubernetes API {world.server.url}: HTTP 400 Bad Request on PATCH"
        " /apis/inference.llmkube.dev/v1alpha1/namespaces/dsv41/inferenceservices/dsv41-flash:"
        " .spec.multiNode.members.1.fabric.ibHca: field not declared in schema"
    ]
    assert world.double.applied() == []


def test_a_server_dry_run_touches_nothing(world, capsys):
    stage = deploy(world, IMAGE_A, dry_run=True)
    d = world.double
    assert d.applied() == []
    assert {k[1] for k in d.objects} == {"Namespace", "Node", "Secret"}
    writes = d.writes()
    assert writes and all(r.query.get("dryRun") == "All" for r in writes)
    assert world.tags.moves == [] and outcomes(stage) == []
    out = capsys.readouterr().out
    assert "InferenceService/dsv41-flash in dsv41 created (server dry run)" in out


@pytest.mark.parametrize(
    ("refuse", "expected"),
    [
        (None, "HTTP 401 Unauthorized on GET /api/v1; expected credentials it accepts"),
        (
            ("PATCH", "/inferenceservices/"),
            "HTTP 403 Forbidden on PATCH /apis/inference.llmkube.dev/v1alpha1/namespaces/dsv41/"
            'inferenceservices/dsv41-flash: User "ci" cannot patch',
        ),
        (("PATCH", "/models/"), "HTTP 409 Conflict on PATCH /apis/inference.llmkube.dev/v1alpha1"),
    ],
    ids=["401", "403", "409"],
)
def test_a_refusing_api_server_gives_one_line_and_nothing_is_touched(world, refuse, expected):
    if refuse is None:
        world.double.token = "another-token"
    else:
        world.double.refuse[refuse] = int(expected.split()[1])
    stage = deploy_stage(world, IMAGE_A)
    with pytest.raises(DeployError) as err:
        deploy(world, IMAGE_A)
    header, *lines = str(err.value).splitlines()
    assert header == "preflight failed, nothing touched:"
    assert len(lines) == 1 and lines[0].startswith(f"kubernetes API {world.server.url}: ")
    assert expected in lines[0]
    if refuse is None:
        assert f"kubeconfig {world.kubeconfig}" in lines[0]
    assert world.double.applied() == []
    assert outcomes(stage) == ["refused"]


def test_preflight_names_a_missing_namespace_and_a_swapping_node(world):
    d = world.double
    d.find("Node", "spark-2")["status"]["nodeInfo"]["swap"] = {"capacity": 8 << 30}
    stage = deploy_stage(world, IMAGE_A)
    with pytest.raises(DeployError) as err:
        stage.deploy()
    assert str(err.value).splitlines()[1:] == [
        f"member spark-2: swap on ({8 << 30} bytes), expected off"
    ]
    del d.objects[("v1", "Namespace", None, "dsv41")]
    with pytest.raises(DeployError, match="namespace dsv41: not found on"):
        stage.deploy()
    assert d.applied() == []


def test_no_secret_value_is_ever_sent_or_printed(world, capsys, monkeypatch):
    # The runner holds the model source's credentials too (the weights stage fetches with them).
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "lab-key-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    stage = deploy(world, IMAGE_A)
    d = world.double
    assert d.leaks == []  # the double refuses any body holding a secret value; none came
    assert not [r for r in d.requests if "/secrets" in r.path]
    for r in d.requests:
        assert SECRET not in r.body and SECRET not in json.dumps(r.query)
    model = d.find("Model", "dsv41-flash-exl3")
    assert model["spec"]["sourceSecretRef"] == {"name": "dsv41-model-source"}
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err and world.double.token not in out.out + out.err
    assert SECRET not in json.dumps(stage.records.history())


def test_rollback_applies_the_earlier_deployment_again_and_status_says_what_runs(world, capsys):
    first = configs_of(deploy(world, IMAGE_A).deployed.candidate())
    deploy(world, IMAGE_B)
    stage = deploy_stage(world, IMAGE_B)
    stage.rollback()
    d = world.double
    assert world.tags.stable == IMAGE_A.rsplit("@", 1)[1]
    assert stored_configs(d) == first
    assert d.find("InferenceService", "dsv41-flash")["spec"]["image"] == IMAGE_A
    assert outcomes(stage) == ["deployed", "deployed", "restored"]
    capsys.readouterr()
    stage.deployed.status()
    stage.backend.close()
    out = capsys.readouterr().out
    assert "InferenceService/dsv41-flash: this deployment, phase Ready, 3/3 members ready" in out
    assert "Job/dsv41-flash-tp3-patch-0: this deployment" in out


def test_the_dry_run_setting_takes_server_or_nothing():
    settings = read_settings({"SPARKFORGE_KUBE_DRY_RUN": "server", "KUBECONFIG": "/k/a:/k/b"})
    assert settings.kube_dry_run and settings.kubeconfig == "/k/a:/k/b"
    assert not read_settings({}).kube_dry_run
    with pytest.raises(PipelineError, match="SPARKFORGE_KUBE_DRY_RUN='client': expected 'server'"):
        read_settings({"SPARKFORGE_KUBE_DRY_RUN": "client"})


def test_an_unreachable_api_server_is_one_line_naming_its_url(world):
    world.server.close()
    stage = deploy_stage(world, IMAGE_A)
    with pytest.raises(DeployError) as err:
        stage.deploy()
    assert str(err.value).splitlines()[1:] == [
        f"kubernetes API {world.server.url} unreachable (MaxRetryError) on GET /api/v1;"
        f" expected an API server there (kubeconfig {world.kubeconfig})"
    ]


# --- ring staging Jobs ------------------------------------------------------------------------

STAGER = "ghcr.io/lab/sparkforge/weights-stager@sha256:" + "e" * 64


def staged_tp3_documents(folder: Path, version: str = "") -> Path:
    """tp3-ring rendered with a complete lock (its bytes named by version) and the stager image,
    written as render writes."""
    from pipelines.stages.render.documents import write_documents

    folder.mkdir(parents=True)
    write_documents(staged_tp3_render(version, IMAGE_A, STAGER, [SECRET]), folder)
    return folder


def test_ring_staging_jobs_run_on_every_member_before_the_model(world, tmp_path):
    from pipelines.stages.deploy.kubernetes import Kubernetes

    folder = staged_tp3_documents(tmp_path / "render")
    profile = load_profile("tp3-ring")
    access = KubeAccess(str(world.kubeconfig), poll_s=0.001)
    backend = Kubernetes(profile, (), 5.0, access)
    try:
        deployment = backend.load("k" * 64, folder)
        assert deployment.image == IMAGE_A  # the runtime's: the stager is not promoted
        backend.apply(deployment)
    finally:
        backend.close()
    applied = [e.split()[1] for e in world.double.applied()]
    stage_jobs = [f"Job/dsv41-flash-stage-weights-{r}" for r in range(3)]
    assert applied[: len(ORDER) + 4] == [
        "ConfigMap/sparkforge-tp3-patch",
        "ConfigMap/dsv41-flash-ring-plan",
        *ORDER[1:7],
        *stage_jobs,
        *ORDER[7:],
    ]
    # Every staging Job Complete before the Model is applied.
    events = world.double.events
    model_applied = next(i for i, e in enumerate(events) if e == "apply Model/dsv41-flash-exl3")
    staged = [
        i
        for i, e in enumerate(events)
        if e.startswith("status Job/dsv41-flash-stage-weights-") and " Complete" in e
    ]
    assert len({events[i].split()[1] for i in staged}) == 3
    assert max(staged) < model_applied

    jobs = {
        body["metadata"]["name"]: body
        for (_, kind, _, _), body in world.double.objects.items()
        if kind == "Job" and "stage-weights" in body["metadata"]["name"]
    }
    for rank, node in enumerate(NODES):
        spec = jobs[f"dsv41-flash-stage-weights-{rank}"]["spec"]["template"]["spec"]
        assert spec["nodeName"] == node and spec["hostNetwork"] is True
        [container] = spec["containers"]
        assert container["image"] == STAGER
        args = container["args"]
        assert args[args.index("--rank") + 1] == str(rank)
        assert args[args.index("--stage-into") + 1] == "/models/22fa141368a3262a"
        assert container["envFrom"] == [{"secretRef": {"name": "dsv41-model-source"}}]
        claims = [
            v["persistentVolumeClaim"]["claimName"]
            for v in spec["volumes"]
            if "persistentVolumeClaim" in v
        ]
        assert claims == [f"dsv41-cache-{node}"]
    rendered = "".join(p.read_text() for p in folder.glob("*.yaml"))
    assert SECRET not in rendered and "lab-key-id" not in rendered


def test_a_new_lock_restages_patches_preps_every_member_and_recreates_the_group(world, tmp_path):
    from pipelines.stages.deploy.kubernetes import Kubernetes

    def deploy(folder: Path) -> dict[str, str]:
        backend = Kubernetes(load_profile("tp3-ring"), (), 5.0, access)
        try:
            changes = backend.apply(backend.load("k" * 64, folder))
        finally:
            backend.close()
        return {c.name: c.line(False) for c in changes if c.kind in ("Job", "InferenceService")}

    access = KubeAccess(str(world.kubeconfig), poll_s=0.001)
    deploy(staged_tp3_documents(tmp_path / "v1", "v1"))
    again = deploy(staged_tp3_documents(tmp_path / "v1-again", "v1"))
    new = deploy(staged_tp3_documents(tmp_path / "v2", "v2"))
    for r in range(3):
        # The new bytes' page cache dropped again before the group starts (node prep).
        for job in ("stage-weights", "tp3-patch", "node-prep"):
            assert "replaced" not in again[f"dsv41-flash-{job}-{r}"], again
            assert "replaced" in new[f"dsv41-flash-{job}-{r}"], new
    # The same file names with other bytes: the group is recreated, not left serving the old.
    assert again["dsv41-flash"].endswith(" unchanged"), again["dsv41-flash"]
    assert new["dsv41-flash"].endswith(" configured"), new["dsv41-flash"]


def test_the_ring_staging_jobs_wait_on_their_own_timeout_not_the_deploys(world, tmp_path):
    from pipelines.stages.deploy.kubernetes import Kubernetes

    folder = staged_tp3_documents(tmp_path / "render")
    # Member 0 stages for 80 reads, each after a 5 ms poll: over twice the deploy's 0.2 s (a
    # fifth of the requests 1 ms polls took for the same wait).
    slow = [job_status("Running")] * 80 + [job_status("Complete")]
    world.double.script("Job", "dsv41-flash-stage-weights-0", slow)

    def apply(stage_timeout_s: float) -> None:
        access = KubeAccess(str(world.kubeconfig), poll_s=0.005, stage_timeout_s=stage_timeout_s)
        backend = Kubernetes(load_profile("tp3-ring"), (), 0.2, access)
        try:
            backend.apply(backend.load("k" * 64, folder))
        finally:
            backend.close()

    with pytest.raises(DeployError) as short:
        apply(0.2)
    assert str(short.value).startswith("jobs stage-weights: not done after 0.2 s (1 of 3 Jobs")
    world.double.script("Job", "dsv41-flash-stage-weights-0", slow)
    apply(60.0)
    events = world.double.events
    assert "status Job/dsv41-flash-stage-weights-0 Complete" in " | ".join(events)


def test_the_models_download_waits_on_the_staging_timeout_not_the_deploys(world):
    # The shipped tp3 lock is not complete: the operator downloads the model (460 GB) itself,
    # here for 80 reads, each after a 5 ms poll: over twice the deploy's 0.2 s.
    slow = [{"phase": "Downloading"}] * 80 + [{"phase": "Ready"}]
    world.double.script("Model", "dsv41-flash-exl3", slow)
    with pytest.raises(DeployError) as short:
        deploy(world, IMAGE_A, timeout_s=60.0, stage_timeout_s=0.2, poll_s=0.005)
    assert "Model/dsv41-flash-exl3: not done after 0.2 s (phase Downloading)" in str(short.value)

    world.double.script("Model", "dsv41-flash-exl3", slow)
    stage = deploy(world, IMAGE_A, timeout_s=0.2, stage_timeout_s=60.0, poll_s=0.005)
    assert outcomes(stage)[-1] == "deployed"


def test_a_deploy_waits_by_default_longer_than_a_ring_group_takes_to_come_back():
    # pipelines/profiles/FACTS.md: any change to the group recreates all members, 2 to 8
    # minutes on a Spark ring.
    settings = read_settings({})
    assert settings.deploy_timeout_s >= 2 * 8 * 60
    assert settings.stage_timeout_s >= 6 * 3600  # 460 GB through one storage uplink
