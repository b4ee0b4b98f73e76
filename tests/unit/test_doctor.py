"""`paratron doctor`'s pieces in process: nccl-tests' bus-bandwidth factors, the sizes and groups
probed, the warnings drawn from (made-up) facts of ranks and nodes, the JSON report of a
one-process run, and the one-line errors for bad flags."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from paratron.cli import main
from paratron.debugging import doctor
from paratron.debugging.doctor import FORMAT, assemble, doctor_backend, parse_bytes
from paratron.debugging.doctor_report import rank_list, render, size_text, warnings_for
from paratron.debugging.machine import environment
from paratron.debugging.probe import OPS, Measurement, bus_factor, elements, group_sizes, message_sizes
from paratron.distributed.init import accelerator_facts
from paratron.errors import ConfigError

GIB = 1 << 30


def facts(rank: int, host: str = "node-a", local: int = 0, **changes: Any) -> dict[str, Any]:
    """One rank's facts as `machine.rank_facts` gives them, for a healthy 8-core CPU node."""
    base = {
        "rank": rank,
        "local_rank": local,
        "local_world_size": 2,
        "host": host,
        "platform": "Linux 6.1 x86_64",
        "executable": "/usr/bin/python3",
        "versions": {"python": "3.11.7", "torch": "2.13.0", "cuda": None, "nccl": None, "paratron": "0.1.0"},
        "device": "cpu",
        "cpu": "Test CPU",
        "cores": 8,
        "usable_cores": 8,
        "torch_threads": 4,
        "memory_bytes": 64 * GIB,
        "memory_available_bytes": 60 * GIB,
        "shm_bytes": 32 * GIB,
        "gpus": [],
        "peer_access": [],
        "topology": None,
        "environment": {"OMP_NUM_THREADS": "4"},
    }
    return {**base, **changes}


def gpu_rank(rank: int, gpus: int = 2, **changes: Any) -> dict[str, Any]:
    listed = [
        {
            "index": i,
            "name": "NVIDIA H100",
            "memory_bytes": 80 * 10**9,
            "compute_capability": "9.0",
            "multiprocessors": 132,
        }
        for i in range(gpus)
    ]
    peers = [[True] * gpus for _ in range(gpus)]
    environment = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "OMP_NUM_THREADS": "4"}
    base = {"device": f"cuda:{rank % gpus}", "gpus": listed, "peer_access": peers, "environment": environment}
    return facts(rank, local=rank, **{**base, **changes})


def test_bus_bandwidth_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 2) == 1.0
    assert bus_factor("all_reduce", 8) == pytest.approx(1.75)
    assert bus_factor("all_gather", 4) == pytest.approx(0.75)
    assert bus_factor("reduce_scatter", 8) == pytest.approx(0.875)
    assert bus_factor("all_to_all", 2) == pytest.approx(0.5)
    assert bus_factor("send_recv", 16) == 1.0
    with pytest.raises(ValueError, match="broadcast"):
        bus_factor("broadcast", 2)
    measured = Measurement.of("all_reduce", 4, False, 10**6, 1e-3)  # 1 MB in 1 ms
    assert measured.algbw_gbps == pytest.approx(1.0)
    assert measured.busbw_gbps == pytest.approx(1.5)
    assert measured.time_us == pytest.approx(1000.0)


def test_sizes_and_groups_probed():
    assert message_sizes(65536) == [1024, 4096, 16384, 65536]
    assert message_sizes(5000) == [1024, 4096, 5000]
    assert message_sizes(100) == [100]
    assert group_sizes(1) == []
    assert group_sizes(2) == [2]
    assert group_sizes(6) == [2, 4, 6]
    assert group_sizes(8) == [2, 4, 8]
    assert elements(4096, 4) == 1024
    assert elements(4100, 8) == 1024  # (a whole share per rank)
    assert elements(4, 8) == 8


