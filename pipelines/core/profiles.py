"""Profiles: what is deployed where, parsed once from YAML and validated at the edge."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal, TypeVar

from msgspec import Meta, field

from pipelines.core.errors import BadInput
from pipelines.core.paths import PROFILES_DIR
from pipelines.core.schema import Strict, load_yaml_model

Name = Annotated[str, Meta(pattern=r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$", max_length=63)]
Sha256 = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")]
Count = Annotated[int, Meta(ge=1)]  # sizes and counts: at least one
Octet = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
S = TypeVar("S")  # a profile section
IPv4 = Annotated[str, Meta(pattern=rf"^({Octet}\.){{3}}{Octet}$")]
# Values some documents carry as they are: constrained here, when the profile loads, so that no
# value can add a line, a key or a document to what is rendered.
EnvName = Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=255)]
Word = Annotated[str, Meta(pattern=r"^[a-z0-9][a-z0-9_-]*$", max_length=63)]
ModelId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$", max_length=255)]
NetDev = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$", max_length=15)]
# An RDMA device as NCCL_IB_HCA lists it (comma-joined there): a name, optionally :port.
IbDevice = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*(:[0-9]+)?$", max_length=64)]
# A Kubernetes extended resource name: an optional DNS prefix, a slash, a name.
ResourceName = Annotated[
    str,
    Meta(
        pattern=r"^([a-z0-9]([a-z0-9.-]*[a-z0-9])?/)?[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$",
        max_length=253,
    ),
]
NodePath = Annotated[str, Meta(pattern=r"^/\S*$", max_length=4096)]  # absolute, no whitespace


class ProfileError(BadInput):
    """A profile that cannot be used, said in one line naming file and field."""


class ModelSpec(Strict, frozen=True, kw_only=True):
    """The checkpoint: where it comes from and how it is served."""

    lock: Name
    source: Annotated[str, Meta(pattern=r"^s3://[^/]+/.+")]
    served_name: ModelId
    format: Literal["safetensors"]
    quantization: Word
    config_patch: Literal["none", "tp3-heads"]
    source_secret: Name | None = None


class ParallelSpec(Strict, frozen=True):
    """How the model is split across GPUs."""

    tensor: Count
    pipeline: Count


class ResourcesSpec(Strict, frozen=True):
    """What each member asks of its node."""

    gpu: Count
    memory: Annotated[str, Meta(pattern=r"^[0-9]+(Ki|Mi|Gi|Ti)$")]
    cpu: Annotated[str, Meta(pattern=r"^[0-9]+(\.[0-9]+|m)?$")]


class MemberSpec(Strict, frozen=True, kw_only=True):
    """One ring member, in rank order: its node, management plane and model cache claim."""

    node: Name
    address: IPv4
    socket_interface: NetDev
    claim: Name | None = None
    # The Docker engine of the member's host (docker deploys): unix:///..., ssh://user@host.
    docker: Annotated[str, Meta(pattern=r"^(unix|ssh|tcp)://\S+$")] | None = None
    # Its address on the direct link to each neighbour (the ring's data plane), for staging
    # weights between peers; none: peers reach it at its management address.
    links: dict[Name, IPv4] = {}
    # This node's weights folder (blobs and staged models), where it is not the profile's
    # node_weights_root (another disk; or one host simulating several nodes).
    weights_root: Annotated[str, Meta(pattern=r"^/\S*$")] | None = None


class FabricSpec(Strict, frozen=True, kw_only=True):
    """The RoCE data plane of a switchless ring."""

    ib_hca: Annotated[list[IbDevice], Meta(min_length=1)]
    rdma_resource: ResourceName
    ib_gid_index: Annotated[int, Meta(ge=0)]
    # The operator's bound (LLMKube's MultiNodeSpec: 1024..65535): refused here, naming the field.
    rendezvous_port: Annotated[int, Meta(ge=1024, le=65535)] = 29500
    mtu: Literal[1500, 9000]
    patched_nccl: bool
    # The fabric check (`doit fabric`): the transport every NCCL channel must use, and the bus
    # bandwidth floor at the all-reduce sweep's largest size in GB/s (None: reported, not gated).
    transport: Literal["NET/IB", "NET/Socket", "P2P", "SHM"] = "NET/IB"
    min_busbw_gbs: Annotated[float, Meta(gt=0)] | None = None


class NcclOverlaySpec(Strict, frozen=True):
    """The sparkring NCCL library mounted over the image's pip NCCL on every node."""

    host_path: str
    container_path: str
    sha256: Sha256 | None = None


