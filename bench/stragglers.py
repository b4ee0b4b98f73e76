"""What --straggler-threshold costs a training step: paratron's step with the detector off and on.

    python bench/stragglers.py --output bench/results/stragglers.json  # (~1 min, 2 idle cores)
    python bench/stragglers.py --smoke  # tiny: does it still run, and does the detector see the waits?

Two gloo processes (DP 2) train one GPT (paratron's model code, fp32, no dropout, untied embeddings)
on the same batches, `--microbatches` micro-batches per rank per step. Each round times `--steps`
steps with the detector off (torch.distributed as it is) and `--steps` with it on (every collective
wrapped and timed, each step timed), the order of the two alternating from round to round so that
both see the machine alike. Reported: each side's median milliseconds per step (the mean of the
ranks), on / off as the ratio of medians and the median of per-round ratios (above 1: the detector
costs that much), and the time of one report (the all-gather of the figures each log line makes).
On a shared machine that ratio moves by more than the detector costs, so its cost is also taken
apart: the collectives a step makes (counted by the detector), times what wrapping adds to one
call (a wrapped no-op against the bare no-op, `--calls` calls each, median of 5 tries), as a share
of the step.
The last report's figures show what the detector saw: every rank's compute and wait per step,
with the waits charged to the data-parallel group.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from common import PRECISION, RESULTS, SEED, add_smoke_argument, apply_smoke, gpt_settings, spawn
from paratron.distributed.local_ranks import torchrun_environment

THRESHOLD = 0.2


def _build(args: dict, topology: Any) -> Any:
    """A step function of paratron's DP 2 model over a list of (inputs, labels) micro-batches."""
    from paratron.config import build_config
    from paratron.config.layout import resolve_layout
    from paratron.model.batch import Batch
    from paratron.model.gpt import GPT
    from paratron.optim.build import build_optimizer
    from paratron.optim.mixed_precision import Precision
    from paratron.parallel.parallelize import parallelize
    from paratron.training.step import train_step

    config = build_config(
        dict(
            gpt_settings(args),
            seq_length=args["seq"],
            micro_batch_size=args["micro_batch_size"],
            global_batch_size=args["micro_batch_size"] * args["microbatches"] * 2,
            mock_data=True,
            seed=SEED,
            precision=PRECISION,
        )
    )
    with torch.device("meta"):
        meta = GPT(config.model)
    model = parallelize(meta, config, topology, torch.device("cpu"), resolve_layout(config, topology.dims.world_size))
    optimizer = build_optimizer(model, config.optimizer)
    precision = Precision(PRECISION)
    return lambda batches: train_step(model, optimizer, [Batch(*b) for b in batches], precision, 1.0).loss


