"""Ring staging on Docker hosts: a weights-stager container per member host, all at once.

Each container runs one member of the ring plan (`python -m pipelines.stages.weights.ring`) on the
host's network, with the host's weights folder mounted at its own path: it serves its verified
blobs to its peers, fetches its share from S3 and the rest from them, then links the model
folder the runtime mounts and records the lock it holds. The plan goes into each container
before it starts; the S3 credentials go in its environment, never into a file or a line here.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import tarfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipelines.core.errors import DeployError
from pipelines.core.progress import say
from pipelines.targets.dockerengines import MemberHost

if TYPE_CHECKING:
    from pipelines.core.profiles import Profile
    from pipelines.stages.deploy.backends import Backend
    from pipelines.stages.deploy.docker import DockerHosts

PLAN_PARENT, PLAN_DIR = "/etc", "sparkforge"  # the plan is /etc/sparkforge/ring-plan.json
PLAN_FILE = "ring-plan.json"
# The S3 settings a member needs, passed from this process's environment when set.
S3_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
)
LOG_TAIL = 5


@dataclass(frozen=True)
class RingStaging:
    """What staging needs from other stages: the stager image, the plan, where members keep
    their weights (published by the weights and images stages, asked for when it runs)."""

    image: Callable[[], str]  # the weights-stager image, pinned by digest
    plan: Callable[[], str]  # the ring plan, as `doit plan_weights` writes it
    roots: Callable[[], list[str]]  # each member's weights folder, by rank
    model_folder: Callable[[], str]  # the staged model's folder under a root: models/<key>
    after: tuple[str, ...] = ()  # the tasks that build the image


def stager_name(profile: str, rank: int) -> str:
    """The member's staging container: one per profile and rank on its host."""
    return f"sparkforge-{profile}-stage-{rank}"


def stager_command(rank: int, root: str, model_folder: str, interval: float) -> list[str]:
    """The member's arguments to the image's entrypoint (stages/weights/ring.py)."""
    return [
        "--plan",
        f"{PLAN_PARENT}/{PLAN_DIR}/{PLAN_FILE}",
        "--rank",
        str(rank),
        "--root",
        root,
        "--stage-into",
        f"{root}/{model_folder}",
        "--interval",
        str(interval),
    ]


