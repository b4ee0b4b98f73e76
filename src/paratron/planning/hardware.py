"""The machine a plan is made for: device memory, compute peak, and the two network levels with
their alpha-beta model (a message costs a latency plus its bytes over the bandwidth).

A `Hardware` is a handful of numbers the cost model (`planning.cost`) reads: dense bf16 peak and
the share of it that a Transformer's matrix multiplies reach (`matmul_efficiency`), memory
bandwidth (optimizer step), and an alpha-beta model of each network level (latency plus bytes
over bandwidth) inside a node (NVLink) and between nodes (InfiniBand / RoCE). Bandwidths are
GB/s = 10^9 bytes per second per device in one direction, as spec sheets give them.

Presets hold spec-sheet numbers; the one calibrated constant per GPU generation is
`matmul_efficiency`, the share of the dense peak the model's work runs at (matmuls with their
elementwise neighbours, attention kernels), fitted once against one published run and rounded
(`planning.published`; bench/plan_published.py reports the error on the other runs):

- H100 / H200 (Hopper): 0.53, fitted to Llama 3 405B on 8,192 H100s (Dubey et al. 2024, Table 4:
  TP8 PP16 DP64, 43% MFU): 0.529.
- B200 (`gb200`): no published run to fit yet; Hopper's 0.53 stands in.
- A100: 0.55, fitted to the 145.6B GPT on 1,536 A100s (Narayanan et al. 2021, Table 1: TP8 PP8,
  148 TFLOP/s per GPU counting recomputation, 47% of peak): 0.554.

`cpu` is measured on the spot: a matmul probe with the threads one of `gpus_per_node` local
processes gets, the machine's memory shared by them, and a memory-copy probe for the gloo
transport (see `measure_cpu`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import torch

from paratron.config.schema import PlanningConfig
from paratron.errors import ConfigError
from paratron.training.flops import probe_peak_flops


@dataclass(frozen=True)
class Hardware:
    """One cluster: `nodes` machines of `gpus_per_node` identical devices."""

    name: str
    gpus_per_node: int
    nodes: int
    device_memory_gb: float
    """Memory of one device, GB (10^9 bytes)."""
    peak_tflops: float
    """Dense 16-bit matmul peak of one device (fp32 on CPU), TFLOP/s."""
    matmul_efficiency: float
    """Share of the peak the model's work reaches (calibrated per GPU generation, see the module docstring)."""
    intra_node_gbps: float
    """Per-device bandwidth inside a node (one direction), GB/s."""
    inter_node_gbps: float
    """Per-device bandwidth between nodes (its network card, one direction), GB/s."""
    intra_node_latency_us: float
    """Start-up time of one message step inside a node, microseconds."""
    inter_node_latency_us: float
    """Start-up time of one message step between nodes, microseconds."""
    memory_gbps: float = 2000.0
    """Device memory bandwidth, GB/s (the optimizer step and other memory-bound work)."""
    processes_per_core: float = 1.0
    """More processes than cores (the CPU with --nproc above its core count): each computes at its
    share of a core, but a rank that waits in the pipeline's bubble lends its core to the others."""
    overlaps_communication: bool = True
    """Collectives run beside compute (GPUs: NCCL on its own streams). On the CPU the same cores do
    both, so the overlaps the implementation arranges hide nothing (measured: BENCHMARKS.md)."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def device_memory_bytes(self) -> float:
        return self.device_memory_gb * 1e9

    @property
    def flops(self) -> float:
        """FLOP/s the model's work runs at on one device."""
        return self.peak_tflops * 1e12 * self.matmul_efficiency


_HOPPER = dict(
    gpus_per_node=8,
    nodes=1,
    peak_tflops=989.0,  # H100 SXM dense BF16
    matmul_efficiency=0.53,  # calibrated: Llama 3 405B, 8,192 H100s (module docstring)
    intra_node_gbps=450.0,  # NVLink 4: 900 GB/s bidirectional
    inter_node_gbps=50.0,  # 400 Gb/s InfiniBand NDR (or RoCE) per GPU
    intra_node_latency_us=3.0,
    inter_node_latency_us=8.0,
)

