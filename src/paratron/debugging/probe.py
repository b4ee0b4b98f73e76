"""Measure what the job's devices and links deliver: collectives and point-to-point transfers per
message size and group size, and a dense matmul.

Bandwidths follow nccl-tests' convention (its PERFORMANCE.md), so numbers compare with theirs:
algorithm bandwidth = bytes / time, and bus bandwidth = algorithm bandwidth x a factor that makes
the figure comparable with the hardware's link speed whatever the group size: 2(n-1)/n for
all-reduce, (n-1)/n for all-gather and reduce-scatter (bytes: the whole gathered or scattered
buffer) and all-to-all, 1 for send/recv. A measurement's time is the slowest rank's mean over the
timed iterations (after untimed warm-up ones), as every rank of a collective waits for the last.

Groups are consecutive ranks (as tensor-parallel groups are laid out): for a group size n every
block of n ranks runs the operation at once, so links shared by the groups are measured shared.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from paratron.distributed.init import collective_device, synchronize

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
"""The operations probed, by nccl-tests' names (send_recv: each rank sends to the next of its group
and receives from the one before, all at once)."""
SMALLEST_BYTES = 1024
"""The smallest message probed (where latency rules)."""
SIZE_STEP = 4
"""Each message probed is this many times the one before, up to the largest."""
ELEMENT = torch.float32
"""The element type of the messages (nccl-tests' default)."""


def bus_factor(op: str, group_size: int) -> float:
    """nccl-tests' bus bandwidth factor of `op` on `group_size` ranks."""
    n = group_size
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "send_recv":
        return 1.0
    raise ValueError(f"unknown operation {op!r}; one of {', '.join(OPS)}")


def message_sizes(max_bytes: int, smallest: int = SMALLEST_BYTES, step: int = SIZE_STEP) -> list[int]:
    """Message sizes from `smallest` (or `max_bytes`, if smaller) to `max_bytes`, each `step` times
    the one before, `max_bytes` always last."""
    size, sizes = min(smallest, max_bytes), []
    while size < max_bytes:
        sizes.append(size)
        size *= step
    return [*sizes, max_bytes]


def group_sizes(world_size: int) -> list[int]:
    """Group sizes probed: 2, 4, 8, ... below the world, and the world itself."""
    sizes, size = [], 2
    while size < world_size:
        sizes.append(size)
        size *= 2
    return [*sizes, world_size] if world_size >= 2 else []


@dataclass(frozen=True)
class Measurement:
    """One operation at one message size and group size (the JSON's `collectives` entries)."""

    op: str
    group_size: int
    spans_nodes: bool
    bytes: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float

    @staticmethod
    def of(op: str, group_size: int, spans_nodes: bool, size: int, seconds: float) -> Measurement:
        algbw = size / seconds / 1e9 if seconds > 0 else 0.0
        busbw = algbw * bus_factor(op, group_size)
        return Measurement(op, group_size, spans_nodes, size, seconds * 1e6, algbw, busbw)

    def as_dict(self) -> dict:
        return asdict(self)


def elements(size: int, group_size: int) -> int:
    """Elements of a `size`-byte message, a multiple of the group size (each rank's equal share)."""
    count = size // ELEMENT.itemsize // group_size * group_size
    return max(count, group_size)


def operation(
    op: str, count: int, members: list[int], group: dist.ProcessGroup | None, device: torch.device
) -> Callable:
    """One call of `op` on a message of `count` elements in `group` (this rank's `members`)."""
    n, me = len(members), members.index(dist.get_rank())
    whole = torch.ones(count, dtype=ELEMENT, device=device)
    part = torch.ones(count // n, dtype=ELEMENT, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(whole, group=group)
    if op == "all_gather":
        return lambda: dist.all_gather_single(whole, part, group=group)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(part, whole, group=group)
    if op == "all_to_all":
        received = torch.empty_like(whole)
        return lambda: dist.all_to_all_single(received, whole, group=group)
    if op == "send_recv":
        received = torch.empty_like(whole)
        after, before = members[(me + 1) % n], members[(me - 1) % n]

        def exchange() -> None:
            transfers = [dist.P2POp(dist.isend, whole, after, group), dist.P2POp(dist.irecv, received, before, group)]
            for request in dist.batch_isend_irecv(transfers):
                request.wait()

        return exchange
    raise ValueError(f"unknown operation {op!r}; one of {', '.join(OPS)}")


def timed_mean(call: Callable, device: torch.device, warmup: int, iters: int) -> float:
    """Seconds per call of `call`, the mean of `iters` after `warmup` untimed ones; the world starts
    together (a barrier), so that groups running side by side share the links as they would."""
    for _ in range(warmup):
        call()
    synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    synchronize(device)
    return (time.perf_counter() - start) / iters


def probe_collectives(
    node_of_rank: list[int],
    device: torch.device,
    max_bytes: int,
    iters: int,
    ops: tuple[str, ...] = OPS,
    sizes: list[int] | None = None,
) -> list[Measurement]:
    """Every operation of `ops` at every message size up to `max_bytes` (`message_sizes`, or just
    `sizes`) and every group size (`group_sizes`) on the job's ranks, `iters` timed iterations each.
    `node_of_rank`: the node each rank runs on (whether a group spans nodes). Every rank calls it;
    every rank gets the results."""
    world, rank = dist.get_world_size(), dist.get_rank()
    warmup = max(2, iters // 4)
    plan: list[tuple[str, int, bool, int]] = []
    mine: list[float] = []
    for size_of_group in group_sizes(world):
        blocks = [
            list(range(start, start + size_of_group)) for start in range(0, world - size_of_group + 1, size_of_group)
        ]
        groups = [None if len(b) == world else dist.new_group(b) for b in blocks]  # (every rank makes every group)
        spans = any(len({node_of_rank[r] for r in block}) > 1 for block in blocks)
        members = next((b for b in blocks if rank in b), None)
        group = groups[blocks.index(members)] if members is not None else None
        for op in ops:
            for size in sizes or message_sizes(max_bytes):
                count = elements(size, size_of_group)
                plan.append((op, size_of_group, spans, count * ELEMENT.itemsize))
                if members is None:  # (a rank left over when the world does not split evenly: it waits)
                    dist.barrier()
                    mine.append(0.0)
                    continue
                call = operation(op, count, members, group, device)
                mine.append(timed_mean(call, device, warmup, iters))
        for made in groups:
            if made is not None:
                dist.destroy_process_group(made)
    slowest = torch.tensor(mine, dtype=torch.float64, device=collective_device())
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return [Measurement.of(op, n, spans, size, s) for (op, n, spans, size), s in zip(plan, slowest.tolist())]


def compute_dtype(device: torch.device) -> torch.dtype:
    """The precision whose matmul speed matters on the device: bf16 on GPUs (tensor cores, what
    mixed-precision training multiplies in), fp32 on the CPU (paratron's CPU default)."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def matmul_size(device: torch.device) -> int:
    """Square matmul side for the compute probe: large enough to reach the device's steady rate,
    small enough to take well under a second (2 x 1024^3 FLOP on a CPU, 2 x 8192^3 on a GPU)."""
    return 1024 if device.type == "cpu" else 8192


def probe_matmul(device: torch.device, iters: int, size: int | None = None, dtype: torch.dtype | None = None) -> float:
    """Dense matmul TFLOP/s of this process: the mean of `iters` timed products of two square
    `size` matrices in `dtype` (defaults: `matmul_size`, `compute_dtype`) after two warm-up ones."""
    size = size or matmul_size(device)
    dtype = dtype or compute_dtype(device)
    generator = torch.Generator(device=device).manual_seed(0)  # (the global RNG stays untouched)
    a = torch.randn(size, size, device=device, generator=generator).to(dtype)
    b = torch.randn(size, size, device=device, generator=generator).to(dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    for _ in range(2):
        torch.matmul(a, b, out=out)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        torch.matmul(a, b, out=out)
    synchronize(device)
    seconds = (time.perf_counter() - start) / iters
    return 2.0 * size**3 / seconds / 1e12
