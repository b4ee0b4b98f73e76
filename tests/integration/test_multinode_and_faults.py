"""Beyond one machine, as a user runs it: two launch agents on this machine as two nodes over
loopback, and a run that loses a rank again and again (--fault-inject, --max-restarts) and still
ends with the uninterrupted run's losses and intact checkpoints."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from paratron.checkpoint.io import TRACKER, read_checkpoint

from multiprocess import free_port

REPO = Path(__file__).resolve().parents[2]

RUN = ["train", "--config", "debug", "--lr-warmup-iters", "1", "--eval-iters", "0", "--log-interval", "1"]
QUIET = ["--no-progress-bar", "--no-tensorboard"]


def start(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "paratron", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(process: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"no exit within {timeout} s:\n{err[-3000:]}")
    return process.returncode, out, err


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


def test_two_nodes_over_loopback_train_as_one_node(tmp_path):
    """TP 2 x DP 2 on two nodes of two processes: each tensor-parallel pair on one node."""
    steps = ["--train-iters", "3", "--tensor-model-parallel-size", "2", *QUIET]
    code, out, err = finish(start(*RUN, *steps, "--nproc", "4", "--run-dir", str(tmp_path / "one")))
    assert code == 0, err
    port = str(free_port())
    nodes = [
        start(
            *RUN,
            *steps,
            "--nproc",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            str(rank),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            port,
            "--run-dir",
            str(tmp_path / f"node{rank}"),
        )
        for rank in (0, 1)
    ]
    results = [finish(node) for node in nodes]
    assert [r[0] for r in results] == [0, 0], results[0][2][-2000:] + results[1][2][-2000:]
    assert "world 4 = TP 2 x CP 1 x DP 2" in results[0][1]
    assert losses(tmp_path / "node0") == losses(tmp_path / "one")  # the same ranks, the same numbers
    assert not (tmp_path / "node1" / "metrics.jsonl").exists()  # rank 0 writes the metrics


def test_a_node_rank_out_of_range_and_an_unreachable_master_are_one_line(tmp_path):
    code, _, err = finish(start(*RUN, "--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1", *QUIET))
    assert code == 2 and err.strip() == "error: --node-rank 2 is out of range for --nnodes 2: use 0 to 1"
    code, _, err = finish(
        start(
            *RUN,
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "--rdzv-timeout-seconds",
            "3",
            "--run-dir",
            str(tmp_path),
            *QUIET,
        ),
        timeout=120,
    )
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err[-2000:]
    assert lines[0].startswith("error: the nodes did not meet at 127.0.0.1:") and "within 3 s" in lines[0]


def test_a_run_that_loses_a_rank_ten_times_ends_as_the_uninterrupted_one(tmp_path):
    """Ten kills (SIGKILL of a seeded random rank at a seeded random step, one per attempt, steps
    in order so each fires), --max-restarts 10, a checkpoint every 2 steps: every restart resumes
    from the newest intact checkpoint, and the losses are the uninterrupted run's."""
    steps = 8
    common = [*RUN, "--nproc", "2", "--train-iters", str(steps), "--save-interval", "2", *QUIET]
    code, _, err = finish(start(*common, "--save", str(tmp_path / "ck0"), "--run-dir", str(tmp_path / "calm")))
    assert code == 0, err
    chance = random.Random(19)
    faults = [f"{chance.randrange(2)}:{step}:crash" for step in sorted(chance.randint(1, steps) for _ in range(10))]
    code, out, err = finish(
        start(
            *common,
            "--save",
            str(tmp_path / "ck"),
            "--run-dir",
            str(tmp_path / "faulty"),
            "--max-restarts",
            "10",
            "--fault-inject",
            *faults,
        ),
        timeout=600,
    )
    assert code == 0, err[-3000:]
    # ten restarts, each said by the launcher (a worker's own banner can die with it, unprinted)
    restarts = [line for line in err.splitlines() if line.startswith("a rank failed: restarting the workers")]
    assert [line.split("(")[1].split(",")[0] for line in restarts] == [f"{k} of 10" for k in range(1, 11)]
    assert 1 <= out.count("paratron: world 2") <= 11
    assert losses(tmp_path / "faulty") == losses(tmp_path / "calm")
    # every checkpoint is whole, and the tracker names the last
    folders = sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith("iter_"))
    assert folders == [f"iter_{i:07d}" for i in range(2, steps + 1, 2)]
    for folder in folders:
        assert not read_checkpoint(tmp_path / "ck" / folder).passed_over
    assert (tmp_path / "ck" / TRACKER).read_text().strip() == str(steps)