def _rank_mean(values: list[float]) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def _wrapper_cost_us(calls: int) -> float:
    """Microseconds the timed wrapper adds to one call: a wrapped no-op collective against the bare
    no-op, while measuring (the median of 5 tries)."""
    from paratron.debugging.stragglers import _timed

    def collective(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        return None

    wrapped = _timed(collective, lambda group, seconds: None, lambda: True, torch.device("cpu"))
    x = torch.zeros(1)
    tries = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            collective(x, group=None)
        bare = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(calls):
            wrapped(x, group=None)
        tries.append((time.perf_counter() - start - bare) / calls * 1e6)
    return statistics.median(tries)


def _worker(rank: int, world: int, port: int, args: dict, out: str) -> None:
    torchrun_environment(rank, world, port)
    import torch.distributed as dist

    from paratron.debugging.stragglers import StragglerDetector
    from paratron.distributed.init import initialize
    from paratron.distributed.topology import ParallelDims, Topology

    ctx = initialize("gloo")
    torch.set_num_threads(max(1, args["cores"] // world))
    topology = Topology(ParallelDims(world), ctx.rank)
    topology.create_groups()
    step = _build(args, topology)
    generator = torch.Generator().manual_seed(SEED + rank)
    mb, seq = args["micro_batch_size"], args["seq"]
    ids = torch.randint(0, args["vocab"], (args["microbatches"] * mb, seq + 1), generator=generator)
    batches = [(ids[i : i + mb, :-1].contiguous(), ids[i : i + mb, 1:].contiguous()) for i in range(0, len(ids), mb)]
    detector = StragglerDetector(THRESHOLD, topology, ctx.device)
    calls = [0]
    charge = detector._charge

    def counted(group: Any, seconds: float) -> None:
        calls[0] += 1
        charge(group, seconds)

    detector._charge = counted  # type: ignore[method-assign]
    step(batches)  # warm-up

    def timed(on: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        if on:
            with detector.instrumented():
                for _ in range(args["steps"]):
                    with detector.timing():
                        step(batches)
        else:
            for _ in range(args["steps"]):
                step(batches)
        return (time.perf_counter() - start) / args["steps"] * 1e3

    off_ms, on_ms = [], []
    for r in range(args["rounds"]):
        for on in (r % 2 == 1, r % 2 == 0):
            (on_ms if on else off_ms).append(timed(on))
    off_ms, on_ms = _rank_mean(off_ms), _rank_mean(on_ms)
    calls_per_step = calls[0] / (args["rounds"] * args["steps"])
    wrapper_us = _wrapper_cost_us(args["calls"])
    waited = sorted(detector.waits)
    with detector.instrumented():
        dist.barrier()
        start = time.perf_counter()
        record = detector.report(args["rounds"] * args["steps"], print if rank == 0 else lambda line: None)
        report_ms = (time.perf_counter() - start) * 1e3
    if rank == 0:
        result = {
            "model": {k: args[k] for k in ("layers", "hidden", "heads", "ffn", "vocab", "seq")},
            "micro_batch_size": mb,
            "microbatches": args["microbatches"],
            "steps_per_round": args["steps"],
            "rounds": args["rounds"],
            "threads_per_process": torch.get_num_threads(),
            "off_ms": statistics.median(off_ms),
            "on_ms": statistics.median(on_ms),
            "ratio_of_medians": statistics.median(on_ms) / statistics.median(off_ms),
            "median_round_ratio": statistics.median(a / b for a, b in zip(on_ms, off_ms, strict=True)),
            "report_ms": report_ms,
            "collective_calls_per_step": calls_per_step,
            "wrapper_us_per_call": wrapper_us,
            "wrapping_share_of_step": calls_per_step * wrapper_us / 1e3 / statistics.median(off_ms),
            "last_report": record,
            "groups_waited_in": waited,
        }
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def check(result: dict) -> None:
    """--smoke: the detector timed both ranks' steps and saw waits in collectives."""
    report = result["last_report"]
    for rank in (0, 1):
        assert report[f"straggler/rank{rank}/compute_s"] > 0, report
        assert report[f"straggler/rank{rank}/wait_s"] > 0, report  # the gradient all-reduce, at least
    assert result["groups_waited_in"] == ["dp group [0, 1]"], result
    assert result["on_ms"] > 0 and result["off_ms"] > 0, result
    assert result["collective_calls_per_step"] >= 1 and result["wrapper_us_per_call"] > 0, result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per side per round")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=20000, help="no-op calls per try of the wrapper's cost")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--output", type=Path, default=RESULTS / "stragglers.json")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    apply_smoke(
        args, parser, layers=2, hidden=64, ffn=256, vocab=256, seq=32, micro_batch_size=2, steps=1, rounds=2, calls=200
    )
    load_before = os.getloadavg()[0]
    result = spawn(_worker, 2, vars(args) | {"output": str(args.output)}, forked=args.smoke)
    result["load_average"] = {"before": load_before, "after": os.getloadavg()[0]}  # (others' work: a warning sign)
    print(json.dumps(result, indent=2))
    if args.smoke:
        check(result)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
