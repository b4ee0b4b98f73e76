"""Beyond one machine, as a user runs it: two launch agents on this machine as two nodes over
loopback, and a run that loses a rank again and again (--fault-inject, --max-restarts) and still
ends with the uninterrupted run's losses and intact checkpoints."""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from paratron.checkpoint.files import TRACKER
from paratron.checkpoint.lock import LOCK_NAME
from paratron.checkpoint.verify import read_checkpoint
from paratron.cli import main
from paratron.distributed.local_ranks import free_port, run_ranks
from paratron.distributed.watchdog import Watchdog

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
    # one node's four ranks, forked here: the workers' own entry point, without four more imports of torch
    assert run_ranks(main, 4, [*RUN, *steps, "--run-dir", str(tmp_path / "one")]) == [0, 0, 0, 0]
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


def test_a_node_rank_out_of_range_is_one_line(capsys):
    assert main([*RUN, "--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1", *QUIET]) == 2
    assert capsys.readouterr().err.strip() == "error: --node-rank 2 is out of range for --nnodes 2: use 0 to 1"


def test_an_unreachable_master_is_one_line(tmp_path):
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


STEPS = 8
WORKER = [*RUN, "--train-iters", str(STEPS), "--save-interval", "2", *QUIET]
"""What each of `BROKEN`'s two workers runs."""
BROKEN = [*RUN, "--nproc", "2", "--train-iters", str(STEPS), "--save-interval", "2", *QUIET]
"""The run the fault tests break again and again (a checkpoint every 2 steps)."""


@pytest.fixture(scope="module")
def calm(tmp_path_factory) -> dict[int, float]:
    """The losses of `BROKEN` left alone, step by step: trained once for every test that compares, on
    two ranks forked here (the workers' own entry point, without a launcher's and two workers' imports)."""
    root = tmp_path_factory.mktemp("calm")
    assert run_ranks(main, 2, [*WORKER, "--save", str(root / "ck"), "--run-dir", str(root / "run")]) == [0, 0]
    return losses(root / "run")


def test_a_run_that_loses_a_rank_ten_times_ends_as_the_uninterrupted_one(tmp_path, calm):
    """Ten kills in one bounded run (SIGKILL of a seeded random rank at a seeded random step, one per attempt, the
    steps in order so that each fires: the first at step 1, before any checkpoint, the last at the last step,
    between checkpoints), --max-restarts 10, a checkpoint every 2 steps: every restart resumes from the newest
    intact checkpoint (or starts afresh before the first), and the losses are the uninterrupted run's."""
    steps, kills = STEPS, 10
    chance = random.Random(10)
    at = [1, *sorted(chance.randint(1, steps) for _ in range(kills - 2)), steps]
    faults = [f"{chance.randrange(2)}:{step}:crash" for step in at]
    code, out, err = finish(
        start(
            *BROKEN,
            "--save",
            str(tmp_path / "ck"),
            "--run-dir",
            str(tmp_path / "faulty"),
            "--max-restarts",
            str(kills),
            "--fault-inject",
            *faults,
        ),
        timeout=600,
    )
    assert code == 0, err[-3000:]
    # a restart per kill, each said by the launcher (a worker's own banner can die with it, unprinted)
    restarts = [line for line in err.splitlines() if line.startswith("a rank failed: restarting the workers")]
    assert [line.split("(")[1].split(",")[0] for line in restarts] == [f"{k} of {kills}" for k in range(1, kills + 1)]
    assert 1 <= out.count("paratron: world 2") <= kills + 1
    assert losses(tmp_path / "faulty") == calm
    # every checkpoint is whole, and the tracker names the last
    folders = sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith("iter_"))
    assert folders == [f"iter_{i:07d}" for i in range(2, steps + 1, 2)]
    for folder in folders:
        assert not read_checkpoint(tmp_path / "ck" / folder).passed_over
    assert (tmp_path / "ck" / TRACKER).read_text().strip() == str(steps)