def s3_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The S3 settings to hand a member; refused without keys (a profile is not a credential)."""
    env = {name: environ[name] for name in S3_ENV if environ.get(name)}
    if "AWS_ACCESS_KEY_ID" not in env or "AWS_SECRET_ACCESS_KEY" not in env:
        raise DeployError(
            "stage_ring: no S3 credentials in the environment: set AWS_ACCESS_KEY_ID and"
            " AWS_SECRET_ACCESS_KEY (the members get them in their environment)"
        )
    return env


def plan_archive(plan_json: str) -> bytes:
    """A tar holding the plan file, as `put_archive` takes it."""
    data = plan_json.encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(f"{PLAN_DIR}/{PLAN_FILE}")
        info.size, info.mode = len(data), 0o644
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class Stagers:
    """The staging containers of one ring: created, started, followed, then removed."""

    def __init__(self, hosts: DockerHosts, profile: str, say: Callable[[str], None] = print):
        self.hosts = hosts  # a client per member engine, pulls
        self.profile = profile
        self.say = say
        self.started: list[tuple[MemberHost, Any]] = []

    def run(
        self,
        members: list[MemberHost],
        image: str,
        plan_json: str,
        roots: list[str],
        model_folder: str,
        env: dict[str, str],
        interval: float = 10.0,
    ) -> None:
        """Stage every member at once; one line per member that failed, with its log's tail."""
        import docker.errors

        try:
            for member in members:
                client = self.hosts.client(member)
                self.hosts.pull(client, member, image)
                name = stager_name(self.profile, member.rank)
                root = roots[member.rank]
                try:
                    old = self.hosts.find(client, name)
                    if old is not None:
                        old.remove(force=True)
                    # A bind as `docker run -v` makes it: a fresh node's weights folder is made.
                    container = client.containers.create(
                        image,
                        stager_command(member.rank, root, model_folder, interval),
                        name=name,
                        network_mode="host",
                        environment=env,
                        volumes={root: {"bind": root, "mode": "rw"}},
                        labels={"dev.sparkforge.profile": self.profile},
                    )
                    self.started.append((member, container))
                    container.put_archive(PLAN_PARENT, plan_archive(plan_json))
                except docker.errors.DockerException as err:
                    raise DeployError(f"member {member.node}: {member.docker}: {err}") from None
            for _, container in self.started:
                container.start()
            self.say(f"stage_ring: {len(self.started)} members staging ({image})")
            failed = self.follow()
            if failed:
                raise DeployError("\n".join(failed))
        finally:
            self.remove()

    def follow(self) -> list[str]:
        """Print every member's lines as they come and wait for all; the failures, one line
        each. Once one member fails the others are stopped: the ring cannot finish as planned,
        and a run again resumes every member from what it verified."""
        import docker.errors

        tails: dict[int, list[str]] = {}
        exits: queue.Queue[tuple[MemberHost, Any, int]] = queue.Queue()
        printers: dict[int, threading.Thread] = {}
        for member, container in self.started:
            tail = tails.setdefault(member.rank, [])
            printer = threading.Thread(
                target=self._print_logs, args=(member, container, tail), daemon=True
            )
            printer.start()
            printers[member.rank] = printer
            threading.Thread(
                target=lambda m=member, c=container: exits.put((m, c, c.wait()["StatusCode"])),
                daemon=True,
            ).start()
        failed, stopped = [], set()
        for _ in self.started:
            member, container, code = exits.get()
            if code == 0 or member.rank in stopped:
                continue
            printers[member.rank].join(timeout=5)  # its last lines, before the line about it
            last = " | ".join(tails[member.rank][-LOG_TAIL:])
            failed.append(f"member {member.node}: staging exited {code}: {last}")
            for other, running in self.started:
                if other.rank not in stopped and other.rank != member.rank:
                    stopped.add(other.rank)
                    with contextlib.suppress(docker.errors.DockerException):
                        running.stop(timeout=5)
        if failed and stopped:
            nodes = ", ".join(m.node for m, _ in self.started if m.rank in stopped)
            self.say(f"stage_ring: stopped {nodes}; a run again resumes from what is verified")
        return failed

    def _print_logs(self, member: MemberHost, container: Any, tail: list[str]) -> None:
        """Copy one member's output here, line by line, each naming the member."""
        pending = b""
        for chunk in container.logs(stream=True, follow=True):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                self._say_line(member, line, tail)
        if pending.strip():
            self._say_line(member, pending, tail)

    def _say_line(self, member: MemberHost, line: bytes, tail: list[str]) -> None:
        """One line of a member: as it is when it names the member, else behind its node."""
        text = line.decode(errors="replace").rstrip()
        tail.append(text)
        self.say(
            text if text.startswith(f"stage_ring {member.node}:") else f"{member.node}: {text}"
        )

    def remove(self) -> None:
        """Remove the containers (their output is already printed); a killed run too."""
        import docker.errors

        for member, container in self.started:
            try:
                container.remove(force=True)
            except docker.errors.DockerException as err:
                self.say(
                    f"stage_ring: member {member.node}: could not remove {container.name}: {err}"
                )
        self.started = []


def stage_ring(profile: Profile, staging: RingStaging, hosts: Backend) -> None:
    """Stage the weights on every member of a Docker-host ring: one container per host,
    each member's share from S3, the rest from its peers, every file verified."""
    from pipelines.stages.deploy.docker import DockerHosts

    # The task exists only where the target stages by containers on Docker hosts.
    assert isinstance(hosts, DockerHosts)
    env = s3_environment(os.environ)
    image, plan = staging.image(), staging.plan()
    members = [
        MemberHost(rank, m.node, url)
        for rank, (m, url) in enumerate(zip(profile.members, hosts.engines(), strict=True))
    ]
    started = time.monotonic()
    Stagers(hosts, profile.name).run(
        members, image, plan, staging.roots(), staging.model_folder(), env
    )
    took = time.monotonic() - started
    say("stage_ring", f"{len(members)} members staged and verified in {took:.1f} s")
