"""What one process of a job can learn about the machine it runs on, as plain data: versions, the
host's cores, memory and /dev/shm, its GPUs and how they are connected, and the environment
variables that change how the job computes and communicates.

`paratron doctor` gathers these facts from every rank (`rank_facts`), so that versions or settings
that differ between nodes show; none of it needs a process group.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import paratron
from paratron.distributed.init import DistributedContext, accelerator_facts

LIBRARIES = ("numpy", "safetensors", "tokenizers", "transformers", "lm_eval", "triton")
"""Libraries whose version is reported when installed (torch's own are reported apart)."""

ENVIRONMENT_NAMES = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_LAUNCH_BLOCKING",
    "PYTORCH_CUDA_ALLOC_CONF",
    "GLOO_SOCKET_IFNAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)
"""Single variables that change threads, device choice, kernel launches, memory or the rendezvous."""
ENVIRONMENT_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "GLOO_", "UCX_", "FI_")
"""Families of variables that tune the collectives' transports (NCCL, gloo, UCX, libfabric)."""
TOPOLOGY_TIMEOUT_S = 20
"""How long `nvidia-smi topo -m` may take (it answers in well under a second on a healthy node)."""


def library_version(name: str) -> str | None:
    """An installed distribution's version, None when it is not installed (nothing is imported)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions(accelerator: dict[str, Any], backend: str) -> dict[str, Any]:
    """Python, torch and what it was built with (CUDA, cuDNN, NCCL), the backend, paratron and the
    key libraries (those installed)."""
    found = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": accelerator["cuda"],
        "cudnn": accelerator["cudnn"],
        "nccl": accelerator["nccl"],
        "backend": backend,
        "paratron": paratron.__version__,
    }
    for name in LIBRARIES:
        found[name] = library_version(name)
    return found


def environment(variables: dict[str, str] | None = None) -> dict[str, str]:
    """The variables set (of `ENVIRONMENT_NAMES` and `ENVIRONMENT_PREFIXES`) that change behaviour."""
    variables = os.environ if variables is None else variables
    return {
        name: value
        for name, value in sorted(variables.items())
        if name in ENVIRONMENT_NAMES or name.startswith(ENVIRONMENT_PREFIXES)
    }


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, as taskset or a container's cpuset sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not on macOS)
        return os.cpu_count() or 1


def memory_bytes() -> tuple[int | None, int | None]:
    """The machine's memory and the part of it available now (Linux's MemAvailable), in bytes."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = None
    available = None
    try:
        found = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
        available = int(found.group(1)) * 1024 if found else None
    except OSError:
        pass
    return total, available


def cpu_name() -> str:
    """The processor's model name (Linux's /proc/cpuinfo), else what the platform says."""
    try:
        found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
        if found:
            return found.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def shm_bytes(path: str = "/dev/shm") -> int | None:
    """The size of the shared-memory file system NCCL and data-loader workers use (None without one)."""
    try:
        return int(shutil.disk_usage(path).total)
    except OSError:
        return None


def gpu_topology(gpus: int) -> str | None:
    """`nvidia-smi topo -m`: how each pair of GPUs (and network cards) is connected (NVLink, PCIe
    switch, host bridge, socket); None without GPUs or without the tool."""
    tool = shutil.which("nvidia-smi")
    if gpus == 0 or tool is None:
        return None
    try:
        done = subprocess.run(
            [tool, "topo", "-m"], capture_output=True, text=True, timeout=TOPOLOGY_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.rstrip() if done.returncode == 0 else None


def rank_facts(context: DistributedContext) -> dict[str, Any]:
    """Everything one rank reports: where it runs, its versions, its host's CPU, memory, /dev/shm
    and GPUs, the environment, and (the first rank of a host only) the GPUs' topology."""
    accelerator = accelerator_facts()
    total, available = memory_bytes()
    return {
        "rank": context.rank,
        "local_rank": context.local_rank,
        "local_world_size": context.local_world_size,
        "host": socket.gethostname(),
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "executable": sys.executable,
        "versions": versions(accelerator, context.backend),
        "device": str(context.device),
        "cpu": cpu_name(),
        "cores": os.cpu_count() or 1,
        "usable_cores": usable_cores(),
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": total,
        "memory_available_bytes": available,
        "shm_bytes": shm_bytes(),
        "gpus": accelerator["gpus"],
        "peer_access": accelerator["peer_access"],
        "topology": gpu_topology(len(accelerator["gpus"])) if context.local_rank == 0 else None,
        "environment": environment(),
    }
