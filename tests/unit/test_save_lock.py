"""One writer at a time in a --save folder (checkpoint/lock.py): a live holder stops a second job
in one line, a gone one is taken over with a note, another host's is refused with the way out,
and the lock goes when its job ends, however it ends."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from paratron import cli
from paratron.checkpoint.lock import LOCK_NAME, SaveLock, job_key, process_start_time
from paratron.config.schema import ParallelConfig
from paratron.errors import CheckpointError

SINCE = "2030-01-02T03:04:05+00:00"
TRAIN = [
    "train",
    "--config",
    "debug",
    "--train-iters",
    "1",
    "--lr-warmup-iters",
    "0",
    "--eval-iters",
    "0",
    "--no-progress-bar",
    "--no-tensorboard",
]


def plant(folder: Path, pid: int, host: str | None = None, started: str | None = None, job: str = "other") -> Path:
    """A lock as another job would have left it."""
    folder.mkdir(parents=True, exist_ok=True)
    holder = {"host": host or socket.gethostname(), "pid": pid, "started": started, "since": SINCE, "job": job}
    path = folder / LOCK_NAME
    path.write_text(json.dumps(holder) + "\n")
    return path


def gone_pid() -> int:
    """The pid of a process that has ended (and been collected)."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def holder_pid(folder: Path) -> int:
    return json.loads((folder / LOCK_NAME).read_text())["pid"]


@pytest.mark.parametrize("launch", [[], ["--nproc", "2"]], ids=["one-process", "launcher"])
def test_a_live_lock_stops_the_second_job_in_one_line(tmp_path, capsys, launch):
    """Alone (rank 0 takes it) or with --nproc 2 (the launcher takes it, before any worker starts)."""
    live = os.getppid()
    lock = plant(tmp_path / "ck", live, started=process_start_time(live))
    before = lock.read_text()
    code = cli.main([*TRAIN, *launch, "--save", str(tmp_path / "ck"), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines() == [
        f"error: --save {tmp_path / 'ck'}: another job is writing there (host {socket.gethostname()}, pid {live}, "
        f"since {SINCE}); wait for it to end or stop it, or give this run another --save folder"
    ]
    assert lock.read_text() == before  # (left to its holder)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_gone_holder_is_taken_over_with_a_note_and_the_lock_goes_when_the_run_ends(tmp_path, capsys):
    dead = gone_pid()
    plant(tmp_path / "ck", dead, started="1")
    code = cli.main([*TRAIN, "--save", str(tmp_path / "ck"), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 0, err
    assert (
        f"note: --save {tmp_path / 'ck'}: took over the lock of a job that is gone "
        f"(host {socket.gethostname()}, pid {dead}, since {SINCE})"
    ) in err.splitlines()
    assert (tmp_path / "ck" / "iter_0000001").is_dir()
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["iter_0000001", "latest_checkpointed_iteration.txt"]


def test_a_reused_pid_is_not_the_holder(tmp_path, capsys):
    """The holder's pid runs, but it is another process: it started at another time."""
    live = os.getppid()
    plant(tmp_path, live, started="1")
    with SaveLock(tmp_path):
        assert holder_pid(tmp_path) == os.getpid()
    assert "took over the lock of a job that is gone" in capsys.readouterr().err
    assert not (tmp_path / LOCK_NAME).exists()


def test_another_hosts_lock_is_refused_with_how_to_remove_it(tmp_path):
    lock = plant(tmp_path, 4242, host="node-elsewhere-7")
    with pytest.raises(CheckpointError) as refused:
        SaveLock(tmp_path).acquire()
    assert str(refused.value) == (
        f"--save {tmp_path}: locked by a job on host node-elsewhere-7 (pid 4242, since {SINCE}), which cannot be "
        f"checked from {socket.gethostname()}; if that job is gone, delete {lock} and start again, else give this "
        "run another --save folder"
    )
    assert holder_pid(tmp_path) == 4242


def test_an_unreadable_lock_is_refused_in_one_line(tmp_path):
    (tmp_path / LOCK_NAME).write_text("{not json")
    with pytest.raises(CheckpointError, match=r"its lock .*paratron.lock is unreadable; if no job is writing there"):
        SaveLock(tmp_path).acquire()


@pytest.mark.parametrize("ending", [None, RuntimeError, KeyboardInterrupt])
def test_the_lock_is_released_however_the_job_ends(tmp_path, ending):
    folder = tmp_path / "new" / "ck"  # (created by the lock)
    try:
        with SaveLock(folder) as lock:
            held = json.loads((folder / LOCK_NAME).read_text())
            assert (held["pid"], held["host"], held["job"]) == (os.getpid(), socket.gethostname(), lock.job)
            assert held["started"] == process_start_time(os.getpid()) and held["since"]
            if ending is not None:
                raise ending
    except (RuntimeError, KeyboardInterrupt):
        pass
    assert not folder.exists()  # (the lock made it, and nothing else was written there)
    kept = tmp_path / "kept"
    kept.mkdir()
    SaveLock(kept).acquire().release()
    assert kept.is_dir() and list(kept.iterdir()) == []  # (a folder that was there stays)


def test_a_lock_taken_over_meanwhile_is_left_to_its_new_holder(tmp_path):
    lock = SaveLock(tmp_path).acquire()
    plant(tmp_path, os.getppid(), job="newcomer")
    lock.release()
    assert holder_pid(tmp_path) == os.getppid()


def test_the_nodes_of_one_job_share_the_lock_and_other_jobs_do_not(tmp_path):
    nodes = ParallelConfig(nnodes=2, nproc_per_node=2, master_addr="10.0.0.1", master_port=29500)
    assert job_key(nodes) == job_key(nodes) == "paratron@10.0.0.1:29500"
    assert job_key(ParallelConfig(nproc_per_node=2)) != job_key(ParallelConfig(nproc_per_node=2))
    first = SaveLock(tmp_path, job=job_key(nodes)).acquire()
    second = SaveLock(tmp_path, job=job_key(nodes)).acquire()  # (another node's launcher)
    with pytest.raises(CheckpointError, match="another job is writing there"):
        SaveLock(tmp_path).acquire()
    second.release()
    assert holder_pid(tmp_path) == os.getpid()  # (the node that took it releases it)
    first.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_save_folder_that_cannot_be_written_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match=r"^--save .*file/ck: cannot take its lock \(.*\); give a folder"):
        SaveLock(tmp_path / "file" / "ck").acquire()
