"""The doctor's findings: warnings drawn from every rank's facts (`machine.rank_facts`), each one
line that names its fix, and the report as a person reads it.

The warnings are what commonly makes a job slow, uneven or hang: more processes than cores or
GPUs, oversubscribed threads, a small /dev/shm, versions or settings that differ between nodes,
GPUs that cannot reach each other directly, and environment variables that trade speed for
debugging."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

SMALL_SHM_BYTES = 1 << 30
"""Below this /dev/shm is too small for NCCL's shared-memory transport and data-loader workers."""
SLOWING_VARIABLES = {
    "CUDA_LAUNCH_BLOCKING": "makes every kernel launch wait for the one before (slow)",
    "NCCL_P2P_DISABLE": "keeps NCCL off NVLink and PCIe peer copies (lower bandwidth between GPUs)",
    "NCCL_SHM_DISABLE": "keeps NCCL off shared memory between processes (lower bandwidth)",
    "NCCL_IB_DISABLE": "keeps NCCL off InfiniBand / RoCE between nodes (sockets instead)",
}
"""Variables that, set to 1, trade speed for debugging or work around a broken link."""


def rank_list(ranks: list[int]) -> str:
    """`ranks 0-3, 6` (or `rank 5`): consecutive runs joined."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank{'' if len(ranks) == 1 else 's'} {text}"


def size_text(size: float) -> str:
    """Bytes as a person reads them: 64 MiB, 1.5 GiB, 512 B."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{int(size)} B"


