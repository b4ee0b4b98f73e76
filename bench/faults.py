"""What surviving faults costs, on this machine, against torchrun's own restarts.

    python bench/faults.py --output bench/results/faults.json
    python bench/faults.py --smoke  # one kill, one trial each: does it still run, with its outcomes?

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
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from common import add_smoke_argument, apply_smoke

REPO = Path(__file__).resolve().parents[1]
STORE_PER_ATTEMPT = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
RUN = ["train", "--config", "debug", "--nproc", "2", "--lr-warmup-iters", "1", "--eval-iters", "0"]
QUIET = ["--no-progress-bar", "--no-tensorboard", "--log-interval", "1"]


def paratron(*args: str, timeout: float = 900) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "paratron", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    return time.perf_counter() - start, done


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def restarts(folder: Path, steps: int, kills: int, seed: int) -> dict:
    common = [*RUN, "--train-iters", str(steps), "--save-interval", "2", *QUIET]
    calm_s, calm = paratron(*common, "--save", str(folder / "ck0"), "--run-dir", str(folder / "calm"))
    assert calm.returncode == 0, calm.stderr[-2000:]
    chance = random.Random(seed)
    faults = [f"{chance.randrange(2)}:{s}:crash" for s in sorted(chance.randint(1, steps) for _ in range(kills))]
    faulty_s, faulty = paratron(
        *common,
        "--save",
        str(folder / "ck"),
        "--run-dir",
        str(folder / "faulty"),
        "--max-restarts",
        str(kills),
        "--fault-inject",
        *faults,
    )
    assert faulty.returncode == 0, faulty.stderr[-2000:]
    return {
        "steps": steps,
        "kills": kills,
        "faults": faults,
        "uninterrupted_s": calm_s,
        "with_kills_s": faulty_s,
        "extra_s_per_kill": (faulty_s - calm_s) / kills,
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


def _run_group(command: list[str], timeout: float, env: dict[str, str]) -> str | None:
    """Run `command` in a process group of its own and return its output; None when it was still
    running after `timeout` s (then the whole group is killed: torchrun's workers with their agent,
    which killing the agent alone would leave running)."""
    job = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True
    )
    try:
        return job.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate()
        return None


def torchrun_restart(folder: Path, trials: int, timeout: float) -> dict:
    """`trials` runs of PEER under torchrun --max-restarts 2, with the agent's shared store (torchrun's
    default) and with a store per attempt (what paratron's launcher sets): how many recovered at
    the first restart, later, or not at all (failed, or still hanging after `timeout` s)."""
    script = folder / "peer.py"
    script.write_text(textwrap.dedent(PEER))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["--max-restarts", "2", str(script)]
    results = {}
    for setting, env in (("shared store (torchrun's default)", {}), ("store per attempt", STORE_PER_ATTEMPT)):
        outcomes = {"first restart": 0, "second restart": 0, "failed": 0, "hung": 0}
        for _ in range(trials):
            stdout = _run_group(command, timeout, {**os.environ, **env})
            if stdout is None:
                outcomes["hung"] += 1
            elif "attempt 1 rank 0: done" in stdout:
                outcomes["first restart"] += 1
            elif "attempt 2 rank 0: done" in stdout:
                outcomes["second restart"] += 1
            else:
                outcomes["failed"] += 1
        results[setting] = outcomes
    return {"torch": __import__("torch").__version__, "trials": trials, "outcomes": results}


def hang(folder: Path) -> dict:
    seconds, done = paratron(
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
    return {"timeout_s": 3.0, "seconds_to_end": seconds, "exit_code": done.returncode, "reports": reports}


SLEEPER = """
import os, time
print(os.getpid(), flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    """Whether `pid` runs (not ended, not dead awaiting collection), from /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


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


def _kill_group_and_watch(command: list[str], ready: str, outlive: float, lines: int = 1) -> float | None:
    """Start `command` in a process group of its own, SIGKILL the group once `lines` lines matching
    the pattern `ready` are printed, and return how long its workers outlived it (None: still running
    `outlive` s later; then killed)."""
    job = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True, start_new_session=True)
    seen = 0
    for line in job.stdout:
        seen += re.search(ready, line) is not None
        if seen == lines:
            break
    workers = _workers(job.pid)
    os.killpg(job.pid, signal.SIGKILL)
    killed = time.perf_counter()
    job.wait()
    while time.perf_counter() - killed < outlive:
        if not any(_running(pid) for pid in workers):
            return time.perf_counter() - killed
        time.sleep(0.005)
    for pid in workers:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)
    return None


def killed_launcher(folder: Path, trials: int, outlive: float) -> dict:
    script = folder / "sleeper.py"
    script.write_text(textwrap.dedent(SLEEPER))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    train = [sys.executable, "-m", "paratron", *RUN, "--train-iters", "100000", "--run-dir", str(folder / "killed")]
    ours = [_kill_group_and_watch([*train, *QUIET], r"^step +1/", outlive) for _ in range(trials)]
    theirs = [_kill_group_and_watch(torchrun, "", outlive, lines=2) for _ in range(trials)]  # (both pids)
    return {"trials": trials, "outlive_s": outlive, "paratron_s": ours, "torchrun_s": theirs}


def check(results: dict) -> None:
    """--smoke: the run with kills ended as the uninterrupted one, the hang ended with every rank's
    report, and a killed launcher's workers did not outlive the watch."""
    assert results["restarts"]["same_losses"], results["restarts"]
    assert results["hang"]["exit_code"] != 0 and results["hang"]["reports"], results["hang"]
    assert None not in results["killed_launcher"]["paratron_s"], results["killed_launcher"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--seed", type=int, default=19)
    parser.add_argument("--trials", type=int, default=5, help="runs of the torchrun restart, per store setting")
    parser.add_argument("--peer-timeout", type=float, default=60.0)
    parser.add_argument("--outlive", type=float, default=10.0, help="seconds to watch workers after a kill")
    parser.add_argument("--output", type=Path)
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    apply_smoke(args, parser, steps=4, kills=1, trials=1, peer_timeout=15.0, outlive=2.0)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        results = {
            "restarts": restarts(folder, args.steps, args.kills, args.seed),
            "torchrun_restart": torchrun_restart(folder, args.trials, args.peer_timeout),
            "hang": hang(folder),
            "killed_launcher": killed_launcher(folder, args.trials, args.outlive),
        }
    print(json.dumps(results, indent=2))
    if args.smoke:
        check(results)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
