"""Process-group start-up, device choice and seeding: the one place that knows about accelerators.

Backend and device come from the machine: the accelerator torch reports (`torch.accelerator`: CUDA or
ROCm, Intel XPU, Apple MPS) with the backend torch.distributed pairs with it (NCCL/RCCL, XCCL; gloo for
MPS), gloo and the CPU otherwise. Everything else allocates on the device of a tensor it holds.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

from paratron.config.fields import flag
from paratron.config.layout import resolve_layout
from paratron.config.megatron import RENAMES
from paratron.config.schema import Config
from paratron.config.validation import validate
from paratron.errors import ConfigError, PeerFailure

HANG_REPORT_MARGIN_S = 60
"""Seconds the process group waits beyond --distributed-timeout-minutes (the watchdog's)."""


@dataclass(frozen=True)
class DistributedContext:
    """Where this process sits in the job and which device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def accelerator_type() -> str:
    """The kind of accelerator this process computes on ("cuda" also for ROCm builds, "xpu", "mps", ...),
    or "cpu" where torch reports none."""
    if torch.accelerator.is_available():
        current = torch.accelerator.current_accelerator()
        if current is not None:
            return current.type
    return "cpu"


def default_backend(device_type: str) -> str:
    """The collective backend torch.distributed pairs with a device type: nccl for cuda (RCCL on ROCm
    answers to the same name), xccl for xpu, gloo for the CPU and MPS (which has no collective library)."""
    try:
        return dist.get_default_backend_for_device(device_type)
    except (RuntimeError, ValueError, KeyError):
        return "gloo"


def choose_backend(requested: str = "auto") -> tuple[str, torch.device]:
    """The backend and device of this process: --distributed-backend when given (gloo computes on the CPU),
    else the machine's accelerator (`LOCAL_RANK` picks which of its devices) with its backend."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    kind = accelerator_type()
    if requested == "gloo" or (requested == "auto" and kind == "cpu"):
        return "gloo", torch.device("cpu")
    if requested != "auto" and default_backend(kind) != requested:
        wanted = {"nccl": "CUDA (or ROCm)", "xccl": "an Intel XPU"}.get(requested, "an accelerator")
        raise ConfigError(
            f"{flag.distributed_backend} {requested} needs {wanted}, which this machine lacks "
            f"(its device: {kind}); use gloo or auto"
        )
    if kind == "mps" and env_world_size() > 1:
        raise ConfigError(
            f"{env_world_size()} processes on Apple MPS: it has one device and no collective library; run one "
            f"process ({flag.nproc_per_node} 1), or {flag.distributed_backend} gloo to run them on the CPU"
        )
    torch.accelerator.set_device_index(local_rank)
    return default_backend(kind), torch.device(kind, local_rank)


FP8_COMPUTE_CAPABILITY = (8, 9)
"""The first CUDA compute capability with fp8 tensor-core matmuls (Ada; Hopper is 9.0, Blackwell 10.0)."""


def computing_device_type(backend: str = "auto") -> str:
    """The kind of device the processes of a --distributed-backend compute on (gloo: the CPU), asked of the
    machine without choosing a device (for checks before any process starts)."""
    return "cpu" if backend == "gloo" else accelerator_type()


def has_fp8_matmuls(device_type: str, index: int = 0) -> bool:
    """Whether a device has fp8 matmuls (torch._scaled_mm): CUDA devices of compute capability 8.9 and
    newer; not the CPU, MPS or XPU."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return False
    return tuple(torch.cuda.get_device_capability(index)) >= FP8_COMPUTE_CAPABILITY


PREFERRED_ATTENTION_KERNELS = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]
"""SDPA's kernels fastest first on Hopper and newer (compute capability 9.0): cuDNN's fused attention, then flash."""


def attention_kernel_priority(device: torch.device) -> contextlib.AbstractContextManager:
    """For the duration of a run: on Hopper and newer GPUs, SDPA tries cuDNN, then flash, before torch's own
    default order (each still only where it supports the inputs); elsewhere torch's choice stands."""
    if device.type != "cuda" or tuple(torch.cuda.get_device_capability(device)) < (9, 0):
        return contextlib.nullcontext()
    return sdpa_kernel(PREFERRED_ATTENTION_KERNELS, set_priority=True)


def listed_devices(visible: str) -> int:
    """How many devices a CUDA_VISIBLE_DEVICES value lets a process see, as CUDA reads it: indices or
    GPU-/MIG- UUIDs, comma-separated, up to the first entry that names none ("" and "-1" hide them all)."""
    seen: set[str] = set()
    for entry in (e.strip() for e in visible.split(",")):
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))) or entry in seen:
            break
        seen.add(entry)
    return len(seen)