PRESETS: dict[str, Hardware] = {
    "h100-80g": Hardware("h100-80g", device_memory_gb=80.0, memory_gbps=3350.0, **_HOPPER),  # type: ignore[arg-type]
    # H200 SXM (NVIDIA H200 datasheet): 141 GB HBM3e at 4.8 TB/s, 989 TFLOP/s dense BF16, NVLink 900 GB/s
    "h200-141g": Hardware("h200-141g", device_memory_gb=141.0, memory_gbps=4800.0, **_HOPPER),  # type: ignore[arg-type]
    # B200 in a GB200 NVL72 rack (NVIDIA GB200 NVL72 specifications, per GPU = rack / 72): 13.4 TB HBM3e -> 186 GB,
    # 576 TB/s -> 8 TB/s, 360 PFLOP/s BF16 with sparsity -> 2.5 PFLOP/s dense; NVLink 5 at 1.8 TB/s (both
    # directions) joins all 72 GPUs in one NVLink domain, which the planner takes as one "node".
    "gb200": Hardware(
        "gb200",
        gpus_per_node=72,
        nodes=1,
        device_memory_gb=186.0,
        peak_tflops=2500.0,
        matmul_efficiency=0.53,  # (not calibrated on Blackwell: Hopper's share, module docstring)
        intra_node_gbps=900.0,  # NVLink 5: 1.8 TB/s bidirectional
        inter_node_gbps=50.0,  # 400 Gb/s ConnectX-7 InfiniBand per GPU (a ConnectX-8 800 Gb/s network: 100)
        intra_node_latency_us=3.0,
        inter_node_latency_us=8.0,
        memory_gbps=8000.0,
    ),
    "a100-80g": Hardware(
        "a100-80g",
        gpus_per_node=8,
        nodes=1,
        device_memory_gb=80.0,
        peak_tflops=312.0,  # A100 dense BF16
        matmul_efficiency=0.55,  # calibrated: 145.6B GPT, 1,536 A100s (module docstring)
        intra_node_gbps=300.0,  # NVLink 3: 600 GB/s bidirectional
        inter_node_gbps=25.0,  # 200 Gb/s HDR InfiniBand per GPU
        intra_node_latency_us=4.0,
        inter_node_latency_us=10.0,
        memory_gbps=2039.0,
    ),
}
"""Spec-sheet clusters (one node; `hardware_from` sets the node count)."""

CPU = "cpu"

GLOO_COPIES = 4
"""gloo over loopback moves each byte through a TCP socket: copied into the kernel, out of it, and
read again by the reduction; about four memory copies' worth of the machine's copy bandwidth."""

GLOO_LATENCY_US = 550.0
"""One gloo message step over loopback while the cores are computing (the other rank's compute, the
TCP round trip and gloo's bookkeeping), with no more processes than cores: calibrated by
bench/plan_cpu.py --calibrate (a collective timed between layer-shaped matmuls: 550 us at 2
processes, 1,015 us at 4 on 2 cores; alone on idle cores it is tens of microseconds). With more
processes than cores it grows in proportion."""


def preset_names() -> list[str]:
    return [*PRESETS, CPU]


