"""Preflight on a Docker host: a throwaway container of the candidate image looks at what the
member will run on (its staged model folder, disk, swap, the NCCL library it will mount, the
fabric's RDMA devices: present, port up, RoCE v2 at the GID index, the ring's MTU)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.core.profiles import FabricSpec

# The string a sparkring NCCL build carries (shared/reference: "a qualifying library").
RING_ONLY_MARK = "SWITCHLESS_RING_ONLY"
NCCL_NAME = "libnccl.so"
# The RDMA devices' sysfs (the kernel's drivers/infiniband/core/sysfs.c): ports/<n>/state reads
# "4: ACTIVE", ports/<n>/gid_attrs/types/<i> "RoCE v2", ports/<n>/gid_attrs/ndevs/<i> the netdev.
RDMA_SYSFS = "/sys/class/infiniband"

# Runs inside the image (python3 is in every runtime image); prints one JSON object.
SCRIPT = r"""
import hashlib, json, os, sys
need = json.loads(sys.argv[1])
found = []
folder, record = need["models"], need["models"] + ".staged.json"
if not os.path.isfile(os.path.join(folder, "config.json")):
    found.append(f"model folder {need['source']}: no config.json (not staged on this host?)")
elif need["lock_sha256"]:
    try:
        staged = json.load(open(record))["lock_sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        staged = None
    if staged != need["lock_sha256"]:
        found.append(
            f"model folder {need['source']}: staged from lock sha256 {staged}, expected"
            f" {need['lock_sha256']} (stage the profile's lock on this host)"
        )
st = os.statvfs(folder) if os.path.isdir(folder) else None
free = st.f_bavail * st.f_frsize if st else 0
if free < need["min_free_bytes"]:
    want = need["min_free_bytes"]
    found.append(f"free disk under {need['source']}: {free} bytes, expected >= {want}")
if need["swap_off"]:
    swaps = open("/proc/swaps").read().splitlines()[1:]
    if swaps:
        found.append(f"swap is on ({len(swaps)} devices), expected off")
nccl = None
if need["nccl"]:
    try:
        data = open("/nccl/lib", "rb").read()
    except OSError as err:
        found.append(f"NCCL library {need['nccl']}: {err.strerror}")
    else:
        nccl = hashlib.sha256(data).hexdigest()
        if need["ring_only_mark"] and need["ring_only_mark"].encode() not in data:
            found.append(
                f"NCCL library {need['nccl']}: no {need['ring_only_mark']} in it, expected the"
                " patched (sparkring) build"
            )
fabric = need["fabric"]
if fabric:
    rdma, gid = fabric["rdma"], str(fabric["gid_index"])
    present = sorted(os.listdir(rdma)) if os.path.isdir(rdma) else []
    for hca, port in fabric["devices"]:
        where, base = f"fabric device {hca} port {port}", os.path.join(rdma, hca, "ports", port)

        def read(*parts):
            try:
                return open(os.path.join(base, *parts)).read().strip()
            except OSError:
                return None

        if hca not in present:
            found.append(
                f"fabric device {hca}: not on this host (it has: {', '.join(present) or 'none'}),"
                " expected every device of fabric.ib_hca"
            )
            continue
        state = read("state")
        if state is None:
            found.append(f"{where}: no such port")
            continue
        if state.partition(": ")[2] != "ACTIVE":
            found.append(f"{where}: state {state!r}, expected ACTIVE (its link or neighbour down?)")
        kind = read("gid_attrs", "types", gid)
        if kind != "RoCE v2":
            found.append(
                f"{where}: GID index {gid} is {kind or 'not populated'}, expected RoCE v2"
                " (fabric.ib_gid_index)"
            )
            continue
        ndev = read("gid_attrs", "ndevs", gid)
        try:
            mtu = int(open(f"/sys/class/net/{ndev}/mtu").read())
        except (OSError, ValueError):
            found.append(f"{where}: netdev {ndev} has no readable MTU")
            continue
        if mtu != fabric["mtu"]:
            want = fabric["mtu"]
            found.append(f"{where} (netdev {ndev}): MTU {mtu}, expected {want} (fabric.mtu)")
print(json.dumps({"problems": found, "nccl_sha256": nccl}))
"""


@dataclass
class Needs:
    """What preflight checks on a member, and the mounts that let the container see it."""

    args: dict[str, Any]
    mounts: list[tuple[str, str]] = field(default_factory=list)  # (container path, host path)


def fabric_needs(fabric: FabricSpec | None, rdma: str = RDMA_SYSFS) -> dict[str, Any] | None:
    """What the fabric check reads: each HCA and its port (NCCL_IB_HCA's `name[:port]`), the
    GID index NCCL uses, the MTU the ring runs at; rdma, where the RDMA devices' sysfs is."""
    if fabric is None:
        return None
    devices = [[hca, port or "1"] for hca, _, port in (h.partition(":") for h in fabric.ib_hca)]
    return {"devices": devices, "gid_index": fabric.ib_gid_index, "mtu": fabric.mtu, "rdma": rdma}


def member_needs(
    plan: dict[str, Any],
    swap_off: bool,
    min_free: int,
    lock_sha256: str,
    ring_only: bool,
    fabric: dict[str, Any] | None = None,
) -> Needs:
    """The checks of one launch plan: its model folder (and the record beside it), its NCCL,
    the fabric's devices."""
    source = Path(next(m for m in plan["mounts"] if m["target"] == "/models")["source"])
    nccl = next(
        (m["source"] for m in plan["mounts"] if Path(m["target"]).name.startswith(NCCL_NAME)),
        None,
    )
    needs = Needs(
        {
            "models": f"/staged/{source.name}",
            "source": str(source),
            "min_free_bytes": min_free,
            "swap_off": swap_off,
            "lock_sha256": lock_sha256,
            "nccl": nccl,
            "ring_only_mark": RING_ONLY_MARK if ring_only and nccl else None,
            "fabric": fabric,
        },
        # The folder's parent: the staged folder and the record of its lock beside it.
        [("/staged", str(source.parent))],
    )
    if nccl:
        needs.mounts.append(("/nccl/lib", nccl))
    return needs


def read_answer(output: bytes) -> tuple[list[str], str | None]:
    """(problems, NCCL sha256) from what the preflight container printed."""
    answer = json.loads(output.decode().strip().splitlines()[-1])
    return answer["problems"], answer["nccl_sha256"]


def nccl_disagreements(hashes: dict[str, str], pinned: str | None = None) -> list[str]:
    """One line per member whose NCCL library differs from the profile's pin, or without a pin
    from rank 0's (every member must run the same NCCL build)."""
    if pinned:
        return [
            f"member {node}: NCCL library sha256 {digest}, expected {pinned}"
            " (sglang.nccl_overlay.sha256)"
            for node, digest in hashes.items()
            if digest != pinned
        ]
    if len(set(hashes.values())) <= 1:
        return []
    (first, reference), *rest = hashes.items()
    return [
        f"member {node}: NCCL library sha256 {digest}, expected {reference} (as on {first})"
        for node, digest in rest
        if digest != reference
    ]


def provenance_problems(check: Callable[[str], list[str]], image: str) -> list[str]:
    """The image's provenance refusals (pipelines/stages/provenance/), asked before any member is
    touched: an unattested image, an untrusted signer, another subject, other inputs."""
    return check(image)