def visible_devices(backend: str = "auto") -> int | None:
    """The GPUs this machine's processes may take, one each, for the --distributed-backend: the CUDA
    devices visible here (CUDA_VISIBLE_DEVICES honoured); None when the processes run on the CPU
    (gloo, or auto without a GPU), which takes any number of them."""
    if backend == "gloo":
        return None
    kind = accelerator_type()
    if kind not in ("cpu", "cuda") and backend in ("auto", default_backend(kind)):
        return 1 if kind == "mps" else torch.accelerator.device_count()  # (MPS: one device, one process)
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    most = None if listed is None else listed_devices(listed)
    count = 0 if most == 0 else torch.cuda.device_count()  # (CUDA is not asked when the list hides every device)
    count = count if most is None else min(count, most)
    return None if count == 0 and backend == "auto" else count


def fit_to_devices(config: Config, argv: list[str]) -> tuple[Config, list[str]]:
    """Before any process starts, the processes this node can run: one per GPU. A --nproc above the
    GPUs is a ConfigError naming them and the fix; a count from a recipe (or the default) runs on the
    GPUs there are, the global batch kept through more micro-batches per step, with a one-line note,
    when the rest of the settings stay valid. Returns the settings and the workers' `paratron ARGV`
    (the new count and global batch added to it); on the CPU both unchanged."""
    p = config.parallel
    devices = visible_devices(p.distributed_backend)
    if devices is None or p.nproc_per_node <= devices:
        return config, argv
    if devices == 0:  # (only with nccl asked for: auto runs on the CPU then)
        raise ConfigError(
            f"{flag.distributed_backend} nccl: this machine has no GPU visible (CUDA_VISIBLE_DEVICES honoured); use "
            f"{flag.distributed_backend} gloo or auto to run on the CPU"
        )
    options = {flag.nproc_per_node, *(alias for alias, name in RENAMES.items() if name == "nproc_per_node")}
    given = next((a.split("=", 1)[0] for a in argv if a.split("=", 1)[0] in options), None)
    per_node = " per node" if p.nnodes > 1 else ""
    have = f"this machine has {devices} GPU{'' if devices == 1 else 's'} visible (CUDA_VISIBLE_DEVICES honoured)"
    instead = f"{flag.distributed_backend} gloo to run {p.nproc_per_node} processes{per_node} on the CPU"
    if given is not None:
        raise ConfigError(f"{given} {p.nproc_per_node}: {have}; use {given} {devices}, or {instead}")
    batch = resolve_layout(config, p.nproc_per_node * p.nnodes).global_batch_size
    fitted = replace(
        config,
        parallel=replace(p, nproc_per_node=devices),
        training=replace(config.training, global_batch_size=batch),
    )
    try:
        layout = validate(fitted, devices * p.nnodes)
    except ConfigError as exc:
        raise ConfigError(
            f"the recipe asks for {p.nproc_per_node} processes{per_node} and {have}, on which the run does not fit "
            f"({exc}); choose a layout for {flag.nproc_per_node} {devices}, or use {instead}"
        ) from None
    print(
        f"note: the recipe asks for {p.nproc_per_node} processes{per_node} and {have}: running {devices}, "
        f"{layout.num_micro_batches} micro-batches per step for the same global batch of {batch} "
        f"({flag.distributed_backend} gloo runs {p.nproc_per_node} on the CPU)",
        file=sys.stderr,
    )
    return fitted, [*argv, flag.nproc_per_node, str(devices), flag.global_batch_size, str(batch)]


def cpu_threads(local_world: int) -> int:
    """Intra-op threads for one of `local_world` CPU processes on this machine: OMP_NUM_THREADS where
    the user set it (as torch and torchrun read it), else an even share of the cores, so that the
    processes do not oversubscribe them (two threads each on two busy cores ran a small model's step
    about three times slower than one)."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    return max(1, (os.cpu_count() or 1) // local_world)


def initialize(backend: str = "auto", timeout_minutes: float = 10.0) -> DistributedContext:
    """Join the process group torchrun described in the environment (or run alone)."""
    name, device = choose_backend(backend)
    rank, world = int(os.environ.get("RANK", "0")), env_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(local_world))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(
            name,
            rank=rank,
            world_size=world,
            # later than the watchdog (distributed/watchdog.py), which reports a hang before torch's timeout ends it
            timeout=timedelta(minutes=timeout_minutes, seconds=HANG_REPORT_MARGIN_S),
            device_id=device if device.type != "cpu" and name != "gloo" else None,
        )
    return DistributedContext(rank, world, local_rank, local_world, device, name)


def job_store() -> dist.Store | None:
    """The key-value store the job's processes met in (None alone or before they did)."""
    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def collective_device() -> torch.device:
    """Where small tensors for collectives must live: the current accelerator under its backend (NCCL,
    XCCL), else the CPU."""
    if dist.is_initialized() and dist.get_backend() != "gloo" and torch.accelerator.is_available():
        return torch.device(accelerator_type(), torch.accelerator.current_device_index())
    return torch.device("cpu")