class KubernetesSpec(Strict, frozen=True, kw_only=True):
    """Where a Kubernetes deployment lives: namespace and each member's local model cache."""

    namespace: Name
    node_cache_path: NodePath
    cache_size: Annotated[str, Meta(pattern=r"^[0-9]+(Gi|Ti)$")]
    storage_class: Name
    service_name: Name
    # Every JIT/compile cache on one hostPath per node (mounted at /cache), so a reboot does not
    # recompile; /dev/shm as a memory emptyDir for NCCL and vLLM workers (the default is 64 MiB).
    node_jit_cache_path: NodePath = "/var/lib/sparkforge/jit-cache"
    shm_size: Annotated[str, Meta(pattern=r"^[0-9]+(Mi|Gi)$")] = "8Gi"


class SpeculativeSpec(Strict, frozen=True):
    """DSpark speculative decoding."""

    method: Literal["dspark"]
    num_speculative_tokens: Annotated[int, Meta(ge=1, le=8)]


class VllmSpec(Strict, frozen=True, kw_only=True):
    """vLLM engine settings."""

    gpu_memory_utilization: Annotated[float, Meta(ge=0.1, le=0.99)]
    max_model_len: Count
    max_num_seqs: Count
    max_num_batched_tokens: Count
    block_size: Count
    speculative: SpeculativeSpec | None = None
    extra_args: list[str] = []


class SglangSpec(Strict, frozen=True, kw_only=True):
    """SGLang engine settings."""

    context_length: Count
    max_running_requests: Count
    max_total_tokens: Count
    mem_fraction_static: Annotated[float, Meta(gt=0, lt=1)]
    chunked_prefill_size: Count
    speculative: SpeculativeSpec | None = None
    nccl_overlay: NcclOverlaySpec | None = None
    # Appended to the server command (e.g. the image's reasoning and tool-call parsers).
    extra_args: list[str] = []


class SimulatorSpec(Strict, frozen=True, kw_only=True):
    """The simulated runtime of the local profile: test equipment with configurable timing."""

    port: Annotated[int, Meta(ge=1, le=65535)]
    max_model_len: Count
    max_running_requests: Count
    ttft_s: Annotated[float, Meta(ge=0)]
    decode_tok_s: Annotated[float, Meta(gt=0)]
    # TTFT = ttft_s + prompt tokens / prefill_tok_s; one stream's decode rate with c running is
    # decode_tok_s / c ** decode_falloff; tokens_per_chunk > 1 streams as speculative decoding
    # does; empty_chunks puts a content-less chunk between token chunks; decode_jitter j gives
    # each request its own pace, a factor in [1 - j, 1 + j] on its token intervals (noise).
    prefill_tok_s: Annotated[float, Meta(gt=0)] = 20000.0
    decode_falloff: Annotated[float, Meta(ge=0)] = 0.0
    decode_jitter: Annotated[float, Meta(ge=0, le=0.9)] = 0.0
    tokens_per_chunk: Count = 1
    empty_chunks: bool = False


class BaselineSpec(Strict, frozen=True, kw_only=True):
    """One gated metric: its dotted name in the results, value, tolerance and direction."""

    metric: Annotated[str, Meta(pattern=r"^(decode\.c[0-9]+|saturation|needles)\.[a-z0-9_]+$")]
    value: Annotated[float, Meta(gt=0)]
    tolerance: Annotated[float, Meta(ge=0, lt=1)] = 0.1
    better: Literal["higher", "lower"]
    source: str = ""  # where the number comes from (a measurement, the simulator's settings)