def two_ranks(run_dir: Path, steps: int, *flags: str) -> tuple[int, str, str]:
    """`paratron train` of the debug model on two processes for `steps` steps, with `flags`."""
    return finish(start(*RUN, "--nproc", "2", "--train-iters", str(steps), "--run-dir", str(run_dir), *flags, *QUIET))


def test_a_spent_restart_budget_is_one_final_line_and_keeps_the_checkpoint(tmp_path):
    save = ["--save", str(tmp_path / "ck"), "--save-interval", "1"]
    code, _, err = two_ranks(tmp_path, 4, *save, "--max-restarts", "1", "--fault-inject", "1:2:crash", "0:2:crash")
    assert code == 1
    assert (
        err.strip().splitlines()[-1]
        == "error: rank 0 was killed by SIGKILL after 1 restarts (--max-restarts); the job stopped"
    )
    assert "Traceback" not in err
    assert err.count("a rank failed: restarting the workers (1 of 1, --max-restarts)") == 1
    assert read_checkpoint(tmp_path / "ck").iteration == 1


def test_a_hang_is_reported_by_every_rank_that_can_speak(tmp_path):
    """Rank 1 stops answering before step 3; within --distributed-timeout-minutes (3 s here) rank 0
    names the collective it waits in, its group, and rank 1 as the one that did not arrive; rank 1
    says where it is; the job ends (no silent hang)."""
    code, _, err = two_ranks(tmp_path, 4, "--fault-inject", "1:3:hang", "--distributed-timeout-minutes", "0.05")
    assert code == 1
    lines = err.strip().splitlines()
    head = "step 3: no progress in 0.05 min (--distributed-timeout-minutes); "
    zero = next(line for line in lines if line.startswith("[rank 0] "))
    assert zero.startswith(f"[rank 0] {head}waiting in bucket.work.wait() over the dp_cp group (ranks [0, 1]) at ")
    assert zero.endswith("; did not arrive: 1 (at training/faults.py:43 injected (time.sleep(3600)))")
    one = next(line for line in lines if line.startswith("[rank 1] "))
    assert (
        one == f"[rank 1] {head}this rank is not in a collective: at training/faults.py:43 injected (time.sleep(3600))"
    )
    assert lines[-1] == "error: rank 0 exited with code 1; the job stopped" and "Traceback" not in err


def test_nodes_that_disagree_on_the_world_stop_in_one_line(tmp_path):
    port = str(free_port())

    def node(rank: int, nodes: str) -> subprocess.Popen:
        meet = ["--nnodes", nodes, "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", port]
        return start(*RUN, "--nproc", "2", *meet, "--rdzv-timeout-seconds", "20", "--run-dir", str(tmp_path), *QUIET)

    results = [finish(process, timeout=120) for process in (node(0, "2"), node(1, "3"))]
    for rank, (code, _, err) in enumerate(results):
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, err[-2000:]
        other = "node 1 has 3x2" if rank == 0 else "node 0 has 2x2"
        assert lines[0].startswith("error: the nodes disagree on the world (--nnodes x --nproc): ")
        assert other in lines[0] and lines[0].endswith("start every node with the same --nnodes and --nproc")