def job_processes(save: Path) -> dict[int, str]:
    """The running processes (not the dead awaiting collection) whose command line names `save`:
    a job's launcher and its workers."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):  # (not a process, or one that just ended)
            continue
        if str(save).encode() in argv and state != "Z":
            found[int(entry.name)] = b" ".join(argv[:5]).decode()
    return found


class Attempt:
    """One start of a job in a process group of its own, its output read as it comes."""

    def __init__(self, command: list[str]) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self.arrived: queue.Queue[str] = queue.Queue()
        self.readers = [
            threading.Thread(target=self._read, args=(self.process.stdout, self.out, True), daemon=True),
            threading.Thread(target=self._read, args=(self.process.stderr, self.err, False), daemon=True),
        ]
        for reader in self.readers:
            reader.start()

    def _read(self, stream, lines: list[str], tell: bool) -> None:
        for line in stream:  # (until every process holding the pipe has closed it)
            lines.append(line)
            if tell:
                self.arrived.put(line)

    def kill(self, seconds: float, until: Callable[[str], bool], delay: float) -> dict[int, str]:
        """SIGKILL the launcher's process group `delay` s after the first line of output `until` accepts,
        or at `seconds` after the start if that comes first; its workers at that moment (their pids)."""
        deadline, seen = time.monotonic() + seconds, False
        while not seen and time.monotonic() < deadline and self.process.poll() is None:
            try:
                seen = until(self.arrived.get(timeout=0.02))
            except queue.Empty:
                continue
        time.sleep(delay if seen else 0)
        assert self.process.poll() is None, f"the job ended before its kill:\n{''.join(self.err)[-3000:]}"
        workers = children(self.process.pid)
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        return workers

    def drained(self, timeout: float) -> bool:
        """Whether both pipes closed (no process of the job holds them any more) within `timeout` s."""
        for reader in self.readers:
            reader.join(timeout)
        return not any(reader.is_alive() for reader in self.readers)


def children(parent: int) -> set[int]:
    """The running processes whose parent is `parent`, from /proc."""
    return {pid for pid, (state, ppid) in process_table().items() if ppid == parent and state != "Z"}


def process_table() -> dict[int, tuple[str, int]]:
    """Every process's state and parent, from /proc."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:  # (not a process, or one that just ended)
            continue
        table[int(entry.name)] = (fields[0], int(fields[1]))
    return table


def still_running(pids: set[int], within: float) -> set[int]:
    """Those of `pids` still running (not ended, not dead awaiting collection) after `within` s."""
    deadline = time.monotonic() + within
    while True:
        table = process_table()
        running = {pid for pid in pids if pid in table and table[pid][0] != "Z"}
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.01)


def lock_holder(save: Path) -> int | None:
    lock = save / LOCK_NAME
    return json.loads(lock.read_text())["pid"] if lock.exists() else None


def test_a_killed_launcher_takes_its_workers_with_it_and_a_save_folder_has_one_writer(tmp_path, calm, capfd):
    """Three times the launcher's process group is SIGKILLed at a seeded random moment (starting up,
    training, just after a save; never so late that the run could end first), and the job is started
    again with the same flags (the second time under plain torchrun, where rank 0 holds the lock).
    Every worker ends with its launcher, a lock left behind is taken over with a note, no
    checkpoint is saved by two jobs, and the run ends with the uninterrupted run's losses (its last
    start, never killed, on two ranks forked here as torchrun's workers: what it proves lies in the
    files it leaves, and a launch costs three interpreters)."""
    save = tmp_path / "ck"
    flags = [*BROKEN, "--save", str(save), "--load", str(save), "--run-dir", str(tmp_path / "run")]
    at = flags.index("--nproc")  # (a worker's flags: torchrun's --nproc-per-node instead)
    as_worker = [*flags[:at], *flags[at + 2 :]]
    by_torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    by_torchrun += ["-m", "paratron", *as_worker]
    chance = random.Random(15)
    kinds = chance.sample(["start", "step", "save"], 3)
    outputs = []
    for attempt, kind in enumerate(kinds):
        left = lock_holder(save)
        resumed = int((save / TRACKER).read_text()) if (save / TRACKER).exists() else 0
        job = Attempt(by_torchrun if attempt == 1 else [sys.executable, "-m", "paratron", *flags])
        if kind == "start" or resumed + 2 >= STEPS:  # starting: the launcher, the lock, the workers, the model
            workers = job.kill(chance.uniform(0.3, 4.0), lambda line: line.startswith("paratron: world"), 0.0)
        else:  # up to 50 ms after its first step's line, or after its first save's (never the run's last)
            first = f"step {resumed + 1}/" if kind == "step" else f"saved checkpoint {save / f'iter_{resumed + 2:07d}'}"
            workers = job.kill(120.0, lambda line, first=first: line.startswith(first), chance.uniform(0.0, 0.05))
            assert len(workers) == 2, workers
        # within seconds (orphans would go on: train, save, finish the run, draw the loss curve)
        assert still_running(workers, within=5.0) == set(), f"attempt {attempt}: workers outlived their launcher"
        assert job.drained(10) and job_processes(save) == {}, job_processes(save)
        outputs.append("".join(job.out))
        assert "done:" not in outputs[-1]  # (nothing finished the run behind the next job's back)
        taker = lock_holder(save)
        if left is not None and taker not in (None, left):  # (it came as far as taking the lock)
            note = f"took over the lock of a job that is gone (host {socket.gethostname()}, pid {left}, since "
            assert note in "".join(job.err), "".join(job.err)[-2000:]
    capfd.readouterr()
    assert run_ranks(main, 2, as_worker) == [0, 0]
    out = capfd.readouterr().out
    assert losses(tmp_path / "run") == calm
    lines = "".join([*outputs, out]).splitlines()
    saved = [line.split("iter_")[1].strip() for line in lines if line.startswith("saved checkpoint")]
    # each step saved once (a job killed between its save and its line leaves the line out: the tracker says the rest)
    assert sorted(saved) == sorted(set(saved)) and saved, saved
    assert not (save / LOCK_NAME).exists() and job_processes(save) == {}
    assert (save / TRACKER).read_text().strip() == str(STEPS)