class BenchSpec(Strict, frozen=True, kw_only=True):
    """What `doit bench` measures on this profile, and the baseline it must hold."""

    # Where the service answers, when the deployment cannot say (Kubernetes: from the runner).
    endpoint: Annotated[str, Meta(pattern=r"^https?://\S+$")] | None = None
    concurrency: Annotated[list[Count], Meta(min_length=1)] = field(
        default_factory=lambda: [1, 2, 4, 8]
    )
    requests_per_stream: Count = 1
    # Runs of each cell: the gate reads a bootstrap 95% interval over them (1: one number).
    repeats: Count = 3
    prompt_tokens: Count = 256
    # Output tokens per sweep request; the decode window is tokens 129-641, so at least 641.
    max_tokens: Annotated[int, Meta(ge=641)] = 768
    saturation_streams: Count = 8
    saturation_tokens: Count = 6000
    needles: list[Count] = []
    needle_seconds_per_1k: Annotated[float, Meta(gt=0)] = 10.0
    request_timeout_s: Annotated[float, Meta(gt=0)] = 900.0
    baseline: list[BaselineSpec] = []


class StagingSpec(Strict, frozen=True, kw_only=True):
    """Ring staging of the weights: the members' blob servers and how long a file is awaited."""

    port: Annotated[int, Meta(ge=1, le=65535)] = 8098
    # A file no peer has published after this long is fetched from S3 after all.
    peer_wait_s: Annotated[float, Meta(gt=0)] = 1800.0
    # The image each member runs its staging in (images/<name>).
    image: Name = "weights-stager"


class HygieneSpec(Strict, frozen=True):
    """Node settings applied before a group boots."""

    swap_off: bool
    drop_page_cache: bool
    min_free_kbytes: Annotated[int, Meta(ge=0)]  # 0: the host's own setting is left as it is


