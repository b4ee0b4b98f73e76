"""Pipeline parallelism: the bubble of paratron's one-chunk schedules with even and balanced stages.

    python bench/pipeline_bubble.py --pp 2 --rounds 8 --output bench/results/pipeline.json  # even vs balanced stages
    python bench/pipeline_bubble.py --smoke  # tiny, no waiting for quiet: does it still run?

It runs paratron alone, 1f1b and zb-h1, with the even split and with the balanced one the
planner chooses (`planning.candidates.balanced_ends`; with `--balance-from flops`:
`flop_balanced_split`), and records `--rounds` steps after `--warmup` ones. Per split: the measured
bubble (median of the steps) against the closed-form theory, the schedule simulated with the
planner's predicted stage costs and with this run's own mean operation times, the steps replayed
with every operation's own time, and the idle time split by what it waited for (`idle_breakdown`).
It first waits for the shared machine's cores to be quiet and records the other processes' load.
Results go under `bubble_pp<N>` (plus the settings that differ from the defaults).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from common import apply_smoke, spawn
from paratron.distributed.local_ranks import torchrun_environment
from paratron.planning.candidates import balanced_ends, output_ratio
from pipeline_common import SMOKE, add_arguments, build, merge_into, microbatches, run_settings
from plan_cpu import busy_seconds, wait_for_quiet


def stage_flops(args: dict, counts: list[int]) -> list[float]:
    """Forward FLOPs per token of each pipeline stage: its layers' matmuls and attention scores (over
    the keys a causal kernel computes, about half the sequence), the output layer on the last stage
    (2 h V) and the loss (a few passes over the V logits); the embedding is a lookup (0)."""
    h, ffn, seq, vocab = args["hidden"], args["ffn"], args["seq"], args["vocab"]
    layer = 2 * 4 * h * h + 2 * 2 * h * ffn + 4 * (seq / 2) * h
    head = 2 * h * vocab + 5 * vocab
    return [n * layer + (head if i == len(counts) - 1 else 0.0) for i, n in enumerate(counts)]


def flop_balanced_split(args: dict) -> tuple[int, int]:
    """First and last stage layer counts (the stages between share the rest evenly) that make the
    largest stage's FLOPs smallest, then the spread between stages."""
    from paratron.config.layout import layer_counts

    layers, pp = args["layers"], args["pp"]
    best: tuple[tuple[float, float], tuple[int, int]] | None = None
    for first in range(1, layers):
        for last in range(1, layers - first + 1):
            try:
                counts = layer_counts(layers, pp, first, last)
            except ValueError:
                continue
            costs = stage_flops(args, counts)
            key = (max(costs), max(costs) - min(costs))
            if best is None or key < best[0]:
                best = (key, (first, last))
    assert best is not None
    return best[1]


def planner_balanced_split(args: dict, schedule: str) -> tuple[int | None, int | None]:
    """The first and last stage layer counts the planner's search gives this model
    (`planning.candidates.balanced_ends` over the output layer's work in layers, `output_ratio`), as
    `paratron plan` would set them; (None, None) means the even split."""
    config = build(args, schedule)
    return balanced_ends(args["layers"], args["pp"], round(output_ratio(config, 1, 1), 1))


def planner_bubble(args: dict, schedule: str, first: int | None, last: int | None) -> float:
    """The bubble (`Timeline.bubble_fraction`, the measured bubble's definition) of the schedule
    simulated with the per-stage operation times the planner's cost model predicts on the `cpu`
    preset for --pp processes; NaN when the cost model is not importable."""
    try:
        from paratron.config import resolve_layout
        from paratron.parallel.pipeline.schedules import build_schedule, simulate
        from paratron.planning.cost import predict_step
        from paratron.planning.hardware import measure_cpu

        config = build(dict(args, first_layers=first, last_layers=last), schedule)
        stages = predict_step(config, resolve_layout(config, args["pp"]), measure_cpu(args["pp"])).stages
        costs = [dict(zip("FBW", stage)) for stage in stages]
        return simulate(build_schedule(schedule, args["pp"], args["microbatches"]), stage_costs=costs).bubble_fraction()
    except (ImportError, AttributeError, NotImplementedError, TypeError):  # (the cost model mid-change)
        return float("nan")