def test_a_worker_whose_launcher_is_already_gone_stops_at_once():
    """A launcher that died before its worker could ask to end with it: the worker's parent is not
    the launcher the environment names, so it stops before doing anything."""
    ended = subprocess.Popen(["true"])
    ended.wait()
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", PARATRON_LAUNCHER_PID=str(ended.pid))
    work = "import os; from paratron.distributed.parent import end_with_launcher as end; end(os.getppid()); print('on')"
    done = subprocess.run([sys.executable, "-c", work], env=env, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (1, "", "[rank 1] stopped: its launcher is gone\n")


def test_a_worker_arms_its_parent_death_signal_before_importing_torch():
    """`python -m paratron` in a worker checks its launcher and asks to end with it before it imports
    torch (seconds on a busy machine, in which a killed launcher would leave it behind)."""
    ended = subprocess.Popen(["true"])
    ended.wait()
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", PARATRON_LAUNCHER_PID=str(ended.pid))
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "paratron", "train", "--config", "demo"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert done.returncode == 1 and "[rank 1] stopped: its launcher is gone" in done.stderr, done.stderr[-2000:]
    assert "paratron.distributed.parent" in imported and not [name for name in imported if name.startswith("torch")]


def test_the_watchdog_stops_a_worker_whose_parent_changed(monkeypatch, capsys):
    """Where the system sends no signal when the launcher dies, the watchdog's thread sees that the
    worker's parent is no longer the one it started under."""
    exits = queue.Queue()
    watchdog = Watchdog(600, 3, 4, None, parent=os.getppid() + 1)

    def stop_watching(code: int) -> None:  # (instead of ending the test's process: the watchdog stops)
        exits.put(code)
        watchdog.__exit__(None, None, None)

    monkeypatch.setattr(os, "_exit", stop_watching)
    with watchdog:
        assert exits.get(timeout=10) == 1
    assert capsys.readouterr().err == f"[rank 3] stopped: its launcher (pid {os.getppid() + 1}) is gone\n"


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


def _line_of(text: str, module: str) -> int:
    """The line of src/paratron/MODULE that holds `text` (the watchdog names a rank's place by file and line)."""
    source = (Path(__file__).resolve().parents[2] / "src" / "paratron" / module).read_text(encoding="utf-8")
    return next(number for number, line in enumerate(source.splitlines(), 1) if text in line)


def test_a_hang_is_reported_by_every_rank_that_can_speak(tmp_path):
    """Rank 1 stops answering before step 3; within --distributed-timeout-minutes (9 s here) rank 0
    names the collective it waits in, its group, and rank 1 as the one that did not arrive; rank 1
    says where it is; the job ends (no silent hang)."""
    code, _, err = two_ranks(tmp_path, 4, "--fault-inject", "1:3:hang", "--distributed-timeout-minutes", "0.15")
    assert code == 1
    lines = err.strip().splitlines()
    head = "step 3: no progress in 0.15 min (--distributed-timeout-minutes); "
    hang_line = _line_of("time.sleep(3600)", "training/faults.py")
    zero = next(line for line in lines if line.startswith("[rank 0] "))
    assert zero.startswith(f"[rank 0] {head}waiting in bucket.work.wait() over the dp_cp group (ranks [0, 1]) at ")
    assert zero.endswith(f"; did not arrive: 1 (at training/faults.py:{hang_line} injected (time.sleep(3600)))")
    one = next(line for line in lines if line.startswith("[rank 1] "))
    assert (
        one == f"[rank 1] {head}this rank is not in a collective: "
        f"at training/faults.py:{hang_line} injected (time.sleep(3600))"
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
