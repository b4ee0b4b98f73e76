"""`paratron doctor [--nproc N] [--output FILE.json] [--max-bytes B] [--iters I] [--no-probe]`:
what this machine (or job) can do, and what is likely to go wrong on it.

Every rank gathers its facts (`machine.rank_facts`: versions, host, cores, memory, /dev/shm, GPUs
and their topology, the environment), the ranks probe a dense matmul and, with two or more of
them, the collectives (`probe`); rank 0 prints a readable report with one-line warnings that name
their fix, and with --output writes it as JSON (`FORMAT`), the planner's calibration input
(`paratron plan --calibration`). --nproc N runs N local processes under torchrun, as `paratron
train --nproc` does; started by torchrun itself (any number of nodes), it probes the job it is in.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from paratron.config.arguments import ArgumentParser
from paratron.config.schema import ParallelConfig
from paratron.debugging.doctor_report import first_rank_of_each_host, render, warnings_for
from paratron.debugging.machine import rank_facts
from paratron.debugging.probe import (
    ELEMENT,
    compute_dtype,
    matmul_size,
    probe_collectives,
    probe_matmul,
)
from paratron.distributed.init import (
    accelerator_type,
    default_backend,
    initialize,
    launched_by_torchrun,
    shutdown,
    visible_devices,
)
from paratron.distributed.launch import run_under_torchrun
from paratron.errors import ConfigError
from paratron.storage import write_text_atomic

FORMAT = "paratron-doctor/1"
"""The JSON report's format name (its `format` key); readers refuse another."""
DEFAULT_MAX_BYTES = {"cpu": 4 << 20, "cuda": 64 << 20}
"""The largest message probed by default: a few seconds on the CPU, the bandwidth plateau on GPUs."""
DEFAULT_ITERS = {"cpu": 10, "cuda": 20}
"""Timed iterations per measurement by default."""
PROBE_TIMEOUT_MINUTES = 5.0
"""How long a rank waits for the others (to join, or in a collective) before giving up."""
UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
"""--max-bytes suffixes (K, M, G, with or without iB / B: binary, as nccl-tests reads -e 64M)."""


@dataclass(frozen=True)
class DoctorOptions:
    """The command's flags, checked."""

    nproc: int = 1
    output: Path | None = None
    max_bytes: int | None = None
    """None: `DEFAULT_MAX_BYTES` of the device."""
    iters: int | None = None
    """None: `DEFAULT_ITERS` of the device."""
    probe: bool = True
    backend: str = "auto"


def doctor_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="paratron doctor",
        usage="paratron doctor [--nproc N] [--output FILE.json] [--max-bytes B] [--iters I] [--no-probe]",
        description="Report this machine's versions, devices, interconnect and environment, measure a dense matmul "
        "and (with several processes) the collectives' bandwidth per message and group size, and warn about what "
        "commonly goes wrong. Also runs under torchrun (`torchrun ... -m paratron doctor`), on any number of nodes.",
        allow_abbrev=False,
    )
    parser.add_argument("--nproc", type=int, default=1, metavar="N", help="Local processes to probe (default: 1).")
    parser.add_argument("--output", type=Path, default=None, metavar="FILE.json", help="Also write the report as JSON.")
    parser.add_argument(
        "--max-bytes",
        default=None,
        metavar="B",
        help="Largest message probed, in bytes, or with a K, M or G suffix (default: 64M on GPUs, 4M on the CPU).",
    )
    parser.add_argument(
        "--iters", type=int, default=None, metavar="I", help="Timed iterations per measurement (default: 20 / 10)."
    )
    parser.add_argument("--no-probe", action="store_true", help="Report the facts only; measure nothing.")
    parser.add_argument(
        "--backend",
        choices=("auto", "nccl", "gloo"),
        default="auto",
        help="Process-group backend (default: auto: NCCL with a GPU per process, else gloo on the CPU).",
    )
    return parser


