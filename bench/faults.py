"""What surviving faults costs, on this machine, against torchrun's own restarts.

    python bench/faults.py --output bench/results/faults.json
    python bench/faults.py --smoke  # one kill, one trial, every job at once: does it still run, with its outcomes?

(--smoke's uninterrupted run, whose losses alone it uses, runs on two ranks forked from
`run_ranks`' server: a launch costs three interpreters, each seconds of CPU importing torch.)

- Restarts: the debug model on 2 processes, --train-iters 16 with a checkpoint every 2 steps,
  once uninterrupted and once with --kills SIGKILLs of a seeded random rank at seeded random steps
  (--fault-inject, --max-restarts); the extra wall time per kill (the agent noticing, stopping and
  restarting the processes, the resume, the steps redone), and whether the losses are the
  uninterrupted run's.
- The peer: a plain script under `torchrun --standalone --max-restarts 2` on gloo whose rank 1
  dies once after the first collective, --trials times with torchrun's default (the agent's
  store shared by every attempt) and with a store per attempt (paratron's launcher): how often
  the restarted workers meet and finish.
- A hang: rank 1 stops answering at step 3 under --distributed-timeout-minutes 0.05 (3 s); the
  time until the job has ended with every rank's report.
- A killed launcher: SIGKILL of the launcher's process group once its workers train, --trials
  times: how long `paratron train --nproc 2`'s workers outlive it, against a plain script's
  workers under `torchrun --standalone --nproc-per-node 2` (alive or not --outlive s later).

Every job runs under a deadline, and once it has ended or been given up on, no process of it is
left (`end_job`): a trial that hangs is recorded as such and cannot stall the benchmark or leave
workers behind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from common import add_smoke_argument, apply_smoke
from paratron.cli import main as paratron_main
from paratron.distributed.local_ranks import run_ranks

REPO = Path(__file__).resolve().parents[1]
STORE_PER_ATTEMPT = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
RUN = ["train", "--config", "debug", "--nproc", "2", "--lr-warmup-iters", "1", "--eval-iters", "0"]
QUIET = ["--no-progress-bar", "--no-tensorboard", "--log-interval", "1"]


@dataclass
class Ended:
    """How a job ended: its exit code (None: still running at its deadline, then killed), output and time."""

    returncode: int | None
    stdout: str
    stderr: str
    seconds: float


def _running(pid: int) -> bool:
    """Whether `pid` runs (not ended, not dead awaiting collection), from /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


JOB_MARK = "PARATRON_BENCH_JOB"
"""Set in a job's environment, which every process it starts inherits: torch's agent starts each
worker in a session of its own, and an orphan is reparented, so neither the process group nor the
parent chain finds them all."""


def _marked(mark: str) -> list[int]:
    """The running processes whose environment holds JOB_MARK=`mark`."""
    needle = f"{JOB_MARK}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return [pid for pid in found if _running(pid)]


def start_job(command: list[str], env: dict[str, str] | None = None, **popen: Any) -> tuple[subprocess.Popen, str]:
    """Start `command` in a session of its own, marked so that `end_job` finds every process of it."""
    mark = uuid.uuid4().hex
    job = subprocess.Popen(
        command, cwd=REPO, env={**(env or os.environ), JOB_MARK: mark}, text=True, start_new_session=True, **popen
    )
    return job, mark


def end_job(mark: str, within: float = 10.0) -> None:
    """SIGKILL every process of the job marked `mark` until none is left (a sweep can miss one being
    started at that moment; the next catches it)."""
    deadline = time.monotonic() + within
    while (left := _marked(mark)) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def run_job(command: list[str], timeout: float, env: dict[str, str] | None = None) -> Ended:
    """Run `command` until it ends or `timeout` s pass, its output in files (a worker that outlived
    it cannot hold a pipe open and stall the reader); then no process of it is left running."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        job, mark = start_job(command, env, stdout=out, stderr=err)
        try:
            returncode: int | None = job.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            returncode = None
        seconds = time.perf_counter() - start
        end_job(mark)
        job.wait()
        out.seek(0), err.seek(0)
        return Ended(returncode, out.read(), err.read(), seconds)


def paratron(*args: str, timeout: float = 900) -> Ended:
    return run_job([sys.executable, "-m", "paratron", *args], timeout)


def paratron_on_forked_ranks(*args: str) -> Ended:
    """`paratron(*args)` of a run with --nproc N, its N workers forked from `run_ranks`' server as
    torchrun's would run (no launcher: their output goes to this process's)."""
    flags = list(args)
    at = flags.index("--nproc")
    start = time.perf_counter()
    codes = run_ranks(paratron_main, int(flags[at + 1]), [*flags[:at], *flags[at + 2 :]])
    return Ended(max(codes, key=abs), "", "", time.perf_counter() - start)


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def at_once(jobs: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Each job's result, the jobs run side by side (each in a thread; an exception in one is raised here)."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        started = {name: pool.submit(job) for name, job in jobs.items()}
        return {name: future.result() for name, future in started.items()}


def one_by_one(jobs: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Each job's result, the jobs run one after another (timings that no other job disturbs)."""
    return {name: job() for name, job in jobs.items()}


