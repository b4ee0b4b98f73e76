"""What `paratron debug compare` costs, against the two plain training runs a user would otherwise
start and diff by hand.

    python bench/debug_compare.py --output bench/results/debug_compare.json
    python bench/debug_compare.py --smoke  # the debug model, one round: does it still run and agree?

(--smoke trains its plain runs in this process, through the command's own entry point: the compare
alone starts interpreters, three of them, each seconds of CPU importing torch.)

A: the model on 2 processes with tensor parallelism 2 (--layout); B: the same run on one process.
Plain: `paratron train` of A then B, --steps steps each, no evaluation (what a user runs before
comparing metrics.jsonl by eye). Compare: `paratron debug compare --steps K -- "<A>"`, which checks
both runs' flags, trains both with --debug-capture (every module output and gradient of each step)
and compares them. The ratio compare / plain is the price of the answer (which module, which step)
over the two runs alone; the median of --rounds rounds of each, alternated.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from common import add_smoke_argument, apply_smoke
from paratron.cli import main as paratron_main

REPO = Path(__file__).resolve().parents[1]
QUIET = "--no-progress-bar --no-tensorboard"


def _run(args: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "paratron", *args], cwd=REPO, env=env, capture_output=True, text=True)
    return time.perf_counter() - start, done


def _run_in_process(args: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    """`_run` in this process, through `paratron`'s entry point (its output goes to this process's)."""
    start = time.perf_counter()
    code = paratron_main(args)
    return time.perf_counter() - start, subprocess.CompletedProcess(args, code, "", "")


def plain_runs(model: str, layout: str, steps: int, folder: Path, run: Callable = _run) -> float:
    """Wall seconds of the two plain runs, A then B, each started by `run`."""
    total = 0.0
    for label, flags in (("A", f"{model} {layout}"), ("B", model)):
        seconds, done = run(
            [
                "train",
                *flags.split(),
                *QUIET.split(),
                "--train-iters",
                str(steps),
                "--eval-iters",
                "0",
                "--run-dir",
                str(folder / label),
            ]
        )
        if done.returncode != 0:
            raise RuntimeError(f"plain run {label} failed: {done.stderr[-2000:]}")
        total += seconds
    return total


def compare_run(model: str, layout: str, steps: int) -> tuple[float, str]:
    """Wall seconds of the compare, and its verdict line."""
    seconds, done = _run(["debug", "compare", "--steps", str(steps), "--", f"{model} {layout} {QUIET}"])
    if done.returncode != 0:
        raise RuntimeError(f"the compare exited {done.returncode}: {done.stdout[-2000:]} {done.stderr[-2000:]}")
    return seconds, done.stdout.splitlines()[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        default="--config debug --num-layers 4 --hidden-size 256 --num-attention-heads 8 --ffn-hidden-size 1024 "
        "--seq-length 256 --micro-batch-size 4 --global-batch-size 8",
    )
    parser.add_argument("--layout", default="--nproc 2 --tensor-model-parallel-size 2")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path)
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    # (the smoke's A differs from B by recomputation only: one process each, the suite's time kept short)
    smoke_layout = "--recompute-granularity full --recompute-method uniform"
    apply_smoke(args, parser, model="--config debug --seq-length 16", layout=smoke_layout, steps=1, rounds=1)
    plain, compare, verdict = [], [], ""
    with tempfile.TemporaryDirectory() as tmp:
        for round_number in range(args.rounds):
            folder = Path(tmp) / f"plain{round_number}"
            plain.append(
                plain_runs(args.model, args.layout, args.steps, folder, _run_in_process if args.smoke else _run)
            )
            seconds, verdict = compare_run(args.model, args.layout, args.steps)
            compare.append(seconds)
    results = {
        "model": args.model,
        "layout": args.layout,
        "steps": args.steps,
        "rounds": args.rounds,
        "plain_runs_s": statistics.median(plain),
        "compare_s": statistics.median(compare),
        "ratio": statistics.median(compare) / statistics.median(plain),
        "verdict": verdict,
        "cpus": os.cpu_count(),
    }
    print(json.dumps(results, indent=2))
    if not verdict.startswith("the runs agree"):
        raise SystemExit(f"the layouts should agree: {verdict}")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