def raise_any_failure(failure: BaseException | None, elsewhere: str) -> None:
    """Every rank learns whether one failed (collective over the world): the one that failed raises
    its own error, the others PeerFailure(`elsewhere`), so that no rank waits for one that is gone."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        failed = torch.tensor([failure is not None], dtype=torch.int32, device=collective_device())
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item() and failure is None:
            raise PeerFailure(elsewhere)
    if failure is not None:
        raise failure


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (for honest timings); nothing to wait for on the CPU."""
    if device.type != "cpu" and torch.accelerator.is_available():
        torch.accelerator.synchronize(device)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (every device) alike."""
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


# Peak dense bf16/fp16 tensor-core throughput (FLOP/s) of known accelerators, for MFU.
_PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "V100": 125e12,
    "B200": 2250e12,
    "GH200": 989e12,
}


def accelerator_peak_flops(device: torch.device) -> float | None:
    """Spec-sheet peak of a known CUDA device (None on CPU or an unknown device)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(_PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in name:
            return _PEAK_BF16_FLOPS[key]
    return None


def accelerator_name(device: torch.device) -> str | None:
    """The CUDA device's name (None on the CPU)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def accelerator_memory_bytes(device: torch.device) -> int | None:
    """Total memory of the CUDA device (None on the CPU)."""
    return int(torch.cuda.get_device_properties(device).total_memory) if device.type == "cuda" else None


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: allocator peak on an accelerator, resident set size on CPU."""
    if device.type != "cpu" and torch.accelerator.is_available():
        return int(torch.accelerator.max_memory_allocated(device))
    try:
        import resource  # (here, as it is not on Windows)
    except ImportError:
        return 0
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def memory_now(device: torch.device) -> dict[str, int]:
    """The device's memory in bytes, Megatron-LM's names: allocated now, the peak allocated and
    reserved by the allocator on an accelerator; on the CPU the process's resident set now and at
    its peak (the CPU allocator reserves nothing of its own)."""
    if device.type != "cpu" and torch.accelerator.is_available():
        return {
            "mem_allocated_bytes": int(torch.accelerator.memory_allocated(device)),
            "mem_max_allocated_bytes": int(torch.accelerator.max_memory_allocated(device)),
            "mem_reserved_bytes": int(torch.accelerator.memory_reserved(device)),
        }
    resident = 0
    try:
        with open("/proc/self/statm") as statm:  # (Linux: pages)
            resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        resident = peak_memory_bytes(device)
    # (the kernel's high-water mark can lag the current size by a few pages)
    return {"mem_allocated_bytes": resident, "mem_max_allocated_bytes": max(resident, peak_memory_bytes(device))}


def release_unused_memory(device: torch.device) -> None:
    """Hand the allocator's cached, unused blocks back to the device (--empty-unused-memory-level);
    nothing to do on the CPU."""
    if device.type != "cpu" and torch.accelerator.is_available():
        torch.accelerator.empty_cache()


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool, device: torch.device) -> Iterator[None]:
    """--deterministic-mode for the duration of a run: deterministic kernels only (an op without one
    raises), and on CUDA the cuBLAS workspace and NCCL algorithm that make them reproducible (each
    unless the user set it). The previous setting comes back afterwards."""
    if not enabled:
        yield
        return
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        os.environ.setdefault("NCCL_ALGO", "Ring")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def accelerator_facts() -> dict[str, Any]:
    """What the CUDA runtime says about this machine, as plain data (for `paratron doctor`): the CUDA,
    cuDNN and NCCL versions torch was built with, each visible GPU (name, memory, compute capability,
    multiprocessors) and which pairs can reach each other's memory directly (peer access, the NVLink or
    PCIe path NCCL's P2P transport takes). Without CUDA: versions None and no GPUs. Asks no device for
    a context, so every process may call it."""
    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    nccl = None
    if available and dist.is_nccl_available():
        built = torch.cuda.nccl.version()
        nccl = ".".join(map(str, built)) if isinstance(built, tuple) else str(built)
    gpus = []
    for index in range(count):
        properties = torch.cuda.get_device_properties(index)
        gpus.append(
            {
                "index": index,
                "name": properties.name,
                "memory_bytes": int(properties.total_memory),
                "compute_capability": f"{properties.major}.{properties.minor}",
                "multiprocessors": int(properties.multi_processor_count),
            }
        )
    peer = [[a == b or bool(torch.cuda.can_device_access_peer(a, b)) for b in range(count)] for a in range(count)]
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"cuda": torch.version.cuda, "cudnn": cudnn, "nccl": nccl, "gpus": gpus, "peer_access": peer}