def measure_cpu(gpus_per_node: int, nodes: int = 1) -> Hardware:
    """This machine as `gpus_per_node` CPU processes: each gets torch.get_num_threads() //
    gpus_per_node threads for its matmuls (and, with more processes than threads, its share of a
    core) and an equal share of the memory; gloo's bandwidth is the copy bandwidth over
    GLOO_COPIES. Takes well under two seconds."""
    procs = max(1, gpus_per_node)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (one core's rate, scaled: a job on another core cannot skew it)
    try:
        one_core = probe_peak_flops(torch.device("cpu"), size=512, repeats=10)
    finally:
        torch.set_num_threads(threads)
    peak = one_core * max(1, threads // procs) * min(1.0, threads / procs)
    crowding = max(1.0, procs / threads)
    return Hardware(
        name=CPU,
        gpus_per_node=procs,
        nodes=nodes,
        device_memory_gb=_machine_memory_bytes() / procs / 1e9,
        peak_tflops=peak / 1e12,
        # a layer's matmuls and elementwise work against the probe's best (bench/pipeline_bubble.py)
        matmul_efficiency=0.7,
        intra_node_gbps=_copy_bandwidth() / GLOO_COPIES / 1e9,
        inter_node_gbps=1.25,  # 10 Gb/s Ethernet between machines
        intra_node_latency_us=GLOO_LATENCY_US * crowding,
        inter_node_latency_us=GLOO_LATENCY_US * crowding * 2,
        memory_gbps=_copy_bandwidth() / 1e9,
        processes_per_core=crowding,
        overlaps_communication=False,
    )


def _machine_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16e9  # (no sysconf: not Linux or macOS) a small laptop's memory


_COPY_BANDWIDTH: list[float] = []


def _copy_bandwidth() -> float:
    """Bytes per second of a 32 MB tensor copy (read + write counted once), best of three; cached."""
    if not _COPY_BANDWIDTH:
        source = torch.empty(8 * 2**20, dtype=torch.float32)
        target = torch.empty_like(source)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            target.copy_(source)
            best = min(best, time.perf_counter() - start)
        _COPY_BANDWIDTH.append(source.numel() * source.element_size() / max(best, 1e-6))
    return _COPY_BANDWIDTH[0]


def hardware_from(planning: PlanningConfig, **overrides: float | int | str | None) -> Hardware:
    """The hardware of `--hardware` (default h100-80g), with `--device-memory-gb` and any explicit
    overrides (Hardware field -> value; None means not given) applied. An unknown preset is a
    ConfigError naming the presets."""
    name = planning.hardware or "h100-80g"
    given = {k: v for k, v in overrides.items() if v is not None}
    unknown = set(given) - {f.name for f in dataclasses.fields(Hardware)}
    if unknown:
        raise ValueError(f"not Hardware fields: {', '.join(sorted(unknown))}")
    if name == CPU:
        base = measure_cpu(int(given.get("gpus_per_node") or os.cpu_count() or 1), int(given.get("nodes", 1)))
    elif name in PRESETS:
        base = PRESETS[name]
    else:
        raise ConfigError(f"--hardware {name}: unknown preset; choose one of {', '.join(preset_names())}")
    if planning.device_memory_gb is not None:
        given.setdefault("device_memory_gb", planning.device_memory_gb)
    hardware = dataclasses.replace(base, **given)
    _check(hardware)
    return hardware


def _check(hardware: Hardware) -> None:
    for field in dataclasses.fields(Hardware):
        value = getattr(hardware, field.name)
        if (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and value <= 0
            and "latency" not in field.name
        ):
            raise ConfigError(f"--{field.name.replace('_', '-')} {value}: must be positive")
    if hardware.matmul_efficiency > 1:
        raise ConfigError(f"--matmul-efficiency {hardware.matmul_efficiency}: must be at most 1")


def preset(name: str, gpus_per_node: int | None = None) -> Hardware:
    """A preset by name (`cpu`: measured now, for gpus_per_node processes, default one per core)."""
    if name == CPU:
        return measure_cpu(gpus_per_node or os.cpu_count() or 1)
    if name not in PRESETS:
        raise ConfigError(f"--hardware {name}: unknown preset; choose one of {', '.join(preset_names())}")
    return PRESETS[name] if gpus_per_node is None else dataclasses.replace(PRESETS[name], gpus_per_node=gpus_per_node)


# ---------------------------------------------------------------- the network's alpha-beta model


@dataclass(frozen=True)
class Link:
    """One network level: per-device bandwidth (bytes/s) and per-message latency (s)."""

    bandwidth: float
    latency: float


def link(hardware: Hardware, stride: int, size: int) -> Link:
    """The level a group of `size` ranks `stride` apart in the rank grid runs on: inside a node
    when the group fits in one, else between nodes (each device's network card is the limit)."""
    if size <= 1 or stride * size <= hardware.gpus_per_node:
        return Link(hardware.intra_node_gbps * 1e9, hardware.intra_node_latency_us * 1e-6)
    return Link(hardware.inter_node_gbps * 1e9, hardware.inter_node_latency_us * 1e-6)


def ring_terms(op: str, nbytes: float, n: int) -> tuple[int, float]:
    """(message steps, bytes per step) of a collective over n ranks in the ring terms the cost model prices:
    all_reduce 2(n-1) steps of nbytes/n; all_gather, reduce_scatter (nbytes in all) and all_to_all (nbytes
    per rank, n-1 of n parts leave) n-1 steps of nbytes/n; send_recv one step of nbytes. The calibration
    fits measured times in the same terms (`planning.calibration`)."""
    if op == "send_recv":
        return 1, nbytes
    if op == "all_reduce":
        return 2 * (n - 1), nbytes / n
    return n - 1, nbytes / n


def _ring_time(op: str, nbytes: float, n: int, over: Link) -> float:
    if n <= 1:
        return 0.0
    steps, chunk = ring_terms(op, nbytes, n)
    return steps * (chunk / over.bandwidth + over.latency)


def all_reduce_time(nbytes: float, n: int, over: Link) -> float:
    """Ring all-reduce of `nbytes` over n ranks."""
    return _ring_time("all_reduce", nbytes, n, over)


def all_gather_time(nbytes: float, n: int, over: Link) -> float:
    """Ring all-gather (or reduce-scatter) of a tensor of `nbytes` in all."""
    return _ring_time("all_gather", nbytes, n, over)


reduce_scatter_time = all_gather_time


def all_to_all_time(nbytes: float, n: int, over: Link) -> float:
    """All-to-all of `nbytes` per rank spread evenly over n ranks."""
    return _ring_time("all_to_all", nbytes, n, over)


def p2p_time(nbytes: float, over: Link) -> float:
    """One message between two ranks."""
    return over.latency + nbytes / over.bandwidth