def test_max_bytes_is_read_with_units():
    assert parse_bytes("65536") == 65536
    assert parse_bytes("4M") == 4 << 20
    assert parse_bytes("64MiB") == 64 << 20
    assert parse_bytes("1gb") == GIB
    assert parse_bytes("512 KiB") == 512 << 10
    assert parse_bytes("8B") == 8
    for nonsense in ("lots", "4X", "0", "-1", "2.5M", "3"):
        with pytest.raises(ConfigError, match="--max-bytes"):
            parse_bytes(nonsense)


def test_a_healthy_node_gives_no_warning():
    assert warnings_for([facts(0), facts(1, local=1)], "gloo", "cpu") == []
    assert warnings_for([gpu_rank(0), gpu_rank(1)], "nccl", "cuda") == []


def test_warnings_from_the_cpu_node():
    crowded = [facts(r, local=r, usable_cores=2, torch_threads=2, shm_bytes=64 << 20) for r in range(3)]
    found = warnings_for(crowded, "gloo", "cpu")
    assert found[0] == (
        "node-a: 3 processes on 2 usable cores take turns on them (slow, uneven steps); run at most 2 per node "
        "(--nproc 2)"
    )
    assert found[1] == (
        "node-a: 3 processes x 2 torch threads = 6 threads on 2 usable cores oversubscribe them; set OMP_NUM_THREADS=1"
    )
    assert "/dev/shm holds only 64 MiB" in found[2] and "--shm-size" in found[2]
    assert len(found) == 3
    one_thread_each = [facts(r, local=r, usable_cores=2, torch_threads=1) for r in range(3)]
    assert len(warnings_for(one_thread_each, "gloo", "cpu")) == 1  # (OMP_NUM_THREADS=1 already: cores only)


def test_versions_and_settings_that_differ_between_nodes_are_named():
    older = {**facts(2)["versions"], "torch": "2.12.0"}
    ranks = [
        facts(0),
        facts(1, local=1),
        facts(2, host="node-b", versions=older, environment={"OMP_NUM_THREADS": "4", "NCCL_IB_HCA": "mlx5_0"}),
        facts(3, host="node-b", local=1, versions=older),
    ]
    found = warnings_for(ranks, "gloo", "cpu")
    assert found == [
        "torch differs across ranks: 2.13.0 on node-a (ranks 0-1); 2.12.0 on node-b (ranks 2-3); install the same "
        "versions on every node",
        "NCCL_IB_HCA differs across ranks: unset on node-a, node-b (ranks 0-1, 3); mlx5_0 on node-b (rank 2); set it "
        "alike on every node",
    ]


def test_warnings_from_the_gpu_node():
    cut = [[True, False, True], [False, True, True], [True, True, True]]
    environment = {"CUDA_LAUNCH_BLOCKING": "1", "NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "4"}
    ranks = [gpu_rank(r, gpus=3, peer_access=cut, environment=environment) for r in range(4)]
    found = warnings_for(ranks, "gloo", "cuda")
    assert (
        found[0]
        == "node-a: 4 processes and 3 GPUs (the probe ran on gloo over the CPU); run one process per GPU (--nproc 3)"
    )
    assert found[1].startswith("node-a: 4 processes x 4 torch threads = 16 threads on 8 usable cores")
    assert found[2].startswith("node-a: GPUs 0 and 1 cannot reach each other's memory directly")
    assert found[3] == (
        "CUDA_LAUNCH_BLOCKING=1 makes every kernel launch wait for the one before (slow); unset it unless you need it"
    )
    assert found[4].startswith("CUDA_DEVICE_MAX_CONNECTIONS is unset") and found[4].endswith(
        "export CUDA_DEVICE_MAX_CONNECTIONS=1"
    )
    assert found[5].startswith("NCCL_DEBUG=INFO logs every connection")
    assert len(found) == 6
    assert warnings_for([gpu_rank(0, environment={})], "nccl", "cuda") == []  # (one GPU: nothing to overlap)
    mixed = [gpu_rank(0), gpu_rank(1)]
    mixed[1]["gpus"] = [{**gpu, "name": "NVIDIA A100"} for gpu in mixed[1]["gpus"]]
    assert warnings_for(mixed, "nccl", "cuda") == [
        "the GPU model differs across ranks: NVIDIA H100 on node-a (rank 0); NVIDIA A100 on node-a (rank 1); a job "
        "runs at its slowest device's pace: use one model"
    ]


def test_accelerator_facts_are_plain_data(monkeypatch):
    """The CUDA runtime's answers (faked: two GPUs, no peer access between them) become plain data."""
    properties = SimpleNamespace(
        name="NVIDIA H100", total_memory=80 * 10**9, major=9, minor=0, multi_processor_count=132
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: properties)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: False)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    found = accelerator_facts()
    assert found["nccl"] == "2.21.5"
    assert found["gpus"][1] == {
        "index": 1,
        "name": "NVIDIA H100",
        "memory_bytes": 80 * 10**9,
        "compute_capability": "9.0",
        "multiprocessors": 132,
    }
    assert found["peer_access"] == [[True, False], [False, True]]
    assert json.loads(json.dumps(found)) == found