def by_host(ranks: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    hosts: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for facts in ranks:
        hosts[facts["host"]].append(facts)
    return hosts


def first_rank_of_each_host(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each node's first rank's facts (the node's own: CPU, memory, GPUs, topology), in rank order."""
    first: dict[str, dict[str, Any]] = {}
    for facts in ranks:
        first.setdefault(facts["host"], facts)
    return list(first.values())


def differences(ranks: list[dict[str, Any]], what: str, values: list[Any], fix: str) -> list[str]:
    """One warning if `values` (one per rank) are not all alike: each value with its hosts and ranks."""
    holders: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for facts, value in zip(ranks, values):
        holders["unset" if value is None else str(value)].append(facts)
    if len(holders) < 2:
        return []
    each = "; ".join(
        f"{value} on {', '.join(dict.fromkeys(f['host'] for f in group))} ({rank_list([f['rank'] for f in group])})"
        for value, group in holders.items()
    )
    return [f"{what} differs across ranks: {each}; {fix}"]


def host_warnings(host: str, local: list[dict[str, Any]], backend: str, device_type: str) -> list[str]:
    """What is wrong on one node: processes against cores and GPUs, threads, /dev/shm, peer access."""
    found = []
    first, processes = local[0], len(local)
    cores, gpus = first["usable_cores"], len(first["gpus"])
    if device_type == "cpu" and processes > cores:
        found.append(
            f"{host}: {processes} processes on {cores} usable cores take turns on them (slow, uneven steps); "
            f"run at most {cores} per node (--nproc {cores})"
        )
    if gpus and processes > gpus:
        ran = " (the probe ran on gloo over the CPU)" if backend == "gloo" else ""
        found.append(
            f"{host}: {processes} processes and {gpus} GPU{'' if gpus == 1 else 's'}{ran}; run one process per GPU "
            f"(--nproc {gpus})"
        )
    threads, share = sum(facts["torch_threads"] for facts in local), max(1, cores // processes)
    if threads > cores and max(facts["torch_threads"] for facts in local) > share:  # (fewer threads would help)
        found.append(
            f"{host}: {processes} process{'' if processes == 1 else 'es'} x {first['torch_threads']} torch threads = "
            f"{threads} threads on {cores} usable cores oversubscribe them; set OMP_NUM_THREADS={share}"
        )
    shm = first["shm_bytes"]
    if shm is not None and shm < SMALL_SHM_BYTES:
        found.append(
            f"{host}: /dev/shm holds only {size_text(shm)}: NCCL's shared-memory transport and data-loader workers "
            "need more (docker's default is 64 MiB); start the container with --shm-size=16g or --ipc=host"
        )
    cut = [(a, b) for a, row in enumerate(first["peer_access"]) for b, ok in enumerate(row) if a < b and not ok]
    if cut:
        more = f" (and {len(cut) - 1} more pairs)" if len(cut) > 1 else ""
        found.append(
            f"{host}: GPUs {cut[0][0]} and {cut[0][1]}{more} cannot reach each other's memory directly, so NCCL "
            "stages their traffic through the host; check NCCL_P2P_DISABLE, the IOMMU / PCIe ACS settings or the "
            "VM's GPU pass-through"
        )
    return found


def environment_warnings(environment: dict[str, str], device_type: str, nodes: int, world: int) -> list[str]:
    """Rank 0's variables that slow a job down, and the one jobs of several GPUs need set."""
    found = []
    for name, why in SLOWING_VARIABLES.items():
        if name == "NCCL_IB_DISABLE" and nodes == 1:
            continue
        if environment.get(name, "0").strip() not in ("", "0"):
            found.append(f"{name}={environment[name]} {why}; unset it unless you need it")
    # fast path (cuda): CUDA's stream-connection setting; other devices have no such setting to warn about
    if device_type == "cuda" and world > 1 and "CUDA_DEVICE_MAX_CONNECTIONS" not in environment:
        found.append(
            "CUDA_DEVICE_MAX_CONNECTIONS is unset: the GPU may then reorder a layer's tensor-parallel communication "
            "behind later kernels, which overlapping it with compute relies on not happening (as in Megatron-LM); "
            "export CUDA_DEVICE_MAX_CONNECTIONS=1"
        )
    if environment.get("NCCL_DEBUG", "").upper() in ("INFO", "TRACE"):
        found.append(f"NCCL_DEBUG={environment['NCCL_DEBUG']} logs every connection (slow start-up); unset it or WARN")
    return found


def warnings_for(ranks: list[dict[str, Any]], backend: str, device_type: str) -> list[str]:
    """Every warning the facts of `ranks` (one `rank_facts` per rank, in rank order) give."""
    hosts = by_host(ranks)
    found = []
    for host, local in hosts.items():
        found += host_warnings(host, local, backend, device_type)
    for key in ranks[0]["versions"]:
        values = [facts["versions"].get(key) for facts in ranks]
        found += differences(ranks, key, values, "install the same versions on every node")
    if device_type == "cuda":  # fast path (cuda): the GPU models accelerator_facts() lists; elsewhere none
        names = [gpu_of(facts) for facts in ranks]
        found += differences(ranks, "the GPU model", names, "a job runs at its slowest device's pace: use one model")
    for name in sorted({name for facts in ranks for name in facts["environment"]}):
        if name in ("CUDA_VISIBLE_DEVICES",):
            continue  # (a launcher may give each process its own device this way)
        values = [facts["environment"].get(name) for facts in ranks]
        found += differences(ranks, name, values, "set it alike on every node")
    return found + environment_warnings(ranks[0]["environment"], device_type, len(hosts), len(ranks))


def gpu_of(facts: dict[str, Any]) -> str | None:
    """The name of the GPU a rank computes on (None on the CPU)."""
    device = facts["device"]
    if not device.startswith("cuda"):
        return None
    index = int(device.partition(":")[2] or 0)
    return next((gpu["name"] for gpu in facts["gpus"] if gpu["index"] == index), None)


def render(report: dict[str, Any]) -> str:
    """The report as text: the job, versions, devices, interconnect, environment, the probes, warnings."""
    nodes = report["nodes"]
    lines = [
        f"paratron doctor: {report['world_size']} process{'' if report['world_size'] == 1 else 'es'} on {nodes} "
        f"node{'' if nodes == 1 else 's'} ({report['backend']}, {report['device_type']})",
        "",
        "versions",
    ]
    lines += [f"  {key:<12} {value}" for key, value in report["versions"].items() if value is not None]
    lines += ["", "devices", *device_lines(report)]
    topology = [(f["host"], f["topology"], f["peer_access"]) for f in first_rank_of_each_host(report["ranks"])]
    if any(text or len(peers) > 1 for _, text, peers in topology):  # (one GPU: nothing to connect)
        lines += ["", "interconnect"]
        for host, text, peers in topology:
            lines.append(f"  {host}:")
            if text:
                lines += [f"    {line}" for line in text.splitlines()]
            elif len(peers) > 1:
                lines += [
                    f"    GPU {a}: peer access to {[b for b, ok in enumerate(row) if ok and b != a]}"
                    for a, row in enumerate(peers)
                ]
    lines += ["", "environment"]
    lines += [f"  {name}={value}" for name, value in report["environment"].items()] or ["  (none of the variables set)"]
    lines += ["", *probe_lines(report)]
    for title, items in (("notes", report["notes"]), ("warnings", report["warnings"])):
        if items:
            lines += ["", title, *(f"  - {item}" for item in items)]
    if not report["warnings"]:
        lines += ["", "no warnings"]
    return "\n".join(lines)


def device_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    for facts in first_rank_of_each_host(report["ranks"]):
        memory = facts["memory_bytes"]
        shm = facts["shm_bytes"]
        local = sum(f["host"] == facts["host"] for f in report["ranks"])
        lines.append(
            f"  {facts['host']}: {facts['cpu']}, {facts['cores']} cores ({facts['usable_cores']} usable), "
            f"{local} process{'' if local == 1 else 'es'} x {facts['torch_threads']} torch "
            f"thread{'' if facts['torch_threads'] == 1 else 's'}, memory "
            f"{'?' if memory is None else f'{memory / 1e9:.1f} GB'}, "
            f"/dev/shm {'none' if shm is None else size_text(shm)}"
        )
        lines += [
            f"    cuda:{gpu['index']} {gpu['name']}, {gpu['memory_bytes'] / 1e9:.1f} GB, compute capability "
            f"{gpu['compute_capability']}, {gpu['multiprocessors']} SMs"
            for gpu in facts["gpus"]
        ]
    return lines


def probe_lines(report: dict[str, Any]) -> list[str]:
    """The compute probe's line and the collectives' table."""
    compute = report["compute"]
    if compute is None:
        return ["probes: skipped (--no-probe)"]
    lines = [
        f"compute: {compute['matmul_tflops']:.3g} TFLOP/s dense {compute['dtype']} matmul ({compute['size']}x"
        f"{compute['size']}, the slowest of {report['world_size']} rank{'' if report['world_size'] == 1 else 's'})"
    ]
    if not report["collectives"]:
        return lines
    probe = report["probe"]
    lines += [
        "",
        f"collectives ({probe['element']}; time: the slowest rank's mean of {probe['iters']} iterations; bus "
        "bandwidth as nccl-tests)",
        f"  {'op':<15}{'ranks':>6}  {'nodes':<7}{'bytes':>10}{'time':>13}{'algbw':>13}{'busbw':>13}",
    ]
    for m in report["collectives"]:
        lines.append(
            f"  {m['op']:<15}{m['group_size']:>6}  {'several' if m['spans_nodes'] else 'one':<7}"
            f"{size_text(m['bytes']):>10}{m['time_us']:>10.1f} us"
            f"{m['algbw_gbps']:>8.3f} GB/s{m['busbw_gbps']:>8.3f} GB/s"
        )
    return lines
