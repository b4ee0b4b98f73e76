"""`paratron doctor`'s all-reduce probe against the timing loop a user would otherwise write.

    python bench/collectives.py --output bench/results/collectives.json     # 2 gloo ranks, 1 KiB .. 4 MiB
    python bench/collectives.py --smoke                                      # one round, up to 64 KiB

Both sides all-reduce the same fp32 buffers on 2 gloo ranks, at every message size the doctor
probes (1 KiB, x4, up to --max-bytes), with the same warm-up and timed iterations:

- the probe (`paratron.debugging.probe.probe_collectives`): the ranks start together (a barrier),
  the time is the slowest rank's mean, and the bus bandwidth is nccl-tests' (x 2(n-1)/n);
- the plain loop: warm up, barrier, time `iters` calls of `dist.all_reduce` on rank 0 and divide
  (the loop of a tutorial or a forum answer), with the same bus-bandwidth factor applied.

Rounds alternate which side runs first; each side's figure per size is its median over the
rounds. The ratio probe / plain of bus bandwidth near 1 says the probe's bookkeeping (barrier,
slowest rank, per-size process groups) costs nothing measurable; below 1 the slowest rank's time
is longer than rank 0's own, which the plain loop hides. On GPUs nccl-tests' `all_reduce_perf` is
the reference for the convention (the same factor), not run here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common import RESULTS, add_smoke_argument, apply_smoke, spawn
from paratron.debugging.probe import bus_factor, message_sizes, probe_collectives
from paratron.distributed.init import initialize, shutdown
from paratron.distributed.local_ranks import torchrun_environment
from paratron.storage import write_text_atomic

WORLD = 2
ONE = ("all_reduce",)
"""The operation compared."""


def plain_loop(size: int, warmup: int, iters: int) -> float:
    """Seconds per all-reduce of `size` bytes as rank 0's own loop times it."""
    x = torch.ones(size // 4, dtype=torch.float32)
    for _ in range(warmup):
        dist.all_reduce(x)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    return (time.perf_counter() - start) / iters


def _worker(rank: int, world: int, port: int, args: dict, out: str) -> None:
    torchrun_environment(rank, world, port)
    context = initialize("gloo")
    sizes = message_sizes(args["max_bytes"])
    warmup = max(2, args["iters"] // 4)  # (the probe's own warm-up)
    factor = bus_factor("all_reduce", world)
    rounds: dict[str, list[list[float]]] = {"probe": [], "plain": []}  # (bus bandwidth per size, per round)
    for round_index in range(args["rounds"]):
        probe, plain = [], []
        for size_index, size in enumerate(sizes):  # (both sides back to back, the first one alternating)
            for side in ("probe", "plain") if (round_index + size_index) % 2 == 0 else ("plain", "probe"):
                if side == "probe":
                    (measured,) = probe_collectives([0] * world, context.device, size, args["iters"], ONE, [size])
                    probe.append(measured.busbw_gbps)
                else:
                    plain.append(size / plain_loop(size, warmup, args["iters"]) / 1e9 * factor)
        rounds["probe"].append(probe)
        rounds["plain"].append(plain)
    if rank == 0:
        Path(out).write_text(json.dumps({"sizes": sizes, "rounds": rounds, "threads": torch.get_num_threads()}))
    shutdown()


def summarize(raw: dict[str, Any]) -> list[dict[str, float]]:
    """Per message size: each side's median bus bandwidth over the rounds, and their ratio."""
    rows = []
    for index, size in enumerate(raw["sizes"]):
        probe = statistics.median(bandwidths[index] for bandwidths in raw["rounds"]["probe"])
        plain = statistics.median(bandwidths[index] for bandwidths in raw["rounds"]["plain"])
        rows.append({"bytes": size, "probe_busbw_gbps": probe, "plain_busbw_gbps": plain, "ratio": probe / plain})
    return rows


def check(rows: list[dict[str, float]], sizes: list[int]) -> None:
    """Every size measured by both sides, with a positive bandwidth."""
    if [row["bytes"] for row in rows] != sizes:
        raise AssertionError(f"sizes measured {[row['bytes'] for row in rows]}, expected {sizes}")
    for row in rows:
        if not (row["probe_busbw_gbps"] > 0 and row["plain_busbw_gbps"] > 0):
            raise AssertionError(f"a bandwidth that is not positive: {row}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-bytes", type=int, default=4 << 20, help="Largest message (default: 4 MiB).")
    parser.add_argument("--iters", type=int, default=20, help="Timed iterations per size and side.")
    parser.add_argument("--rounds", type=int, default=5, help="Alternating rounds; medians are reported.")
    parser.add_argument("--output", type=Path, default=RESULTS / "collectives.json")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    apply_smoke(args, parser, max_bytes=65536, iters=3, rounds=1)
    sizes = {"max_bytes": args.max_bytes, "iters": args.iters, "rounds": args.rounds}
    raw = spawn(_worker, WORLD, sizes, forked=args.smoke)
    rows = summarize(raw)
    check(rows, raw["sizes"])
    print(
        f"all-reduce bus bandwidth, {WORLD} gloo ranks, torch threads per rank {raw['threads']}, fp32, median of "
        f"{args.rounds} rounds"
    )
    print(f"{'bytes':>10} {'probe GB/s':>11} {'plain GB/s':>11} {'ratio':>7}")
    for row in rows:
        print(
            f"{row['bytes']:>10} {row['probe_busbw_gbps']:>11.3f} {row['plain_busbw_gbps']:>11.3f} {row['ratio']:>7.2f}"
        )
    load = os.getloadavg()[0]  # (the machine is shared: how busy it was)
    print(f"load average over the last minute: {load:.1f} on {os.cpu_count()} cores")
    result = {"world": WORLD, "iters": args.iters, "rounds": args.rounds, "load": load, "rows": rows, "raw": raw}
    write_text_atomic(args.output, json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
