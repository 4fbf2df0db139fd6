"""Settings from the environment, read once at the edge (dodo.py) and passed to the stages."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pipelines.core.errors import BadInput
from pipelines.core.paths import DEFAULT_STORE, PROFILES_DIR

STORE_ENV = "SPARKFORGE_STORE"
WEIGHTS_ENV = "SPARKFORGE_WEIGHTS"
BUILDER_ENV = "SPARKFORGE_BUILDER"
# A deploy's wait for its members to serve: twice the 8 minutes a Spark ring's group can take
# to come back after a change (pipelines/profiles/FACTS.md); 300 s rolled back deploys that
# would have served.
DEPLOY_TIMEOUT_S = 960.0
# Names whose values are secrets: never rendered, printed or stored (checked on output).
SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSWORD|ACCESS_KEY|SIGNING_KEY", re.IGNORECASE)


@dataclass(frozen=True)
class Settings:
    """Everything the pipeline takes from the environment."""

    store: Path
    weights: Path | None
    fetch_part_mib: float | None
    fetch_workers: int | None
    fetch_max_mbps: float | None
    fetch_durable: bool
    builder: str | None
    deploy_timeout_s: float = DEPLOY_TIMEOUT_S
    stage_timeout_s: float = 6 * 3600.0  # the waits that stage weights (Kubernetes)
    # A folder of profiles kept outside the checkout (a lab's own), else the checkout's.
    profiles: Path = PROFILES_DIR
    # Pushes and tags go under <registry>/<namespace> (a lab's, or a test's own).
    registry_namespace: str | None = None
    secrets: tuple[str, ...] = field(repr=False, default=())
    kubeconfig: str | None = None  # KUBECONFIG; None: ~/.kube/config
    kube_context: str | None = None
    kube_dry_run: bool = False  # every Kubernetes write with dryRun=All
    bench_url: str = ""  # SPARKFORGE_BENCH_URL: the endpoint `doit bench` measures
    remote_cache: str | None = None  # SPARKFORGE_REMOTE_CACHE: s3://BUCKET/PREFIX
    # SPARKFORGE_CACHE_SIGNING_KEY: a secret (never printed: repr=False, and in `secrets`).
    cache_signing_key: str | None = field(repr=False, default=None)
    cache_trusted_keys: tuple[str, ...] = ()  # SPARKFORGE_CACHE_TRUSTED_KEYS, comma-separated
    cache_readonly: bool = False  # SPARKFORGE_CACHE_READONLY=1: read and verify, never write
    # SPARKFORGE_BUILDX_CACHE: a registry ref buildx reads its layer cache from and writes it to
    buildx_cache: str | None = None
    # SPARKFORGE_SIGNING_KEY (a secret, `name:base64`) or the file SPARKFORGE_SIGNING_KEY_FILE
    # names: the key image attestations are signed with (pipelines/core/signing/keyring.py).
    signing_key: str | None = field(repr=False, default=None)
    signing_key_file: Path | None = None
    trusted_keys: tuple[str, ...] = ()  # SPARKFORGE_TRUSTED_KEYS: name:base64, comma-separated
    # SPARKFORGE_MODEL_SIGNING_KEY (a secret, `name:base64` of a P-256 scalar) or the file
    # SPARKFORGE_MODEL_SIGNING_KEY_FILE names: the key the model's manifest is signed with
    # (stages/weights/signature.py); P-256 because the model signing library takes no ed25519.
    model_signing_key: str | None = field(repr=False, default=None)
    model_signing_key_file: Path | None = None
    # SPARKFORGE_MODEL_TRUSTED_KEYS: name:base64 (P-256, compressed), comma-separated
    model_trusted_keys: tuple[str, ...] = ()
    # GITHUB_REPOSITORY (CI's), the source an attestation names; a local checkout otherwise.
    source_repository: str = "local checkout"
    # SPARKFORGE_GC_KEEP_BUILDS: `doit gc` keeps the outputs of each profile's last N builds
    gc_keep_builds: int = 3
    # SPARKFORGE_GC_TAG_DAYS: registry tags a gc first saw this many days ago may go
    gc_tag_days: float = 30.0


# A number as a person writes one: digits, an optional fraction; no sign, exponent, inf or
# nan, and short (Python refuses to read ints past 4,300 digits with a traceback).
DECIMAL = re.compile(r"[0-9]{1,12}(\.[0-9]{1,6})?")


def shown(value: str) -> str:
    """A value from the environment as an error line quotes it: repr, shortened."""
    return repr(value if len(value) <= 40 else value[:37] + "...")


# The store's deepest paths add some 200 characters to its folder; Linux allows 4,096 in all
# and 255 bytes a name.
PATH_MAX = 1024


def path_setting(environ: Mapping[str, str], name: str) -> Path | None:
    """A folder or file named by the environment, made absolute; None when unset; one line
    when it could not be a path here (too long, a name over 255 bytes, a NUL)."""
    value = environ.get(name)
    if not value:
        return None
    names = value.encode(errors="surrogateescape").split(b"/")
    if "\0" in value or len(value) > PATH_MAX or any(len(part) > 255 for part in names):
        raise BadInput(
            f"environment {name}={shown(value)}: expected a path of at most {PATH_MAX}"
            " characters, each name at most 255 bytes"
        )
    return Path(value).absolute()


def plain(number: float) -> str:
    """A bound as a person reads it: 2,592,000, 0.001."""
    return f"{int(number):,}" if number == int(number) else f"{number:g}"


def bounded(environ: Mapping[str, str], name: str, low: float, high: float) -> float | None:
    """A number between low and high (both included) from the environment, None when unset;
    one line naming the variable and the range otherwise."""
    value = environ.get(name)
    if not value:
        return None
    if not DECIMAL.fullmatch(value) or not low <= float(value) <= high:
        raise BadInput(
            f"environment {name}={shown(value)}: expected a number from {plain(low)} to"
            f" {plain(high)}"
        )
    return float(value)


def days_or(value: float | None, default: float) -> float:
    """value, or default when unset (0 is a value: tags of any age)."""
    return default if value is None else value


def whole(environ: Mapping[str, str], name: str, low: int, high: int) -> int | None:
    """A whole number between low and high from the environment, None when unset."""
    value = environ.get(name)
    if not value:
        return None
    if not re.fullmatch(r"[0-9]{1,9}", value) or not low <= int(value) <= high:
        raise BadInput(
            f"environment {name}={shown(value)}: expected a whole number from {plain(low)} to"
            f" {plain(high)}"
        )
    return int(value)


def secret_values(environ: Mapping[str, str]) -> tuple[str, ...]:
    """Values that must never appear in output: secrets from the environment."""
    return tuple(v for k, v in environ.items() if SECRET_NAME.search(k) and len(v) >= 8)


def registry_namespace(environ: Mapping[str, str]) -> str | None:
    """SPARKFORGE_REGISTRY_NAMESPACE, checked as a registry path; None when unset."""
    value = environ.get("SPARKFORGE_REGISTRY_NAMESPACE")
    if value and not re.fullmatch(r"[a-z0-9._-]+(/[a-z0-9._-]+)*", value):
        raise BadInput(
            f"environment SPARKFORGE_REGISTRY_NAMESPACE={value!r}: expected lowercase path"
            " components [a-z0-9._-] separated by '/'"
        )
    return value or None


def kube_dry_run(environ: Mapping[str, str]) -> bool:
    """SPARKFORGE_KUBE_DRY_RUN: 'server' (kubectl's --dry-run=server) or unset."""
    value = environ.get("SPARKFORGE_KUBE_DRY_RUN", "")
    if value not in ("", "server"):
        raise BadInput(f"environment SPARKFORGE_KUBE_DRY_RUN={value!r}: expected 'server' or unset")
    return value == "server"


def read_settings(environ: Mapping[str, str]) -> Settings:
    """The settings of this run, from environ (os.environ at the edge)."""
    return Settings(
        store=path_setting(environ, STORE_ENV) or DEFAULT_STORE.absolute(),
        weights=path_setting(environ, WEIGHTS_ENV),
        # A part of at least 1 MiB (less is many ranges of a few bytes), at most 1 GiB (held in
        # memory while it streams).
        fetch_part_mib=bounded(environ, "SPARKFORGE_FETCH_PART_MIB", 1, 1024),
        fetch_workers=whole(environ, "SPARKFORGE_FETCH_WORKERS", 1, 256),
        fetch_max_mbps=bounded(environ, "SPARKFORGE_FETCH_MAX_MBPS", 0.001, 1_000_000),
        fetch_durable=environ.get("SPARKFORGE_FETCH_FSYNC", "1") != "0",
        builder=environ.get(BUILDER_ENV) or None,
        # Finite, so that a deploy that never serves is rolled back: a second to a week (staging
        # 460 GB: up to thirty days).
        deploy_timeout_s=bounded(environ, "SPARKFORGE_DEPLOY_TIMEOUT", 1, 7 * 86400)
        or DEPLOY_TIMEOUT_S,
        stage_timeout_s=bounded(environ, "SPARKFORGE_STAGE_TIMEOUT", 1, 30 * 86400) or 6 * 3600.0,
        profiles=path_setting(environ, "SPARKFORGE_PROFILES") or PROFILES_DIR.absolute(),
        registry_namespace=registry_namespace(environ),
        secrets=secret_values(environ),
        kubeconfig=environ.get("KUBECONFIG") or None,
        kube_context=environ.get("SPARKFORGE_KUBE_CONTEXT") or None,
        kube_dry_run=kube_dry_run(environ),
        bench_url=bench_url(environ),
        remote_cache=remote_cache_url(environ),
        cache_signing_key=environ.get("SPARKFORGE_CACHE_SIGNING_KEY") or None,
        cache_trusted_keys=key_list(environ.get("SPARKFORGE_CACHE_TRUSTED_KEYS", "")),
        cache_readonly=flag(environ, "SPARKFORGE_CACHE_READONLY"),
        buildx_cache=buildx_cache(environ),
        signing_key=environ.get("SPARKFORGE_SIGNING_KEY") or None,
        signing_key_file=path_setting(environ, "SPARKFORGE_SIGNING_KEY_FILE"),
        trusted_keys=key_list(environ.get("SPARKFORGE_TRUSTED_KEYS", "")),
        model_signing_key=environ.get("SPARKFORGE_MODEL_SIGNING_KEY") or None,
        model_signing_key_file=path_setting(environ, "SPARKFORGE_MODEL_SIGNING_KEY_FILE"),
        model_trusted_keys=key_list(environ.get("SPARKFORGE_MODEL_TRUSTED_KEYS", "")),
        source_repository=environ.get("GITHUB_REPOSITORY") or "local checkout",
        gc_keep_builds=whole(environ, "SPARKFORGE_GC_KEEP_BUILDS", 1, 10_000) or 3,
        gc_tag_days=days_or(bounded(environ, "SPARKFORGE_GC_TAG_DAYS", 0, 36_500), 30.0),
    )


def key_list(value: str) -> tuple[str, ...]:
    """The keys of a list separated by commas or spaces (Nix separates trusted keys by spaces)."""
    return tuple(k for k in re.split(r"[,\s]+", value) if k)


def buildx_cache(environ: Mapping[str, str]) -> str | None:
    """SPARKFORGE_BUILDX_CACHE, checked as registry/repository:tag (it goes into buildx's
    comma-separated --cache-to, where a comma or '=' would add options); None when unset."""
    value = environ.get("SPARKFORGE_BUILDX_CACHE")
    ref = r"[A-Za-z0-9.-]+(:[0-9]+)?(/[a-z0-9._-]+)+:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
    if value and not re.fullmatch(ref, value):
        raise BadInput(
            f"environment SPARKFORGE_BUILDX_CACHE={value!r}: expected registry/repository:tag"
        )
    return value or None


def remote_cache_url(environ: Mapping[str, str]) -> str | None:
    """SPARKFORGE_REMOTE_CACHE, s3://BUCKET/PREFIX, or None."""
    value = environ.get("SPARKFORGE_REMOTE_CACHE", "")
    if value and not re.fullmatch(r"s3://[a-z0-9][a-z0-9.-]+/[^\s]*[^/\s][^\s]*", value):
        raise BadInput(
            f"environment SPARKFORGE_REMOTE_CACHE={value!r}: expected s3://BUCKET/PREFIX"
        )
    return value or None


def flag(environ: Mapping[str, str], name: str) -> bool:
    """A 0/1 switch from the environment (unset: off)."""
    value = environ.get(name, "")
    if value not in ("", "0", "1"):
        raise BadInput(f"environment {name}={value!r}: expected 1 or 0")
    return value == "1"


def bench_url(environ: Mapping[str, str]) -> str:
    """SPARKFORGE_BENCH_URL, an http(s) URL, or empty."""
    value = environ.get("SPARKFORGE_BENCH_URL", "")
    if value and not re.fullmatch(r"https?://\S+", value):
        raise BadInput(f"environment SPARKFORGE_BENCH_URL={value!r}: expected http(s)://...")
    return value