class Profile(Strict, frozen=True, kw_only=True):
    """A whole profile: model, image, runtime, members and how they are deployed."""

    name: Name
    description: str
    runtime: Literal["simulated", "vllm", "sglang"]
    deploy: Literal["docker", "kubernetes"]
    local_stack: bool = False
    # Where ring nodes keep blobs and staged models (SPARKFORGE_WEIGHTS when they run the fetch).
    node_weights_root: str = "/var/lib/sparkforge/weights"
    registry: Annotated[str, Meta(pattern=r"^[a-z0-9.-]+(:[0-9]+)?(/[a-z0-9._-]+)*$")] | None = None
    image: Name
    model: ModelSpec
    parallel: ParallelSpec
    resources: ResourcesSpec
    members: Annotated[list[MemberSpec], Meta(min_length=1, max_length=64)]
    fabric: FabricSpec | None = None
    kubernetes: KubernetesSpec | None = None
    hygiene: HygieneSpec | None = None
    env: dict[EnvName, str] = {}
    vllm: VllmSpec | None = None
    sglang: SglangSpec | None = None
    simulator: SimulatorSpec | None = None
    bench: BenchSpec = field(default_factory=BenchSpec)
    staging: StagingSpec = field(default_factory=StagingSpec)

    def __post_init__(self) -> None:
        """The rules across sections, each naming its field."""
        self.runtime_has_its_settings()
        self.images_have_a_registry()
        self.docker_members_have_engines()
        self.ring_is_consistent()
        self.links_join_members()
        self.members_are_distinct()
        self.patched_nccl_is_mounted()
        self.attention_divides()

    def runtime_has_its_settings(self) -> None:
        """The section named by runtime is present, and no other engine's section."""
        engines = {"vllm": self.vllm, "sglang": self.sglang, "simulated": self.simulator}
        section = "simulator" if self.runtime == "simulated" else self.runtime
        if engines[self.runtime] is None:
            raise ValueError(f"field {section!r}: required by runtime {self.runtime!r}")
        extra = [k for k, v in engines.items() if v is not None and k != self.runtime]
        if extra:
            raise ValueError(f"field {extra[0]!r}: does not apply to runtime {self.runtime!r}")

    def images_have_a_registry(self) -> None:
        """Images go to the local stack's registry or to the one the profile names."""
        if not self.local_stack and not self.registry:
            raise ValueError("field 'registry': required unless local_stack is true")

    def docker_members_have_engines(self) -> None:
        """Docker deploys reach each member's engine by URL (local_stack: the stack's engine)."""
        if self.deploy == "docker" and not self.local_stack:
            for rank, member in enumerate(self.members):
                if member.docker is None:
                    raise ValueError(
                        f"field 'members.{rank}.docker': required for deploy docker"
                        " (the member's Docker URL, e.g. ssh://user@host)"
                    )

    def ring_is_consistent(self) -> None:
        """Parallelism covers the ring exactly, and a multi-node ring has a fabric."""
        gpus = len(self.members) * self.resources.gpu
        if self.parallel.tensor * self.parallel.pipeline != gpus:
            raise ValueError(
                f"field 'parallel': tensor x pipeline = "
                f"{self.parallel.tensor * self.parallel.pipeline}, expected members x "
                f"resources.gpu = {gpus}"
            )
        # A simulated ring (the local stack's engines) has no data plane to describe.
        if len(self.members) > 1 and self.fabric is None and self.runtime != "simulated":
            raise ValueError("field 'fabric': required for a ring of more than one member")
        if self.deploy == "kubernetes":
            for name, value in (
                ("kubernetes", self.kubernetes),
                ("hygiene", self.hygiene),
                ("model.source_secret", self.model.source_secret),
            ):
                if value is None:
                    raise ValueError(f"field {name!r}: required by deploy 'kubernetes'")
        if self.deploy == "kubernetes":
            for i, member in enumerate(self.members):
                if not member.claim:
                    raise ValueError(f"field 'members.{i}.claim': required by deploy 'kubernetes'")

    def links_join_members(self) -> None:
        """Links name other members, both ends list each other, and they join the whole ring."""
        nodes = {m.node: rank for rank, m in enumerate(self.members)}
        linked = [m for m in self.members if m.links]
        if not linked:
            return
        for rank, member in enumerate(self.members):
            if not member.links:
                raise ValueError(
                    f"field 'members.{rank}.links': required once any member names its links"
                )
        for rank, member in enumerate(self.members):
            for peer in member.links:
                if peer not in nodes or peer == member.node:
                    raise ValueError(
                        f"field 'members.{rank}.links.{peer}': expected another member's node"
                        f" (one of {', '.join(n for n in nodes if n != member.node)})"
                    )
                if member.node not in self.members[nodes[peer]].links:
                    raise ValueError(
                        f"field 'members.{nodes[peer]}.links': expected {member.node!r}, the"
                        f" other end of members.{rank}.links.{peer}"
                    )
        reached, todo = {self.members[0].node}, [self.members[0].node]
        while todo:
            for peer in self.members[nodes[todo.pop()]].links:
                if peer not in reached:
                    reached.add(peer)
                    todo.append(peer)
        if len(reached) != len(self.members):
            apart = next(m.node for m in self.members if m.node not in reached)
            raise ValueError(f"field 'members': the links do not reach {apart!r} from the others")

    def members_are_distinct(self) -> None:
        """No two members share a node, a cache claim or a Docker engine (each would render
        documents that overwrite the other's)."""
        for what in ("node", "claim", "docker"):
            seen: dict[str, int] = {}
            for rank, member in enumerate(self.members):
                value = getattr(member, what)
                if value is None:
                    continue
                if value in seen:
                    raise ValueError(
                        f"field 'members.{rank}.{what}': {value!r} is members.{seen[value]}'s"
                        f" too; expected one {what} per member"
                    )
                seen[value] = rank

    def patched_nccl_is_mounted(self) -> None:
        """A ring that asks for the patched NCCL gets it: SGLang mounts it over the image's."""
        asked = self.runtime == "sglang" and self.fabric and self.fabric.patched_nccl
        if asked and self.sglang is not None and self.sglang.nccl_overlay is None:
            raise ValueError(
                "field 'sglang.nccl_overlay': required by fabric.patched_nccl (without it"
                " the image's stock NCCL runs with NCCL_SWITCHLESS_RING_ONLY set)"
            )

    def attention_divides(self) -> None:
        """Heads and o_groups divide by the tensor size, padded (72/9) only where needed."""
        tp = self.parallel.tensor
        if self.model.config_patch == "tp3-heads" and (72 % tp or 9 % tp):
            raise ValueError(
                f"field 'model.config_patch': tp3-heads pads to 72 heads / 9 o_groups, which"
                f" tensor {tp} does not divide"
            )
        if self.model.config_patch == "none" and (64 % tp or 8 % tp):
            raise ValueError(
                f"field 'model.config_patch': tensor {tp} does not divide 64 heads / 8 o_groups;"
                " expected tp3-heads"
            )
        if self.vllm:
            for arg in self.vllm.extra_args:
                if option_name(arg) in BANNED_VLLM_OPTIONS:
                    raise ValueError(
                        f"field 'vllm.extra_args': {arg.split('=')[0]} must not be used (the"
                        " checkpoint declares its quantization; padding is a config patch)"
                    )