def test_only_variables_that_change_behaviour_are_reported():
    given = {
        "NCCL_ALGO": "Ring",
        "OMP_NUM_THREADS": "2",
        "HOME": "/root",
        "AWS_SECRET_ACCESS_KEY": "x",
        "FI_PROVIDER": "efa",
    }
    assert environment(given) == {"FI_PROVIDER": "efa", "NCCL_ALGO": "Ring", "OMP_NUM_THREADS": "2"}


def test_the_backend_follows_the_gpus(monkeypatch):
    monkeypatch.setattr(doctor, "accelerator_type", lambda: "cuda")
    monkeypatch.setattr(doctor, "visible_devices", lambda backend: None)
    assert doctor_backend("auto", 4) == "gloo"
    monkeypatch.setattr(doctor, "visible_devices", lambda backend: None if backend == "auto" else 0)
    with pytest.raises(ConfigError, match=r"--backend nccl: this machine has no GPU visible .*; use --backend gloo"):
        doctor_backend("nccl", 1)
    monkeypatch.setattr(doctor, "visible_devices", lambda backend: 2)
    assert doctor_backend("auto", 2) == "nccl"
    assert doctor_backend("auto", 4) == "gloo"  # (and the report warns)
    assert doctor_backend("gloo", 1) == "gloo"
    monkeypatch.setattr(doctor, "accelerator_type", lambda: "xpu")
    assert doctor_backend("auto", 2) == "xccl"
    with pytest.raises(
        ConfigError, match=r"--backend nccl with 4 processes: this machine has 2 GPUs visible; use --nproc 2"
    ):
        doctor_backend("nccl", 4)


def test_the_report_has_the_calibration_format():
    ranks = [facts(0), facts(1, local=1)]
    collectives = [Measurement.of(op, 2, False, 4096, 1e-4).as_dict() for op in OPS]
    compute = {"matmul_tflops": 0.5, "dtype": "float32", "size": 1024, "per_rank_tflops": [0.5, 0.6]}
    probe = {"max_bytes": 4096, "iters": 3, "element": "float32"}
    report = assemble(ranks, "gloo", "cpu", compute, collectives, probe, [])
    assert list(report)[:12] == [
        "format", "world_size", "nodes", "ranks_per_node", "backend", "device_type", "versions", "devices",
        "environment", "compute", "collectives", "warnings",
    ]  # fmt: skip
    assert (report["format"], report["world_size"], report["nodes"], report["ranks_per_node"]) == (FORMAT, 2, 1, 2)
    assert report["devices"] == [
        {"host": "node-a", "name": "Test CPU", "memory_gb": 64 * GIB / 1e9, "cores": 8, "usable_cores": 8}
    ]
    assert json.loads(json.dumps(report)) == report
    text = render(report)
    assert "paratron doctor: 2 processes on 1 node (gloo, cpu)" in text
    assert "  all_reduce          2  one         4 KiB     100.0 us   0.041 GB/s   0.041 GB/s" in text
    assert "  all_gather          2  one         4 KiB     100.0 us   0.041 GB/s   0.020 GB/s" in text
    assert text.endswith("no warnings")
    gpus = assemble([gpu_rank(0), gpu_rank(1)], "nccl", "cuda", compute, [], probe, [])
    text = render({**gpus, "ranks": [{**gpus["ranks"][0], "topology": "\tGPU0\tGPU1\nGPU0\t X \tNV18"}]})
    assert "interconnect\n  node-a:\n    \tGPU0\tGPU1\n    GPU0\t X \tNV18\n" in text
    assert "    cuda:1 NVIDIA H100, 80.0 GB, compute capability 9.0, 132 SMs" in text
    assert "interconnect\n  node-a:\n    GPU 0: peer access to [1]\n    GPU 1: peer access to [0]\n" in render(gpus)
    assert [(d["index"], d["name"], d["memory_gb"]) for d in gpus["devices"]] == [
        (0, "NVIDIA H100", 80.0),
        (1, "NVIDIA H100", 80.0),
    ]