def restarts(
    folder: Path,
    steps: int,
    kills: int,
    seed: int,
    run: Callable[[dict], dict] = one_by_one,
    calm_runner: Callable[..., Ended] = paratron,
) -> dict:
    """The run uninterrupted (started by `calm_runner`) and with `kills` injected crashes: times and losses."""
    common = [*RUN, "--train-iters", str(steps), "--save-interval", "2", *QUIET]
    chance = random.Random(seed)
    faults = [f"{chance.randrange(2)}:{s}:crash" for s in sorted(chance.randint(1, steps) for _ in range(kills))]
    faulty_flags = ["--max-restarts", str(kills), "--fault-inject", *faults]
    ended = run(
        {
            "calm": lambda: calm_runner(*common, "--save", str(folder / "ck0"), "--run-dir", str(folder / "calm")),
            "faulty": lambda: paratron(
                *common, "--save", str(folder / "ck"), "--run-dir", str(folder / "faulty"), *faulty_flags
            ),
        }
    )
    calm, faulty = ended["calm"], ended["faulty"]
    assert calm.returncode == 0, calm.stderr[-2000:]
    assert faulty.returncode == 0, faulty.stderr[-2000:]
    return {
        "steps": steps,
        "kills": kills,
        "faults": faults,
        "uninterrupted_s": calm.seconds,
        "with_kills_s": faulty.seconds,
        "extra_s_per_kill": (faulty.seconds - calm.seconds) / kills,
        "same_losses": losses(folder / "faulty") == losses(folder / "calm"),
    }


PEER = """
import os, signal, time, torch, torch.distributed as dist
attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
if attempt == 0 and rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
for _ in range(3):
    dist.all_reduce(t)
    time.sleep(0.2)
print(f"attempt {attempt} rank {rank}: done", flush=True)
"""


STORES = {"shared store (torchrun's default)": {}, "store per attempt": STORE_PER_ATTEMPT}
"""The rendezvous store settings the peer runs under, by name: their environment."""
SMOKE_STORES = ["store per attempt"]
"""--smoke's: one setting runs the same code as both (each attempt starts torchrun's agent and two
workers, every one of them importing torch)."""


def torchrun_restart(folder: Path, trials: int, timeout: float, stores: list[str] | None = None) -> dict:
    """`trials` runs of PEER under torchrun --max-restarts 2, with each of `stores` (default both): the
    agent's shared store (torchrun's default) and a store per attempt (what paratron's launcher sets):
    how many recovered at the first restart, later, or not at all (failed, or still hanging after
    `timeout` s)."""
    script = folder / "peer.py"
    script.write_text(textwrap.dedent(PEER))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["--max-restarts", "2", str(script)]
    results = {}
    for setting in stores or STORES:
        env = STORES[setting]
        outcomes = {"first restart": 0, "second restart": 0, "failed": 0, "hung": 0}
        for _ in range(trials):
            ended = run_job(command, timeout, {**os.environ, **env})
            if ended.returncode is None:
                outcomes["hung"] += 1
            elif "attempt 1 rank 0: done" in ended.stdout:
                outcomes["first restart"] += 1
            elif "attempt 2 rank 0: done" in ended.stdout:
                outcomes["second restart"] += 1
            else:
                outcomes["failed"] += 1
        results[setting] = outcomes
    return {"torch": __import__("torch").__version__, "trials": trials, "outcomes": results}


def hang(folder: Path) -> dict:
    done = paratron(
        *RUN,
        "--train-iters",
        "4",
        "--run-dir",
        str(folder / "hang"),
        "--fault-inject",
        "1:3:hang",
        "--distributed-timeout-minutes",
        "0.05",
        *QUIET,
        timeout=300,
    )
    reports = [line for line in done.stderr.splitlines() if line.startswith("[rank ")]
    return {"timeout_s": 3.0, "seconds_to_end": done.seconds, "exit_code": done.returncode, "reports": reports}


