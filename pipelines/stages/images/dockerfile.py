"""Static checks of a Dockerfile: every FROM pinned by digest, and what the image must carry."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pipelines.stages.images.spec import PINNED, ImageError, ImageSpec

ARG_REF = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}?")


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction: its keyword, arguments and first line number."""

    keyword: str
    args: str
    line: int


def instructions(text: str) -> list[Instruction]:
    """The instructions of a Dockerfile, continuation lines joined, comments dropped."""
    result: list[Instruction] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        if full and not full.startswith("#"):
            keyword, _, args = full.partition(" ")
            result.append(Instruction(keyword.upper(), args.strip(), start))
    return result


def substitute(value: str, args: dict[str, str]) -> str:
    """Expand $NAME, ${NAME} and ${NAME:-default} from build args."""
    return ARG_REF.sub(lambda m: args.get(m.group(1)) or (m.group(2) or ""), value)


def check_froms(path: Path, text: str, build_args: dict[str, str]) -> list[str]:
    """The resolved image of every FROM; refuses any that is not pinned by digest."""
    args: dict[str, str] = {}
    stages: set[str] = set()
    images: list[str] = []
    for ins in instructions(text):
        if ins.keyword == "ARG" and not stages and not images:
            name, _, default = ins.args.partition("=")
            args[name] = build_args.get(name, default.strip('"'))
        if ins.keyword != "FROM":
            continue
        words = [w for w in ins.args.split() if not w.startswith("--")]
        image = substitute(words[0], {**args, **build_args})
        if len(words) >= 3 and words[1].lower() == "as":
            stages.add(words[2].lower())
        if image == "scratch" or image.lower() in stages:
            continue
        if not PINNED.match(image):
            raise ImageError(
                f"{path}:{ins.line}: FROM {words[0]} resolves to {image!r}: expected an image"
                " pinned by digest (name@sha256:<64 hex>)"
            )
        images.append(image)
    if not images and "scratch" not in text:
        raise ImageError(f"{path}: no FROM instruction")
    return images


def check_contents(path: Path, text: str, spec: ImageSpec) -> None:
    """The Dockerfile sets what the image's checks require (arch list, jobs, receipt, NCCL)."""
    checks = spec.checks
    wanted = []
    if checks.cuda_arch_list:
        wanted.append(f"TORCH_CUDA_ARCH_LIST={checks.cuda_arch_list}")
    if checks.max_jobs is not None:
        wanted.append(f"MAX_JOBS={checks.max_jobs}")
    wanted.append(checks.receipt)
    if checks.nccl == "sparkring-overlay":
        wanted.append("SWITCHLESS_RING_ONLY")
    for name in spec.upstream:
        wanted.append(f"ARG {upstream_arg(name)}")
    flat = " ".join(f"{i.keyword} {i.args}" for i in instructions(text))
    for needle in wanted:
        # Whole words only: MAX_JOBS=1 must not be satisfied by MAX_JOBS=16.
        if not re.search(rf"(?<![\w/.-]){re.escape(needle)}(?![\w.-])", flat):
            raise ImageError(f"{path}: expected the Dockerfile to contain {needle!r}")
    if checks.nccl == "sparkring-overlay" and re.search(r"LD_LIBRARY_PATH=[^ ]*nccl", flat):
        raise ImageError(
            f"{path}: LD_LIBRARY_PATH names an NCCL folder: two NCCL runtimes would be visible"
        )


def upstream_arg(name: str) -> str:
    """The build arg carrying an upstream's pinned commit (e.g. cuda-exl3 -> CUDA_EXL3_COMMIT)."""
    return re.sub(r"[^A-Za-z0-9]", "_", name).upper() + "_COMMIT"