def parse_bytes(text: str) -> int:
    """A --max-bytes value: an integer of bytes, or with a K, M or G suffix (binary)."""
    found = re.fullmatch(r"\s*(\d+)\s*(?:([kmg])(?:i?b)?|b)?\s*", text, re.IGNORECASE)
    if found is None:
        raise ConfigError(f"--max-bytes {text}: not a size; give bytes, e.g. 65536, 4M or 64MiB")
    size = int(found.group(1)) * UNITS[(found.group(2) or "").lower()]
    if size < ELEMENT.itemsize:
        raise ConfigError(f"--max-bytes {text}: below one {ELEMENT.itemsize}-byte element; give e.g. 65536 or 4M")
    return size


def check_output(path: Path) -> None:
    """Before anything runs: --output names a file that can be written (its folder is made if
    missing, and a trial file written and removed there)."""
    if path.is_dir():
        raise ConfigError(f"--output {path}: a directory; name a file in it, e.g. {path / 'doctor.json'}")
    folder = path.absolute().parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{path.name}.", suffix=".check"):
            pass
    except OSError as exc:
        raise ConfigError(
            f"--output {path}: cannot write in {folder} ({exc.strerror or exc}); choose another path"
        ) from None


def parse_options(argv: list[str]) -> DoctorOptions:
    """The flags, each checked (ConfigError: one line naming the flag and the fix)."""
    namespace = doctor_parser().parse_args(argv)
    if namespace.nproc < 1:
        raise ConfigError(f"--nproc {namespace.nproc}: must be at least 1")
    if namespace.iters is not None and namespace.iters < 1:
        raise ConfigError(f"--iters {namespace.iters}: must be at least 1")
    if namespace.output is not None and os.environ.get("RANK", "0") == "0":  # (rank 0 writes it)
        check_output(namespace.output)
    max_bytes = None if namespace.max_bytes is None else parse_bytes(namespace.max_bytes)
    return DoctorOptions(
        namespace.nproc, namespace.output, max_bytes, namespace.iters, not namespace.no_probe, namespace.backend
    )


def doctor_backend(requested: str, local_processes: int) -> str:
    """The backend the probe runs on: NCCL needs a GPU per local process (else a ConfigError naming
    the count); auto takes NCCL when each process has one and gloo on the CPU otherwise (the report
    then warns that the processes outnumber the GPUs)."""
    gpus = visible_devices("nccl" if requested == "nccl" else "auto")
    if requested == "gloo" or gpus is None:
        return "gloo"
    if gpus == 0:  # (only with nccl asked for: auto takes the CPU then)
        raise ConfigError(
            "--backend nccl: this machine has no GPU visible (CUDA_VISIBLE_DEVICES honoured); use --backend gloo or "
            "auto to probe the CPU"
        )
    if local_processes <= gpus:
        return "nccl" if requested == "nccl" else default_backend(accelerator_type())  # (xccl on Intel GPUs)
    if requested == "nccl":
        raise ConfigError(
            f"--backend nccl with {local_processes} processes: this machine has {gpus} GPU"
            f"{'' if gpus == 1 else 's'} visible; use --nproc {gpus}, or --backend gloo to probe the CPU"
        )
    return "gloo"


def run_doctor(argv: list[str]) -> int:
    """The command: launch the processes (--nproc N, outside torchrun) or be one of them."""
    options = parse_options(argv)
    if options.nproc > 1 and not launched_by_torchrun():
        backend = doctor_backend(options.backend, options.nproc)  # (the count checked before any process starts)
        return run_under_torchrun(ParallelConfig(nproc_per_node=options.nproc), ["doctor", *argv, "--backend", backend])
    report = examine(options)
    if report is not None:  # (rank 0)
        print(render(report), flush=True)
        if options.output is not None:
            text = json.dumps(report, indent=2) + "\n"
            write_text_atomic(options.output, text, what="the doctor's report")
            print(f"wrote {options.output}")
    return 0


