"""All-reduce probe: one process per member, as the runtime starts its workers; prints NCCL's view.

Runs inside the runtime image (torch + its own NCCL), shipped as source (a ConfigMap or a file
copied into the container), so it imports nothing from this repository. Rank and rendezvous come
from the environment the way torchrun and the fabric Jobs set them: RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, LOCAL_RANK. Rank 0 prints one `allreduce` line per size; the busbw
formula is applied by the parser (pipelines/stages/fabric/nccllog.py), once.
"""

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def size_bytes(text: str) -> int:
    """`8M` -> 8388608, as nccl-tests reads -b/-e."""
    text = text.strip().upper()
    suffix = text[-1] if text[-1] in UNITS else ""
    return int(text[: len(text) - len(suffix)]) * UNITS[suffix]


def sizes(low: int, high: int, factor: int) -> list[int]:
    """The sweep's sizes, low..high multiplying by factor."""
    out = [low]
    while out[-1] * factor <= high:
        out.append(out[-1] * factor)
    return out


def main() -> int:
    """Sweep all-reduce sizes and print one line per size on rank 0."""
    parser = argparse.ArgumentParser()
    parser.add_argument("-b", "--min-bytes", default="8M")
    parser.add_argument("-e", "--max-bytes", default="1G")
    parser.add_argument("-f", "--factor", type=int, default=2)
    parser.add_argument("-w", "--warmup", type=int, default=5)
    parser.add_argument("-n", "--iters", type=int, default=20)
    parser.add_argument("--timeout-s", type=int, default=600)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", device_id=device, timeout=datetime.timedelta(seconds=args.timeout_s)
    )
    if rank == 0:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        print(
            f"# probe: torch {torch.__version__} nccl {nccl}"
            f" ranks {world} warmup {args.warmup} iters {args.iters}",
            flush=True,
        )
    expected = world * (world + 1) / 2
    for nbytes in sizes(size_bytes(args.min_bytes), size_bytes(args.max_bytes), args.factor):
        data = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
        for _ in range(args.warmup):
            dist.all_reduce(data)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            dist.all_reduce(data)
        end.record()
        torch.cuda.synchronize()
        # The slowest rank's time, as a ring is as fast as its slowest member.
        elapsed = torch.tensor([start.elapsed_time(end) / 1e3 / args.iters], device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        # Correctness once per size: every rank contributes rank+1.
        data.fill_(rank + 1)
        dist.all_reduce(data)
        wrong = int((data != expected).sum().item())
        seconds = float(elapsed.item())
        if rank == 0:
            print(
                f"allreduce bytes={nbytes} count={data.numel()} type=float32 ranks={world}"
                f" time_us={seconds * 1e6:.1f} algbw_gbs={nbytes / seconds / 1e9:.3f}"
                f" wrong={wrong}",
                flush=True,
            )
        del data
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