# vLLM's own spellings of the options a profile must not pass: its parser takes '_' for '-'
# in long options, and -q is --quantization.
BANNED_VLLM_OPTIONS = ("--hf-overrides", "--quantization")
VLLM_SHORT_OPTIONS = {"-q": "--quantization"}


def option_name(arg: str) -> str:
    """The long option an argument sets, as vLLM reads it (`--hf_overrides=x` -> --hf-overrides)."""
    name = arg.split("=", 1)[0]
    if name.startswith("--"):
        return "--" + name[2:].replace("_", "-")
    return VLLM_SHORT_OPTIONS.get(name[:2], name)


def required(section: S | None, field: str, profile: Profile) -> S:
    """A section the profile's rules guarantee where it is used (the runtime's settings, a
    ring's fabric, kubernetes for a Kubernetes deploy), or ProfileError naming it."""
    if section is None:
        raise ProfileError(f"profile {profile.name}: field {field!r}: required here")
    return section


# A profile name is a name, never a path: it becomes a file name here, a folder of records and
# a label value (63 characters at most) on what deploy makes.
PROFILE_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")


def profile_path(name: str, folder: Path = PROFILES_DIR) -> Path:
    """The YAML file of a profile name; ProfileError for anything that is not a name."""
    if not PROFILE_NAME.fullmatch(name):
        shown = name if len(name) <= 80 else name[:77] + "..."
        raise ProfileError(
            f"profile={shown!r}: expected a profile name (lowercase letters, digits and '-',"
            " at most 63), not a path"
        )
    return folder / f"{name}.yaml"


def available_profiles(folder: Path = PROFILES_DIR) -> list[str]:
    """Names of the profiles in a folder."""
    return sorted(p.stem for p in folder.glob("*.yaml"))


def load_profile(name: str, folder: Path = PROFILES_DIR) -> Profile:
    """Read and validate one profile, or raise ProfileError with one line."""
    path = profile_path(name, folder)
    if not path.is_file():
        known = ", ".join(available_profiles(folder)) or "none"
        raise ProfileError(f"profile {name!r}: no file {path} (profiles: {known})")
    return parse_profile(path)


def parse_profile(path: Path) -> Profile:
    """Validate the YAML file at path as a profile."""
    profile = load_yaml_model(path, Profile, ProfileError)
    if profile.name != path.stem:
        raise ProfileError(
            f"{path}: field 'name': expected {path.stem!r} (the file name), got {profile.name!r}"
        )
    return profile
