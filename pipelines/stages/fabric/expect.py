"""What a ring's fabric must show, and the check: one line per failed expectation (pure)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pipelines.core.errors import BadInput, PipelineError
from pipelines.core.profiles import Profile
from pipelines.stages.fabric.nccllog import NcclLog

# The three-Spark ring's published three-rank all-reduce (pipelines/profiles/FACTS.md,
# 2026-09-13) and the share of it tp3-ring's floor keeps (`fabric.min_busbw_gbs`): nccl-tests'
# own margin before it prints FAILED for a minimum bandwidth (`bw < check_avg_bw * 0.9`,
# src/util.cu), wide enough for run-to-run variation; a NET/Socket fallback lands an order of
# magnitude below (2.9 vs 328 GB/s on the H200 pair), so the floor cannot pass a fallback.
TP3_MEASURED_BUSBW = 23.2
TOLERANCE = 0.9
TRANSPORTS = ("NET/IB", "NET/Socket", "P2P", "SHM", "CollNet")


class FabricError(PipelineError):
    """A fabric check that cannot run or be read, in one line."""


class ExpectationError(FabricError, BadInput):
    """An expectation that cannot be read, or a profile that gives none."""


@dataclass(frozen=True)
class Expectations:
    """The transport every channel must use, the busbw floor at the largest size, the HCAs."""

    transport: str
    min_busbw_gbs: float | None = None
    hcas: tuple[str, ...] = ()


def expectations_for(profile: Profile) -> Expectations:
    """A ring profile's expectations: NET/IB on every channel, its floor, its fabric.ib_hca."""
    fabric = profile.fabric
    if fabric is None:
        raise ExpectationError(
            f"profile {profile.name}: field 'fabric': required for a fabric check (a ring's"
            " RoCE data plane)"
        )
    return Expectations(
        transport=fabric.transport,
        min_busbw_gbs=fabric.min_busbw_gbs,
        hcas=tuple(fabric.ib_hca),
    )


def parse_expectation(text: str) -> Expectations:
    """`P2P>=200` or `NET/IB>=20.9:rocep1s0f0,rocep1s0f1`: an expectation given by hand."""
    m = re.fullmatch(r"(?P<t>[A-Za-z0-9/]+)(?:>=(?P<bw>[\d.]+))?(?::(?P<hcas>[\w,.-]+))?", text)
    if not m or m["t"] not in TRANSPORTS:
        raise ExpectationError(
            f"expectation {text!r}: expected TRANSPORT[>=GBPS][:HCA,...] with TRANSPORT one of"
            f" {', '.join(TRANSPORTS)}"
        )
    hcas = tuple(h for h in (m["hcas"] or "").split(",") if h)
    return Expectations(m["t"], float(m["bw"]) if m["bw"] else None, hcas)


def failures(log: NcclLog, expect: Expectations) -> list[str]:
    """One line per failed expectation; empty when the fabric is as expected."""
    lines = [f"error: {line}" for line in log.errors[:5]]
    if len(log.errors) > 5:
        lines.append(f"error: ... and {len(log.errors) - 5} more error lines")
    largest = log.largest
    measured = f"{largest.busbw:.2f} GB/s busbw at {largest.size} bytes" if largest else "no busbw"
    if not log.channels:
        lines.append(
            "transport: no `Channel ... via` lines (NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET"
            f" not set, or channel setup failed); expected every channel via {expect.transport}"
        )
    for transport in sorted(log.transports - {expect.transport}):
        off = [c for c in log.channels if c.transport == transport]
        first = off[0]
        lines.append(
            f"transport: {len(off)} of {len(log.channels)} channel connections via {transport}"
            f" ({measured}), e.g. {first.host or '?'} channel {first.channel:02d}"
            f" {first.src}->{first.dst} via {first.via}; expected every channel via"
            f" {expect.transport}"
        )
    if largest is None:
        lines.append("busbw: no all-reduce result (the sweep did not run to its end)")
    elif expect.min_busbw_gbs is not None and largest.busbw < expect.min_busbw_gbs:
        lines.append(f"busbw: {measured}, expected at least {expect.min_busbw_gbs:g} GB/s")
    wrong = [r for r in log.results if r.wrong]
    if wrong:
        lines.append(f"results: {wrong[0].wrong:g} wrong values at {wrong[0].size} bytes")
    lines += missing_hcas(log, expect)
    return lines


def missing_hcas(log: NcclLog, expect: Expectations) -> list[str]:
    """Each host whose NET/IB device list lacks one of the expected HCAs."""
    if not expect.hcas:
        return []
    listed = {host: devs for host, devs in log.ib_devices.items() if devs}
    if not listed:
        return [
            f"HCA: no NET/IB device list in the log (`NET/IB : No device found`?); expected"
            f" {','.join(expect.hcas)}"
        ]
    lines = []
    for host, devices in sorted(listed.items()):
        missing = [h for h in expect.hcas if h not in devices.values()]
        if missing:
            lines.append(
                f"HCA: {host or '?'} lists {','.join(devices[i] for i in sorted(devices))}, not"
                f" {','.join(missing)}; expected all of {','.join(expect.hcas)}"
            )
    return lines
