"""Benchmark: a runner that starts empty, cold vs restored from the remote cache (goal >= 10x).

Run: .venv/bin/python tests/perf/remote_cache.py   (needs `scripts/stack up`)

Both runs are `doit build profile=local` as a subprocess with an empty store folder, an empty
weights folder (at the same path, as on CI runners, so render's key agrees) and a registry
namespace of the run's own, sharing one remote cache under a fresh prefix of the stack's S3:

- cold: nothing anywhere: the image is built and pushed, the weights fetched, every keyed step
  built and uploaded (signed). The local Debian base stays in the registry: it is built once
  per machine (debootstrap), outside both runs.
- restored: a second empty store, reading the cache with the public key only: the image found
  in the registry (the image's cache), the weights fetched from their own bucket, every
  store-backed step restored and verified, none built.

Prints both wall times, the ratio, and the store-backed steps' own times (built vs restored).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from support.registry_repos import delete_repository  # noqa: E402

import devstack  # noqa: E402
from devstack.settings import StackDown  # noqa: E402
from pipelines.core.signing.namedkeys import keygen  # noqa: E402

BUCKET = "models"


def build(root: Path, store: str, prefix: str, namespace: str, env: dict) -> tuple[float, str]:
    """(wall seconds, output) of one `doit build profile=local`."""
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "doit", "build", "profile=local"],
        cwd=REPO,
        env={
            **os.environ,
            "SPARKFORGE_STORE": str(root / store),
            "SPARKFORGE_WEIGHTS": str(root / "weights"),
            "SPARKFORGE_REGISTRY_NAMESPACE": namespace,
            "SPARKFORGE_REMOTE_CACHE": f"s3://{BUCKET}/{prefix}",
            **env,
        },
        capture_output=True,
        text=True,
        timeout=3600,
    )
    took = time.monotonic() - started
    if run.returncode != 0:
        sys.exit(f"{store}: doit build failed:\n{run.stdout}\n{run.stderr}")
    return took, run.stdout


def step_times(output: str, verb: str) -> dict[str, float]:
    """Step -> seconds from the engine's '<step>: <verb> <key> ... (<t> s)' lines."""
    pattern = rf"^(\w+): {verb} [0-9a-f]{{16}}.*\(([0-9.]+) s\)$"
    return {m[1]: float(m[2]) for m in re.finditer(pattern, output, re.MULTILINE)}


def main() -> None:
    """Cold, then restored; the table and the ratio."""
    try:
        endpoints = devstack.read_endpoints()
    except StackDown as down:
        raise SystemExit(f"remote_cache: {down}") from None
    devstack.export_s3_environment()
    s3 = devstack.s3_client(endpoints, devstack.s3_credentials())
    prefix = f"perf-remote-cache-{uuid.uuid4().hex[:8]}"
    namespace = f"perf-remote-cache-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="remote-cache-perf.") as tmp:
        root = Path(tmp)
        public = keygen("perf-writer", root / "key.pem")
        for name in [k for k in os.environ if k.startswith("SPARKFORGE_CACHE")]:
            os.environ.pop(name)
        writer = {"SPARKFORGE_CACHE_SIGNING_KEY": (root / "key.pem").read_text()}
        reader = {"SPARKFORGE_CACHE_TRUSTED_KEYS": public}
        try:
            cold, cold_out = build(root, "cold", prefix, namespace, writer)
            shutil.rmtree(root / "weights")
            warm, warm_out = build(root, "restored", prefix, namespace, reader)
        finally:
            objects = s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/").get("Contents", [])
            for obj in objects:
                s3.delete_object(Bucket=BUCKET, Key=obj["Key"])
            delete_repository(endpoints.registry, f"{namespace}/sparkforge/local-sim")
    built = step_times(cold_out, "built")
    restored = step_times(warm_out, "restored")
    if step_times(warm_out, "built") or set(restored) != {"profile", "patch_config", "render"}:
        sys.exit(f"the restored build did step work:\n{warm_out}")
    print(f"{'step':<14}{'cold: built (s)':>18}{'restored (s)':>16}")
    for step in sorted(built):
        again = f"{restored[step]:.2f}" if step in restored else "in registry"
        print(f"{step:<14}{built[step]:>18.2f}{again:>16}")
    print(f"{'doit build':<14}{cold:>18.2f}{warm:>16.2f}")
    print(f"ratio cold / restored: {cold / warm:.1f}x (goal >= 10x)")


if __name__ == "__main__":
    main()