SLEEPER = """
import os, time
print(os.getpid(), flush=True)
time.sleep(600)
"""


def _workers(parent: int) -> list[int]:
    """The running processes whose parent is `parent`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rpartition(")")[2].split()[1]) == parent:
                found.append(int(entry.name))
        except OSError:
            continue
    return [pid for pid in found if _running(pid)]


NOT_STARTED = "not started"
"""A trial whose job printed no sign of its workers before its deadline (then killed)."""


def _lines(stream: IO[str]) -> tuple[queue.Queue[str | None], threading.Thread]:
    """The lines of `stream`, read by a thread of their own (None at its end), so that the caller
    can wait for one with a deadline."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return lines, reader


def _kill_group_and_watch(
    command: list[str], ready: str, outlive: float, start_within: float, lines: int = 1
) -> float | str | None:
    """Start `command` in a process group of its own, SIGKILL the group once `lines` lines matching
    the pattern `ready` are printed, and return how long its workers outlived it (None: still running
    `outlive` s later; NOT_STARTED: not ready within `start_within` s). Nothing of it is left running."""
    job, mark = start_job(command, stdout=subprocess.PIPE)
    (printed, reader), seen, deadline = _lines(job.stdout), 0, time.monotonic() + start_within
    while seen < lines:
        try:
            line = printed.get(timeout=max(deadline - time.monotonic(), 0))
        except queue.Empty:
            line = None
        if line is None:
            break
        seen += re.search(ready, line) is not None
    workers = _workers(job.pid)
    os.killpg(job.pid, signal.SIGKILL)
    killed = time.perf_counter()
    job.wait()
    outlived: float | str | None = NOT_STARTED if seen < lines else None
    while outlived is None and time.perf_counter() - killed < outlive:
        if not any(_running(pid) for pid in workers):
            outlived = time.perf_counter() - killed
        time.sleep(0.005)
    end_job(mark)
    reader.join(timeout=30)  # (every process that could write has gone: the pipe has ended)
    if not reader.is_alive():  # (closing a pipe another thread reads would wait for that read)
        job.stdout.close()
    return outlived


def killed_launcher(folder: Path, trials: int, outlive: float, start_within: float) -> dict:
    script = folder / "sleeper.py"
    script.write_text(textwrap.dedent(SLEEPER))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    train = [sys.executable, "-m", "paratron", *RUN, "--train-iters", "100000", "--run-dir", str(folder / "killed")]
    ours = [_kill_group_and_watch([*train, *QUIET], r"^step +1/", outlive, start_within) for _ in range(trials)]
    theirs = [_kill_group_and_watch(torchrun, "", outlive, start_within, lines=2) for _ in range(trials)]  # (both pids)
    return {"trials": trials, "outlive_s": outlive, "paratron_s": ours, "torchrun_s": theirs}


def check(results: dict) -> None:
    """--smoke: the run with kills ended as the uninterrupted one, the hang ended with every rank's
    report, and a killed launcher's workers did not outlive the watch."""
    assert results["restarts"]["same_losses"], results["restarts"]
    assert results["hang"]["exit_code"] != 0 and results["hang"]["reports"], results["hang"]
    assert all(isinstance(s, float) for s in results["killed_launcher"]["paratron_s"]), results["killed_launcher"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--seed", type=int, default=19)
    parser.add_argument("--trials", type=int, default=5, help="runs of the torchrun restart, per store setting")
    parser.add_argument("--peer-timeout", type=float, default=60.0)
    parser.add_argument("--outlive", type=float, default=10.0, help="seconds to watch workers after a kill")
    parser.add_argument("--start-within", type=float, default=300.0, help="seconds a killed-launcher job has to start")
    parser.add_argument("--output", type=Path)
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    apply_smoke(args, parser, steps=4, kills=1, trials=1, peer_timeout=6.0, outlive=2.0, start_within=120.0)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    # (--smoke checks outcomes, not timings: its jobs run side by side, each in folders of its own)
    run = at_once if args.smoke else one_by_one
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        results = run(
            {
                "restarts": lambda: restarts(
                    folder, args.steps, args.kills, args.seed, run, paratron_on_forked_ranks if args.smoke else paratron
                ),
                "torchrun_restart": lambda: torchrun_restart(
                    folder, args.trials, args.peer_timeout, SMOKE_STORES if args.smoke else None
                ),
                "hang": lambda: hang(folder),
                "killed_launcher": lambda: killed_launcher(folder, args.trials, args.outlive, args.start_within),
            }
        )
    print(json.dumps(results, indent=2))
    if args.smoke:
        check(results)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