def _recorded_steps(ours: Any, batches: list, steps: int) -> list[list[list[Any]]]:
    """`steps` paratron steps recorded with `pipeline.record` (ranks aligned by a barrier before each);
    every rank's spans of each step on rank 0 (empty elsewhere)."""
    import torch.distributed as dist

    rank, pp = dist.get_rank(), dist.get_world_size()
    out = []
    ours.pipeline.record = True
    gc.collect()
    gc.disable()  # (a collection inside a recorded step is one rank's pause, not the schedule's)
    for _ in range(steps):
        ours.zero_grad()
        dist.barrier()
        ours.forward_backward(batches, backward=lambda loss: loss.backward())
        spans: list[Any] = [None] * pp
        dist.gather_object(ours.pipeline.spans, spans if rank == 0 else None, dst=0)
        out.append(spans)
    gc.enable()
    ours.pipeline.record = False
    return out if rank == 0 else []


def _p2p_one_way_ms(shape: tuple[int, ...], repeats: int = 20) -> float:
    """Half the median round trip of one activation message between pipeline ranks 0 and 1 (blocking
    gloo send and receive, after a warm-up exchange); on rank 0 (NaN elsewhere)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    message = torch.zeros(shape)
    trips = []
    for _ in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(message, 1)
            dist.recv(message, 1)
        elif rank == 1:
            dist.recv(message, 0)
            dist.send(message, 0)
        trips.append(time.perf_counter() - start)
    return 1e3 * statistics.median(trips[1:]) / 2 if rank == 0 else float("nan")


def idle_breakdown(steps: list[list[list[Any]]]) -> dict[str, float]:
    """The measured bubble split by what each idle stretch of a rank waited for, as shares of ranks x
    step time (they add up to the bubble), mean over the recorded steps:

    - `compute`: the other rank's work, until the message's producer (the forward of the stage
      before, the input-gradient backward of the stage after) ended, and the end of the step after
      this rank's last operation (the schedule's fill and drain, stage imbalance, jitter);
    - `messages`: from the producer's end until the operation started (the transfer, posting it,
      waking the waiting rank);
    - `gaps`: before operations that waited for no message (the runtime's own bookkeeping).

    Also the median delay of one message (ms). Each rank's times count from its own start, after a
    common barrier."""
    parts = {"compute": 0.0, "messages": 0.0, "gaps": 0.0}
    delays = []
    for spans in steps:
        first = min(s for row in spans for _, s, _ in row)
        last = max(e for row in spans for _, _, e in row)
        total = len(spans) * (last - first)
        ends = {(a.kind, a.microbatch, stage): e for stage, row in enumerate(spans) for a, _, e in row}
        for stage, row in enumerate(spans):
            previous = first
            for action, start, end in row:
                producer = None
                if action.kind == "F" and stage > 0:
                    producer = ends.get(("F", action.microbatch, stage - 1))
                elif action.kind == "B" and stage < len(spans) - 1:
                    producer = ends.get(("B", action.microbatch, stage + 1))
                if producer is not None and producer > previous:
                    parts["compute"] += (min(producer, start) - previous) / total
                    parts["messages"] += max(0.0, start - producer) / total
                    delays.append(start - producer)
                else:
                    parts["gaps"] += max(0.0, start - previous) / total
                previous = end
            parts["compute"] += (last - previous) / total
    out = {k: v / len(steps) for k, v in parts.items()}
    out["message_delay_ms"] = statistics.median(delays) if delays else float("nan")
    out["messages_waited_per_step"] = len(delays) / len(steps)
    return out


def replayed_bubble(steps: list[list[list[Any]]]) -> float:
    """The bubble of the recorded steps replayed with each operation's own measured duration and no
    time between operations beyond the dependencies (a message arrives the moment its producer
    ends): what the schedule, the stage costs and their step-to-step jitter alone give. Mean over
    the steps."""
    bubbles = []
    for spans in steps:
        ranks = len(spans)
        done: dict[tuple[str, int, int], float] = {}
        clock, position = [0.0] * ranks, [0] * ranks
        while any(position[r] < len(spans[r]) for r in range(ranks)):
            progressed = False
            for stage, row in enumerate(spans):
                while position[stage] < len(row):
                    action, start, end = row[position[stage]]
                    need = None
                    if action.kind == "F" and stage > 0:
                        need = ("F", action.microbatch, stage - 1)
                    elif action.kind == "B" and stage < ranks - 1:
                        need = ("B", action.microbatch, stage + 1)
                    if need is not None and need not in done:
                        break
                    begin = max(clock[stage], done[need] if need is not None else 0.0)
                    clock[stage] = begin + (end - start)
                    done[(action.kind, action.microbatch, stage)] = clock[stage]
                    position[stage] += 1
                    progressed = True
            if not progressed:
                raise RuntimeError("the recorded operations cannot be replayed in order")
        busy = sum(e - s for row in spans for _, s, e in row)
        bubbles.append(1.0 - busy / (ranks * max(clock)))
    return statistics.mean(bubbles)


def _fitted_latency(schedule: Any, costs: list[dict[str, float]], bubble: float) -> float:
    """The per-message delay (ms) that makes the schedule simulated with these operation times give
    the measured bubble (bisection; 0 if the simulation without delay already reaches it)."""
    from paratron.parallel.pipeline.schedules import simulate

    def simulated(latency: float) -> float:
        return simulate(schedule, stage_costs=costs, p2p_latency=latency).bubble_fraction()

    low, high = 0.0, max(max(c.values()) for c in costs)
    if simulated(low) >= bubble:
        return 0.0
    if simulated(high) < bubble:
        return float("inf")
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if simulated(middle) < bubble else (low, middle)
    return (low + high) / 2


STEADY_MALLOC = {
    "MALLOC_MMAP_THRESHOLD_": str(4 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(64 << 30),
    "MALLOC_TOP_PAD_": str(1 << 30),
}


def _per_microbatch_ms(steps: list[list[list[Any]]], kinds: tuple[str, ...]) -> list[dict[str, list[float]]]:
    """Each stage's median duration of each kind of operation per micro-batch (over the recorded
    steps): where the run's times differ from their mean systematically (a step's first backward
    allocating the gradients, say) rather than by jitter."""
    table: dict[tuple[int, str, int], list[float]] = {}
    for spans in steps:
        for stage, row in enumerate(spans):
            for action, start, end in row:
                table.setdefault((stage, action.kind, action.microbatch), []).append(end - start)
    stages = len(steps[0])
    microbatches = 1 + max(m for _, _, m in table)
    return [
        {k: [round(statistics.median(table[(s, k, i)]), 2) for i in range(microbatches)] for k in kinds}
        for s in range(stages)
    ]


def _bubble_run(args: dict, topology: Any, name: str, split: str, batches: list) -> dict:
    """Build paratron's pipeline of schedule `name` with the given split, warm it up, record
    --rounds steps; the measured bubble against the theory and against the schedule simulated with
    this run's own operation times per stage."""
    import torch.distributed as dist

    from paratron.config import resolve_layout
    from paratron.model.gpt import GPT
    from paratron.parallel.parallelize import parallelize
    from paratron.parallel.pipeline.profile import measured_bubble
    from paratron.parallel.pipeline.schedules import build_schedule, simulate, theoretical_bubble

    pp, m = args["pp"], args["microbatches"]
    config = build(args, name)
    counts = list(resolve_layout(config, pp).pipeline.counts)
    with torch.device("meta"):
        meta = GPT(dataclasses.replace(config.model))
    ours = parallelize(meta, config, topology, torch.device("cpu"), resolve_layout(config, topology.dims.world_size))
    for _ in range(args["warmup"]):
        ours.zero_grad()
        ours.forward_backward(batches, backward=lambda loss: loss.backward())
    steps = _recorded_steps(ours, batches, args["rounds"])
    p2p_ms = _p2p_one_way_ms(batches[0].input_ids.shape + (args["hidden"],))
    result: dict[str, Any] = {}
    if dist.get_rank() == 0:
        bubbles = [measured_bubble(spans) for spans in steps]
        # mean duration of each (stage, kind) over every micro-batch of every recorded step (so the
        # simulation keeps the busy time the ranks measured)
        durations: dict[tuple[int, str], list[float]] = {}
        for spans in steps:
            for stage, row in enumerate(spans):
                for action, start, end in row:
                    durations.setdefault((stage, action.kind), []).append(end - start)
        schedule = build_schedule(name, pp, m)
        kinds = ("F", "B", "W") if schedule.split_backward else ("F", "B")
        op_ms = [{k: statistics.mean(durations[(s, k)]) for k in kinds} for s in range(pp)]
        theory = theoretical_bubble(name, pp, m)
        bubble = statistics.median(bubbles)
        costs = [{**{"W": 0.0}, **op} for op in op_ms]
        try:
            simulated = simulate(schedule, stage_costs=costs).bubble_fraction()
            latency = _fitted_latency(schedule, costs, bubble)
        except TypeError:  # (a simulate without per-stage costs)
            simulated = latency = float("nan")
        step_ms = [
            max(e for row in spans for _, _, e in row) - min(s for row in spans for _, s, _ in row) for spans in steps
        ]
        busy = [[sum(e - s for _, s, e in row) for row in spans] for spans in steps]
        result = {
            "schedule": name,
            "split": split,
            "layers_per_stage": counts,
            "bubble_measured": bubble,
            "bubble_measured_steps": bubbles,
            "bubble_theoretical": theory,
            "relative_to_theory": (bubble - theory) / theory,
            "within_10_percent": abs(bubble - theory) <= 0.1 * theory,
            "bubble_simulated_measured_ops": simulated,
            "bubble_replayed": replayed_bubble(steps),
            "fitted_p2p_latency_ms": latency,
            "p2p_one_way_ms": p2p_ms,
            "step_ms": statistics.median(step_ms),
            "busy_ms_per_rank": [statistics.median(b[r] for b in busy) for r in range(pp)],
            "op_ms_per_stage": op_ms,
            "op_ms_per_microbatch": _per_microbatch_ms(steps, kinds),
            "stage_forward_flops_per_token": stage_flops(args, counts),
            "idle": idle_breakdown(steps),
        }
    dist.barrier()
    return result