def test_nodes_are_listed_in_rank_order_whatever_the_placement():
    ranks = [facts(0, host="b"), facts(1, host="a"), facts(2, host="b", local=1), facts(3, host="a", local=1)]
    report = assemble(ranks, "gloo", "cpu", None, [], {}, [])
    assert [d["host"] for d in report["devices"]] == ["b", "a"]
    assert (report["nodes"], report["ranks_per_node"]) == (2, 2)
    assert "probes: skipped (--no-probe)" in render(report)


def test_small_formats():
    assert rank_list([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-8"
    assert rank_list([3]) == "rank 3"
    assert size_text(64 << 20) == "64 MiB"
    assert size_text(1536) == "1.5 KiB"
    assert size_text(100) == "100 B"


def test_one_process_reports_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture):
    out = tmp_path / "reports" / "doctor.json"
    assert main(["doctor", "--output", str(out), "--iters", "1"]) == 0
    printed = capsys.readouterr().out
    assert "one process: no collective to probe" in printed
    assert f"wrote {out}" in printed
    report = json.loads(out.read_text())
    assert report["format"] == FORMAT
    assert (report["world_size"], report["nodes"], report["ranks_per_node"]) == (1, 1, 1)
    assert (report["backend"], report["device_type"]) == ("gloo", "cpu")
    assert report["compute"]["dtype"] == "float32" and report["compute"]["matmul_tflops"] > 0
    assert report["collectives"] == []
    assert report["versions"]["torch"] and report["versions"]["paratron"]
    assert report["devices"][0]["memory_gb"] > 0
    assert list(tmp_path.joinpath("reports").iterdir()) == [out]  # (no temporary file left)


def test_no_probe_measures_nothing(capsys: pytest.CaptureFixture):
    assert main(["doctor", "--no-probe"]) == 0
    assert "probes: skipped (--no-probe)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--nproc", "0"], "--nproc 0: must be at least 1"),
        (["--iters", "0"], "--iters 0: must be at least 1"),
        (["--max-bytes", "nonsense"], "--max-bytes nonsense: not a size"),
        (["--max-bytes", "2"], "--max-bytes 2: below one 4-byte element"),
        (["--output", "{tmp}"], "--output {tmp}: a directory; name a file in it"),
        (["--output", "{tmp}/file/doctor.json"], "--output {tmp}/file/doctor.json: cannot write in {tmp}/file ("),
        (["--output", "/proc/doctor/doctor.json"], "--output /proc/doctor/doctor.json: cannot write in /proc/doctor ("),
        (["--nproc", "two"], "argument --nproc: invalid int value: 'two'"),
    ],
)
def test_bad_input_is_one_line(args, expected, tmp_path: Path, capsys: pytest.CaptureFixture):
    tmp_path.joinpath("file").write_text("")
    capsys.readouterr()
    code = main(["doctor", *(a.replace("{tmp}", str(tmp_path)) for a in args)])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1, captured.err
    assert lines[0].startswith("error: ") and expected.replace("{tmp}", str(tmp_path)) in lines[0], lines[0]
    assert captured.out == ""
