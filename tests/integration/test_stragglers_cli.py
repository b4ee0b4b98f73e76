"""--straggler-threshold and --profile on two ranks, through `paratron train`'s entry point as each
worker runs it: a rank made slow for one step (--fault-inject RANK:STEP:slow) is named with the group
it delays, on that log interval only, and the profiled steps of both ranks come out as one timeline.
Both happen in the workers, so the ranks are forked gloo ranks (`run_ranks`): a launcher and its two
workers would cost three imports of torch."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from paratron.cli import main
from paratron.distributed.local_ranks import run_ranks


@pytest.mark.spawns
def test_a_slow_rank_is_named_and_both_ranks_profiles_are_merged(tmp_path, capfd):
    run = tmp_path / "run"
    args = ["train", "--config", "debug", "--train-iters", "9", "--log-interval", "3"]
    args += ["--eval-iters", "0", "--lr-warmup-iters", "1", "--run-dir", str(run), "--no-progress-bar"]
    # steps of ~0.1 s (hidden 256, 128 tokens); the slow step's rank is ~600% above the median, a busy
    # machine's jitter stays under the threshold of 100%
    args += ["--hidden-size", "256", "--seq-length", "128"]
    args += ["--fault-inject", "1:3:slow", "--straggler-threshold", "1.0"]
    args += ["--profile", "--profile-step-start", "2", "--profile-step-end", "4", "--profile-ranks", "0", "1"]
    codes = run_ranks(main, 2, args)
    stdout, stderr = capfd.readouterr()
    assert codes == [0, 0], stderr

    lines = [line for line in stdout.splitlines() if "stragglers:" in line]
    assert len(lines) == 1, stdout  # the intervals ending at steps 6 and 9 name no one
    assert re.fullmatch(
        r"step 3: stragglers: rank 1 computes [\d.]+ s/step, \d+% above the median [\d.]+ s/step; "
        r"delays dp group \[0, 1\] \(its peers waited [\d.]+ s/step\)",
        lines[0],
    ), lines[0]
    records = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert sorted(records) == [3, 6, 9]
    slow, quiet = records[3], records[6]
    assert slow["straggler/ranks"] == [1] and slow["straggler/rank1/delays"] == "dp group [0, 1]"
    # the 2 s sleep over 3 steps: 0.67 s a step more for rank 1 than for rank 0 in the same interval (which shares
    # the machine's load; another interval's may differ by as much on a busy machine), waited out by rank 0 in the
    # gradient all-reduce
    assert slow["straggler/rank1/compute_s"] - slow["straggler/rank0/compute_s"] > 0.5
    assert slow["straggler/rank0/wait_s"] > 0.5
    assert quiet["straggler/ranks"] == [] and records[9]["straggler/ranks"] == []

    (merged_line,) = [line for line in stdout.splitlines() if "merged into one timeline" in line]
    merged = json.loads(Path(merged_line.rsplit(": ", 1)[1]).read_text())
    assert Path(merged_line.rsplit(": ", 1)[1]).name == "profile_merged_steps2-4.json"
    rows = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"] if e.get("name") == "process_name"}
    pid = {name: number for number, name in rows.items()}
    assert {"rank 0", "rank 1"} <= set(pid)
    steps = {
        (e["pid"], e["name"]): (e["ts"], e["ts"] + e["dur"])
        for e in merged["traceEvents"]
        if e.get("ph") == "X" and e.get("name") in ("ProfilerStep#2", "ProfilerStep#3")
    }
    assert set(steps) == {(pid[f"rank {r}"], f"ProfilerStep#{s}") for r in (0, 1) for s in (2, 3)}
    start0, end0 = steps[pid["rank 0"], "ProfilerStep#3"]
    start1, end1 = steps[pid["rank 1"], "ProfilerStep#3"]
    # rank 0 waited out rank 1's 2 s sleep in step 3's all-reduce: it left the step after rank 1 had slept
    # (an order of events, in microseconds of the merged timeline, not a bound on a busy machine's skew)
    assert end1 - start1 > 2_000_000 and end0 > start1 + 2_000_000 and start0 < end1