def _bubble_worker(rank: int, world: int, port: int, args: dict, out: str) -> None:
    """`bubble`: paratron alone, each schedule of --only at each split of args["splits"]."""
    torchrun_environment(rank, world, port)
    import torch.distributed as dist

    from paratron.distributed.init import initialize
    from paratron.distributed.topology import ParallelDims, Topology

    initialize("gloo")
    torch.set_num_threads(max(1, args["cores"] // world))
    if args["pin"] and world <= args["cores"] and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {rank % args["cores"]})  # one core per stage: no migrations between cores
    topology = Topology(ParallelDims(world, pp=world), rank)
    topology.create_groups()
    _, _, batches = microbatches(args)
    runs = []
    for name in args["only"]:
        for split, (first, last) in args["splits"][name].items():
            runs.append(_bubble_run(dict(args, first_layers=first, last_layers=last), topology, name, split, batches))
    if rank == 0:
        Path(out).write_text(json.dumps({"runs": runs, "threads_per_process": torch.get_num_threads()}))
    dist.destroy_process_group()


def bubble(args: dict, forked: bool = False) -> dict:
    """Measured bubble of paratron's one-chunk schedules with the even split and the balanced one
    (`forked`: ranks as `spawn` forks them for --smoke)."""
    splits: dict[str, dict[str, tuple[int | None, int | None]]] = {}
    sources: dict[str, str] = {}
    for name in args["only"]:
        splits[name] = {"even": (None, None)} if args["layers"] % args["pp"] == 0 else {}  # (none: not a multiple)
        if args["first_layers"] is not None or args["last_layers"] is not None:
            splits[name]["given"] = (args["first_layers"], args["last_layers"])
            continue
        planned = planner_balanced_split(args, name) if args["balance_from"] == "planner" else None
        sources[name] = args["balance_from"]
        balanced = planned if planned is not None else flop_balanced_split(args)
        if balanced != (None, None):
            splits[name]["balanced"] = balanced
    waited = wait_for_quiet(args["quiet_below"], args["quiet_timeout"]) if args["quiet_below"] < 1 else 0.0
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy, start = busy_seconds(), time.perf_counter()
    if args["steady_malloc"]:
        os.environ.update(STEADY_MALLOC)  # (read by each spawned process's C library at its start)
    results = spawn(_bubble_worker, args["pp"], dict(args, splits=splits), forked=forked)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    for run in results["runs"]:
        first, last = splits[run["schedule"]][run["split"]]
        run["bubble_planner"] = planner_bubble(args, run["schedule"], first, last)
    ours = (after.ru_utime + after.ru_stime) - (children.ru_utime + children.ru_stime)
    other = (busy_seconds() - busy - ours) / ((time.perf_counter() - start) * (os.cpu_count() or 1))
    results["other_load"] = max(0.0, other)
    results["waited_for_quiet_s"] = waited
    results["balanced_split_from"] = sources
    results["model"] = run_settings(args)
    results["timing"] = {
        "warmup_steps": args["warmup"],
        "recorded_steps": args["rounds"],
        "cores": args["cores"],
        "pinned": args["pin"],
        "steady_malloc": args["steady_malloc"],
    }
    return results


def bubble_table(pp: int, results: dict) -> str:
    """Markdown rows of one `bubble` run."""
    lines = [
        "| PP | schedule | split (layers per stage) | busy ms per rank | bubble measured | theory | measured / "
        "theory | within 10% | planner's prediction | simulated with the run's mean op times | replayed with "
        "every op's own time | idle: waiting for compute / messages / gaps |",
        "|---|---|---|---|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for r in results["runs"]:
        counts = " / ".join(str(c) for c in r["layers_per_stage"])
        busy = " / ".join(f"{b:.0f}" for b in r["busy_ms_per_rank"])
        lines.append(
            f"| {pp} | `{r['schedule']}` | {r['split']} ({counts}) | {busy} | {r['bubble_measured']:.3f} | "
            f"{r['bubble_theoretical']:.3f} | {r['bubble_measured'] / r['bubble_theoretical']:.2f} | "
            f"{'yes' if r['within_10_percent'] else 'no'} | {r.get('bubble_planner', float('nan')):.3f} | "
            f"{r['bubble_simulated_measured_ops']:.3f} | {r['bubble_replayed']:.3f} | "
            f"{r['idle']['compute']:.3f} / {r['idle']['messages']:.3f} / "
            f"{r['idle']['gaps']:.3f} |"
        )
    p2p = statistics.median(r["p2p_one_way_ms"] for r in results["runs"])
    lines.append("")
    lines.append(
        f"One activation message alone (blocking gloo send, half a round trip): {p2p:.2f} ms. Other processes "
        f"used {results['other_load']:.0%} of the cores meanwhile."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--rounds", type=int, default=3, help="recorded steps")
    parser.add_argument("--only", nargs="+", default=["1f1b", "zb-h1"], choices=["1f1b", "zb-h1"])
    parser.add_argument(
        "--balance-from",
        choices=["planner", "flops"],
        default="planner",
        help="where the balanced split comes from: the planner's cost model, or FLOPs alone",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before the recorded ones")
    parser.add_argument(
        "--quiet-below",
        type=float,
        default=0.1,
        help="first wait until other processes use less than this share of the cores (1: never wait)",
    )
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pin each process to its own core when there are as many cores as processes",
    )
    parser.add_argument(
        "--steady-malloc",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep freed memory in each process's heap (glibc settings) so operations do not page-fault",
    )
    parser.add_argument("--quiet-timeout", type=float, default=300.0, help="the longest wait for quiet, s")
    args = parser.parse_args(argv)
    apply_smoke(args, parser, **SMOKE, warmup=1, quiet_below=1.0)
    settings = {k: v for k, v in vars(args).items() if k not in ("output", "smoke")}
    results = bubble(settings, forked=args.smoke)
    print(json.dumps({k: v for k, v in results.items() if k != "model"}, indent=2), flush=True)
    print(bubble_table(args.pp, results), flush=True)
    changed = [
        n
        for n in ("layers", "hidden", "ffn", "vocab", "seq", "micro_batch_size", "microbatches")
        if getattr(args, n) != parser.get_default(n)
    ]
    key = f"bubble_pp{args.pp}" + "".join(f"_{n}{getattr(args, n)}" for n in changed)
    merge_into(args.output, key, results)


if __name__ == "__main__":
    main()
