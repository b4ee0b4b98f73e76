"""`paratron doctor --nproc 2` as a user runs it: two gloo processes under torchrun probe every
collective at every message size, rank 0 prints the table and writes the JSON the planner reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from paratron.debugging.probe import OPS, message_sizes

REPO = Path(__file__).resolve().parents[2]


def test_two_processes_probe_every_collective(tmp_path: Path):
    out = tmp_path / "doctor.json"
    args = ["doctor", "--nproc", "2", "--output", str(out), "--max-bytes", "65536", "--iters", "3"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    done = subprocess.run(
        [sys.executable, "-m", "paratron", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("paratron doctor: 2 processes on 1 node (gloo, cpu)") == 1  # (rank 0 alone prints)
    report = json.loads(out.read_text())
    assert (report["format"], report["world_size"], report["nodes"], report["ranks_per_node"]) == (
        "paratron-doctor/1",
        2,
        1,
        2,
    )
    assert report["backend"] == "gloo" and report["device_type"] == "cpu"
    assert [facts["rank"] for facts in report["ranks"]] == [0, 1]
    assert len(report["compute"]["per_rank_tflops"]) == 2 and report["compute"]["matmul_tflops"] > 0
    measured = {(m["op"], m["group_size"], m["bytes"]): m for m in report["collectives"]}
    assert set(measured) == {(op, 2, size) for op in OPS for size in message_sizes(65536)}
    for m in measured.values():
        assert m["spans_nodes"] is False
        assert m["time_us"] > 0 and m["busbw_gbps"] > 0
        factor = {"all_reduce": 1.0, "send_recv": 1.0}.get(m["op"], 0.5)
        assert m["algbw_gbps"] == pytest.approx(m["bytes"] / (m["time_us"] * 1e-6) / 1e9, rel=1e-9)
        assert m["busbw_gbps"] == pytest.approx(m["algbw_gbps"] * factor, rel=1e-12)
        assert f"{m['op']:<15}{2:>6}  one" in done.stdout