def gathered(mine: Any) -> list[Any]:
    """Every rank's `mine`, in rank order (just `[mine]` alone)."""
    if not dist.is_initialized():
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def examine(options: DoctorOptions) -> dict[str, Any] | None:
    """This rank's part of the examination; rank 0 gets the report (the others None)."""
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    context = initialize(doctor_backend(options.backend, local_processes), PROBE_TIMEOUT_MINUTES)
    try:
        ranks = gathered(rank_facts(context))
        hosts = list(dict.fromkeys(facts["host"] for facts in ranks))
        device_type = context.device.type
        max_bytes = options.max_bytes or DEFAULT_MAX_BYTES.get(device_type, DEFAULT_MAX_BYTES["cuda"])
        iters = options.iters or DEFAULT_ITERS.get(device_type, DEFAULT_ITERS["cuda"])
        compute, collectives = None, []
        if options.probe:
            dtype, size = compute_dtype(context.device), matmul_size(context.device)
            per_rank = gathered(probe_matmul(context.device, max(3, iters), size, dtype))
            compute = {
                "matmul_tflops": min(per_rank),
                "dtype": str(dtype).removeprefix("torch."),
                "size": size,
                "per_rank_tflops": per_rank,
            }
            if context.world_size > 1:
                node_of_rank = [hosts.index(facts["host"]) for facts in ranks]
                measured = probe_collectives(node_of_rank, context.device, max_bytes, iters)
                collectives = [m.as_dict() for m in measured]
        if context.rank != 0:
            return None
        notes = []
        if options.nproc > 1 and launched_by_torchrun() and options.nproc != context.local_world_size:
            notes.append(f"--nproc {options.nproc} is ignored under torchrun, which started {local_processes} here")
        if context.world_size == 1:
            notes.append(
                "one process: no collective to probe; run `paratron doctor --nproc N` (or under torchrun) to measure "
                "the interconnect"
            )
        probe = {"max_bytes": max_bytes, "iters": iters, "element": str(ELEMENT).removeprefix("torch.")}
        return assemble(ranks, context.backend, device_type, compute, collectives, probe, notes)
    finally:
        shutdown()


def devices_of(ranks: list[dict[str, Any]], device_type: str) -> list[dict[str, Any]]:
    """The devices of every node: its GPUs, or (computing on the CPU) the node's processor."""
    devices = []
    for facts in first_rank_of_each_host(ranks):
        if device_type == "cuda":  # fast path (cuda): the GPUs accelerator_facts() lists; else the processor
            devices += [
                {
                    "host": facts["host"],
                    "index": gpu["index"],
                    "name": gpu["name"],
                    "memory_gb": gpu["memory_bytes"] / 1e9,
                    "compute_capability": gpu["compute_capability"],
                    "multiprocessors": gpu["multiprocessors"],
                }
                for gpu in facts["gpus"]
            ]
        else:
            memory = facts["memory_bytes"]
            devices.append(
                {
                    "host": facts["host"],
                    "name": facts["cpu"],
                    "memory_gb": None if memory is None else memory / 1e9,
                    "cores": facts["cores"],
                    "usable_cores": facts["usable_cores"],
                }
            )
    return devices


def assemble(
    ranks: list[dict[str, Any]],
    backend: str,
    device_type: str,
    compute: dict[str, Any] | None,
    collectives: list[dict[str, Any]],
    probe: dict[str, Any],
    notes: list[str],
) -> dict[str, Any]:
    """The report (the JSON's keys in `FORMAT`'s order, then the details) from every rank's facts."""
    hosts = first_rank_of_each_host(ranks)
    report = {
        "format": FORMAT,
        "world_size": len(ranks),
        "nodes": len(hosts),
        "ranks_per_node": max(sum(r["host"] == h["host"] for r in ranks) for h in hosts),
        "backend": backend,
        "device_type": device_type,
        "versions": ranks[0]["versions"],
        "devices": devices_of(ranks, device_type),
        "environment": ranks[0]["environment"],
        "compute": compute,
        "collectives": collectives,
        "warnings": [],
        "notes": notes,
        "probe": probe,
        "ranks": ranks,
    }
    report["warnings"] = warnings_for(ranks, backend, device_type)
    return report
