"""Data parallelism and ZeRO: paratron against PyTorch's DDP, ZeroRedundancyOptimizer and FSDP2.

    python bench/data_parallel.py step --output bench/results/data_parallel.json  # all (~4 min, 2 idle cores)
    python bench/data_parallel.py step --only zero3 --rounds 4 --output bench/results/data_parallel.json
    python bench/data_parallel.py step --smoke  # tiny: does it still run, and do both sides train alike?
    python bench/data_parallel.py markdown --output bench/results/data_parallel.json  # the .md again, from the JSON

`step` trains one GPT (paratron's model code, same seed, untied embeddings, fp32, no dropout) on two
gloo processes (DP 2) in several ways, all from the same weights on the same batches: per step,
`--microbatches` micro-batches per rank (gradients accumulate; only the last synchronises), a
global-norm clip at 1.0 and AdamW (same settings, decay on matrices only). Pairings (`--only`):

    ddp    paratron stage 0, with and without overlap_grad_reduce, vs torch DistributedDataParallel
           with its default buckets (25 MiB, the first 1 MiB) and with bucket_cap_mb matched to
           --bucket-size; no_sync() on all but the last micro-batch, torch AdamW, clip_grad_norm_
    zero1  paratron zero_stage 1, with and without overlap_grad_reduce, vs
           ZeroRedundancyOptimizer(optimizer_class=AdamW) over DDP (default buckets)
    zero3  paratron zero_stage 3 vs FSDP2 fully_shard applied by hand to each transformer block,
           then the root; set_requires_gradient_sync(False) on all but the last micro-batch
    bf16grad  paratron against itself in bf16 (stage 0 and ZeRO-1): --grad-reduce-in-bf16 (gradients
           accumulated and reduced in bf16) vs fp32 gradients; also each side's gradient buffer and
           the bytes its reductions take in per step (gloo on CPU says little about NCCL's times)

Each side makes a warm-up step, then `--rounds` rounds of `--steps` timed steps (barriers around
each round, the order of the sides rotating; one step per round, so that the rounds paired for a
ratio are seconds apart on a shared machine). Reported: each side's median round; paratron / peer
as the ratio of medians and the median of per-round ratios (below 1: paratron faster), in wall
time and in the CPU time a process spends per step (all threads; waiting is not counted, so it
misses exposed communication, but sharing the cores with other processes hardly moves it); the
rank-averaged losses of both sides, step by step (same batches, same number of steps). Also: the
share of the cores other processes used meanwhile (/proc/stat), as a warning sign.

Overlap (paratron sides of `ddp` and `zero1`), on one micro-batch, forward never timed: (a)
backward with gradient sync disabled (compute only); (b) then, after a barrier, finish_grad_sync(),
which reduces every bucket at once (the communication when nothing hides it); (c) backward +
finish_grad_sync() with sync enabled. Share of the communication hidden behind backward:
(a + b - c) / b clipped to [0, 1] (0: it adds its whole time; 1: nothing). Medians of
`--overlap-repeats` tries, mean of the ranks. Results merge into `--output` by pairing; the
Markdown section (`--markdown`, default: the output with .md) is written from the merged results.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from common import PRECISION, SEED, add_smoke_argument, apply_smoke, gpt_settings, spawn
from paratron.distributed.local_ranks import torchrun_environment

Batch = list[tuple[torch.Tensor, torch.Tensor]]
PAIRINGS = ("ddp", "zero1", "zero3", "bf16grad")
LABELS = {
    "paratron": "paratron stage 0",
    "paratron-overlap": "paratron stage 0 + overlap_grad_reduce",
    "torch-ddp": "torch DDP (default buckets)",
    "torch-ddp-matched": "torch DDP (bucket_cap_mb matched)",
    "paratron-zero1": "paratron ZeRO-1",
    "paratron-zero1-overlap": "paratron ZeRO-1 + overlap_grad_reduce",
    "torch-zero1": "torch ZeroRedundancyOptimizer + DDP",
    "paratron-zero3": "paratron ZeRO-3",
    "torch-fsdp2": "torch FSDP2 fully_shard",
    "bf16-grads": "paratron bf16 stage 0, --grad-reduce-in-bf16",
    "bf16": "paratron bf16 stage 0, fp32 gradients",
    "bf16-zero1-grads": "paratron bf16 ZeRO-1, --grad-reduce-in-bf16",
    "bf16-zero1": "paratron bf16 ZeRO-1, fp32 gradients",
}
COMPARISONS = {
    "ddp": [
        ("paratron", "torch-ddp"),
        ("paratron", "torch-ddp-matched"),
        ("paratron-overlap", "torch-ddp"),
        ("paratron-overlap", "torch-ddp-matched"),
    ],
    "zero1": [("paratron-zero1", "torch-zero1"), ("paratron-zero1-overlap", "torch-zero1")],
    "zero3": [("paratron-zero3", "torch-fsdp2")],
    "bf16grad": [("bf16-grads", "bf16"), ("bf16-zero1-grads", "bf16-zero1")],
}
PEERS = ("ddp", "zero1", "zero3")
"""The pairings against PyTorch (the main table); bf16grad has a table of its own."""
LOSS_AGREEMENT = {"bf16grad": 2e-2}
"""How far apart the two sides' losses may be under --smoke (default 1e-4: fp32 rounding); bf16 sums round."""


def _config(args: dict, **parallel: Any) -> Any:
    from paratron.config import build_config

    return build_config(
        dict(
            gpt_settings(args),
            seq_length=args["seq"],
            micro_batch_size=args["micro_batch_size"],
            global_batch_size=args["micro_batch_size"] * args["microbatches"] * 2,
            mock_data=True,
            seed=args["seed"],
            ddp_bucket_size=args["bucket_size"],
            **parallel,
        )
    )


@dataclass
class Side:
    """One way of training: a step function over this rank's micro-batches, returning the step's loss."""

    step: Callable[[Batch], torch.Tensor]
    model: Any = None  # paratron's ParallelModel (for the overlap measurement)
    losses: list[torch.Tensor] = field(default_factory=list)

    def run(self, pool: list[Batch]) -> None:
        self.losses.append(self.step(pool[len(self.losses) % len(pool)]))


def _paratron(args: dict, topology: Any, **parallel: Any) -> Side:
    from paratron.config.layout import resolve_layout
    from paratron.model.batch import Batch
    from paratron.model.gpt import GPT
    from paratron.optim.build import build_optimizer
    from paratron.optim.mixed_precision import Precision
    from paratron.parallel.parallelize import parallelize
    from paratron.training.step import train_step

    config = _config(args, **parallel)
    with torch.device("meta"):
        meta = GPT(config.model)
    model = parallelize(meta, config, topology, torch.device("cpu"), resolve_layout(config, topology.dims.world_size))
    optimizer = build_optimizer(model, config.optimizer)
    precision = Precision(config.training.precision)
    return Side(lambda batches: train_step(model, optimizer, [Batch(*b) for b in batches], precision, 1.0).loss, model)


def _torch(args: dict, kind: str, bucket_cap_mb: float | None = None) -> Side:
    """The plain model the way a PyTorch user parallelizes it: `kind` is ddp, zero1 (ZeroRedundancyOptimizer
    over DDP) or fsdp2; AdamW with decay on matrices only, clip_grad_norm_, paratron's optimizer defaults."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from paratron.model.gpt import build_model
    from paratron.model.loss import language_model_loss

    config = _config(args)
    model = build_model(config.model, seed=args["seed"])
    if kind == "fsdp2":
        mesh = init_device_mesh("cpu", (2,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    o = config.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    settings = dict(lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)
    if kind == "zero1":
        optimizer: Any = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **settings)
    else:
        optimizer = torch.optim.AdamW(groups, **settings)

    def sync(last: bool) -> contextlib.AbstractContextManager:
        if kind == "fsdp2":
            model.set_requires_gradient_sync(last)
        return contextlib.nullcontext() if last or kind == "fsdp2" else model.no_sync()

    def step(batches: Batch) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for i, (inputs, labels) in enumerate(batches):
            with sync(i == len(batches) - 1):
                loss = language_model_loss(model(inputs), labels)
                (loss / len(batches)).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return total / len(batches)

    return Side(step, model)


def _sides(name: str, args: dict, topology: Any) -> dict[str, Side]:
    if name == "ddp":
        return {
            "paratron": _paratron(args, topology),
            "paratron-overlap": _paratron(args, topology, overlap_grad_reduce=True),
            "torch-ddp": _torch(args, "ddp"),
            "torch-ddp-matched": _torch(args, "ddp", bucket_cap_mb=args["bucket_size"] * 4 / 2**20),
        }  # MiB
    if name == "zero1":
        return {
            "paratron-zero1": _paratron(args, topology, zero_stage=1),
            "paratron-zero1-overlap": _paratron(args, topology, zero_stage=1, overlap_grad_reduce=True),
            "torch-zero1": _torch(args, "zero1"),
        }
    if name == "bf16grad":
        return {
            f"bf16{stage}{grads}": _paratron(
                args, topology, precision="bf16", zero_stage=zero, grad_reduce_in_bf16=bool(grads)
            )
            for zero, stage in ((0, ""), (1, "-zero1"))
            for grads in ("-grads", "")
        }
    return {"paratron-zero3": _paratron(args, topology, zero_stage=3), "torch-fsdp2": _torch(args, "fsdp2")}


def _gradient_bytes(model: Any) -> dict[str, int]:
    """This rank's gradient storage (the reducers' persistent buffer or shard) and the bytes its reductions take in
    per step (every bucket once: all-reduced, or reduce-scattered; on gloo a ZeRO-1 bucket is all-reduced whole)."""
    reducers = model.gradients.reducers
    held = [r.grad_buffer if r.grad_buffer is not None else r.grad_shard for r in reducers]
    return {
        "gradient_buffer_bytes": sum(t.numel() * t.element_size() for t in held),
        "reduced_bytes_per_step": sum(r.total * t.element_size() for r, t in zip(reducers, held)),
        "gradient_dtype": str(held[0].dtype).removeprefix("torch."),
    }


def _reduction_parts(model: Any, repeats: int) -> dict[str, float]:
    """The two parts of reducing this side's gradients once, each timed alone on a scratch tensor of the buffer's
    size and type (ms, median of `repeats`, mean of the ranks): the 1/N scaling every bucket gets first, and the
    all-reduce itself."""
    import torch.distributed as dist

    reducer = model.gradients.reducer
    scratch = torch.ones(reducer.total, dtype=reducer.dtype)
    times: dict[str, list[float]] = {"scale_ms": [], "all_reduce_ms": []}
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        scratch.mul_(0.5)
        times["scale_ms"].append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(scratch)
        times["all_reduce_ms"].append(time.perf_counter() - start)
    medians = _rank_mean([statistics.median(v) * 1e3 for v in times.values()])
    return dict(zip(times, medians))


def _timed_round(side: Side, pool: list[Batch], steps: int) -> tuple[float, float]:
    """Wall-clock ms per step, between barriers (both ranks' last operation is inside the time), and
    this process's CPU ms per step (all its threads; waiting does not count)."""
    import torch.distributed as dist

    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        side.run(pool)
    cpu = time.process_time() - cpu
    dist.barrier()
    return (time.perf_counter() - start) / steps * 1e3, cpu / steps * 1e3


def _rank_mean(values: list[float]) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def _overlap(models: dict[str, Any], batch: tuple[torch.Tensor, torch.Tensor], repeats: int) -> dict:
    """Compute, exposed communication and their sum as backward runs it (see the module docstring);
    the models take turns within each try, so that they share the machine's ups and downs."""
    import torch.distributed as dist

    inputs, labels = batch

    def once(model: Any, sync: bool) -> tuple[float, float]:
        model.zero_grad()
        model.gradients.require_sync(sync)
        loss = model.loss_function(model(inputs), labels)
        dist.barrier()
        start = time.perf_counter()
        loss.backward()
        backward = time.perf_counter() - start
        if not sync:
            dist.barrier()  # (b) is communication only, not waiting for the other rank's backward
        start = time.perf_counter()
        model.finish_grad_sync()
        return backward, time.perf_counter() - start

    tries: dict[str, list[list[float]]] = {k: [[], [], []] for k in models}
    for _ in range(repeats):
        for key, model in models.items():
            backward, finish = once(model, False)
            tries[key][0].append(backward)
            tries[key][1].append(finish)
            tries[key][2].append(sum(once(model, True)))
    out = {}
    for key, model in models.items():
        model.gradients.require_sync(True)
        model.zero_grad()
        a, b, c = _rank_mean([statistics.median(x) * 1e3 for x in tries[key]])
        raw = (a + b - c) / b
        reducer = model.gradients.reducer
        out[key] = {
            "buckets": len(reducer.buckets),
            "overlap_grad_reduce": reducer.overlap,
            "mode": reducer.mode,
            "scatter_by_all_reduce": getattr(reducer, "scatter_by_all_reduce", False),
            "compute_ms": a,
            "exposed_comm_ms": b,
            "backward_and_sync_ms": c,
            "hidden_share": min(1.0, max(0.0, raw)),
            "hidden_share_raw": raw,
        }
    return out


def _busy_seconds() -> float:
    """CPU seconds the whole machine has been busy: all processes, all cores (Linux; NaN elsewhere)."""
    stat = Path("/proc/stat")
    fields = [int(x) for x in stat.read_text().split("\n", 1)[0].split()[1:]] if stat.exists() else []
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK") if fields else float("nan")


def _pairing(name: str, args: dict, topology: Any, pool: list[Batch]) -> dict:
    import torch.distributed as dist

    sides = _sides(name, args, topology)
    dist.barrier()
    started, busy, our_cpu = time.perf_counter(), _busy_seconds(), time.process_time()
    for side in sides.values():
        side.run(pool)  # warm-up (DDP rebuilds its buckets after its first step)
    keys = list(sides)
    times: dict[str, list[float]] = {k: [] for k in keys}
    cpu: dict[str, list[float]] = {k: [] for k in keys}
    for r in range(args["rounds"]):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            wall, used = _timed_round(sides[key], pool, args["steps"])
            times[key].append(wall)
            cpu[key].append(used)
    # the share of the cores that other processes used while the sides were timed
    our_cpu = _rank_mean([time.process_time() - our_cpu])[0] * dist.get_world_size()
    other = (_busy_seconds() - busy - our_cpu) / ((time.perf_counter() - started) * (os.cpu_count() or 1))
    cpu = {k: _rank_mean(v) for k, v in cpu.items()}
    losses = {k: _rank_mean([float(x) for x in side.losses]) for k, side in sides.items()}
    result: dict[str, Any] = {"sides": {}, "comparisons": [], "other_load": max(0.0, other)}
    for key in keys:
        result["sides"][key] = {
            "label": LABELS[key],
            "median_ms": statistics.median(times[key]),
            "median_cpu_ms": statistics.median(cpu[key]),
            "rounds_ms": times[key],
            "rounds_cpu_ms": cpu[key],
            "losses": losses[key],
        }
        if name == "bf16grad":
            result["sides"][key].update(_gradient_bytes(sides[key].model))
            result["sides"][key].update(_reduction_parts(sides[key].model, max(3, args["overlap_repeats"])))
    for ours, peer in COMPARISONS[name]:
        rel = [abs(a - b) / abs(b) for a, b in zip(losses[ours], losses[peer])]
        a, b = result["sides"][ours], result["sides"][peer]
        result["comparisons"].append(
            {
                "paratron": ours,
                "peer": peer,
                "ratio": a["median_ms"] / b["median_ms"],
                "ratio_paired_median": statistics.median(x / y for x, y in zip(times[ours], times[peer])),
                "cpu_ratio": a["median_cpu_ms"] / b["median_cpu_ms"],
                "cpu_ratio_paired_median": statistics.median(x / y for x, y in zip(cpu[ours], cpu[peer])),
                "steps_compared": len(rel),
                "loss_first": losses[ours][0],
                "loss_last": losses[ours][-1],
                "loss_rel_diff_last": rel[-1],
                "loss_rel_diff_max": max(rel),
            }
        )
    if name in ("ddp", "zero1", "bf16grad") and args["overlap_repeats"] > 0:
        result["overlap"] = _overlap(
            {k: side.model for k, side in sides.items() if k.startswith("paratron") or name == "bf16grad"},
            pool[0][-1],
            args["overlap_repeats"],
        )
    model = sides[keys[0]].model
    if model.gradients.reducer is not None:
        result["paratron_bucket_elements"] = [b.end - b.start for b in model.gradients.reducer.buckets]
    if "torch-ddp" in sides:
        result["torch_ddp_buckets"] = {
            k: {
                n: v
                for n, v in sides[k].model._get_ddp_logging_data().items()
                if n in ("rebuilt_bucket_sizes", "bucket_cap_bytes")
            }
            for k in ("torch-ddp", "torch-ddp-matched")
        }
    dist.barrier()
    return result


def _step_worker(rank: int, world: int, port: int, args: dict, out: str) -> None:
    torchrun_environment(rank, world, port)
    import torch.distributed as dist

    from paratron.distributed.init import initialize
    from paratron.distributed.topology import ParallelDims, Topology

    ctx = initialize("gloo")
    torch.set_num_threads(max(1, args["cores"] // world))
    topology = Topology(ParallelDims(world, tp=1, pp=1), ctx.rank)
    topology.create_groups()
    # a pool of global batches, cut by rank, then into micro-batches; every side cycles through it
    mb, m, seq = args["micro_batch_size"], args["microbatches"], args["seq"]
    generator = torch.Generator().manual_seed(args["seed"])
    pool = []
    for _ in range(3):
        ids = torch.randint(0, args["vocab"], (world * mb * m, seq + 1), generator=generator)[rank * mb * m :][: mb * m]
        pool.append(
            [(ids[i : i + mb, :-1].contiguous(), ids[i : i + mb, 1:].contiguous()) for i in range(0, mb * m, mb)]
        )
    results: dict[str, Any] = {}
    for name in args["only"]:
        results[name] = _pairing(name, args, topology, pool)
        if rank == 0:
            print(f"{name}: done", flush=True)
    if rank == 0:
        results["threads_per_process"] = torch.get_num_threads()
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def step(args: dict, forked: bool = False) -> dict:
    return spawn(_step_worker, 2, args, forked=forked)


def check(results: dict, pairings: list[str]) -> None:
    """--smoke: every pairing's two sides trained alike (the same losses, fp32 rounding apart; bf16 reduction's
    rounding apart in `bf16grad`), and bf16 gradients take half the bytes."""
    for name in pairings:
        for c in results[name]["comparisons"]:
            if not c["loss_rel_diff_max"] < LOSS_AGREEMENT.get(name, 1e-4):
                raise AssertionError(f"{c['paratron']} and {c['peer']} part: {c}")
            if name == "bf16grad":
                ours, peer = results[name]["sides"][c["paratron"]], results[name]["sides"][c["peer"]]
                for key in ("gradient_buffer_bytes", "reduced_bytes_per_step"):
                    if 2 * ours[key] != peer[key]:
                        raise AssertionError(f"{c['paratron']}: {key} {ours[key]} is not half of {peer[key]}")


def _commit() -> str:
    """The checked-out commit, marked when src/ has uncommitted changes."""
    import subprocess

    def git(*words: str) -> str:
        return subprocess.run(
            ["git", *words], cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True
        ).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + (" + src changes" if git("status", "--porcelain", "src") else "")


def markdown(results: dict) -> str:
    """The summary section for BENCHMARKS.md, from the merged results."""
    if not any(name in results for name in PEERS):
        return "\n".join(_bf16_gradient_lines(results)[1:]) + "\n"
    m, t = results["model"], results["timing"]
    lines = [
        "## Data parallelism and ZeRO against PyTorch",
        "",
        (
            f"Two gloo processes on a {t['cores']}-core CPU ({t['threads_per_process']} thread each), fp32, torch "
            f"{t['torch']}. paratron's GPT: {m['num_layers']} layers, hidden "
            f"{m['hidden_size']}, {m['num_attention_heads']} heads, FFN {m['ffn_hidden_size']}, vocab "
            f"{m['vocab_size']} "
            f"(untied), {m['parameters'] / 1e6:.1f} M parameters; sequence {m['seq_length']}, micro-batch "
            f"{m['micro_batch_size']}, {m['microbatches']} micro-batches per rank and step (gradients synchronised on "
            "the "
            "last). Step = forward + backward of every micro-batch + clip at 1.0 + AdamW step. paratron buckets: "
            f"{m['bucket_size']:,} elements (DDP matched: bucket_cap_mb {m['bucket_size'] * 4 / 2**20:.2f}). "
            "Each side: a warm-up step, then rounds of timed steps, the order of the sides rotating."
        ),
        "",
        "```",
    ]
    runs = [results[name]["run"] for name in PEERS if name in results]
    lines += list(
        dict.fromkeys(
            f"{r['command']}  # {r['rounds']} rounds x {r['steps']} step, paratron {r['commit']}, {r['date']}"
            for r in runs
        )
    )
    lines += [
        "```",
        "",
        "| paratron | PyTorch peer | paratron ms | peer ms | ratio | paired | CPU ratio | CPU paired "
        "| loss rel. diff (last / max) | other load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in PEERS:
        if name not in results:
            continue
        sides, load = results[name]["sides"], results[name]["other_load"]
        for c in results[name]["comparisons"]:
            ours, peer = sides[c["paratron"]], sides[c["peer"]]
            lines.append(
                f"| {ours['label']} | {peer['label']} | {ours['median_ms']:.0f} | {peer['median_ms']:.0f} | "
                f"{c['ratio']:.3f} | {c['ratio_paired_median']:.3f} | {c['cpu_ratio']:.3f} | "
                f"{c['cpu_ratio_paired_median']:.3f} | {c['loss_rel_diff_last']:.1e} / "
                f"{c['loss_rel_diff_max']:.1e} | {load:.0%} |"
            )
    first = next(results[n]["comparisons"][0] for n in PEERS if n in results)
    lines += [
        "",
        "ms: median round, wall time per step. Ratio: paratron's median over the peer's (below 1: paratron "
        "faster); paired: median of the per-round ratios; CPU: the same in CPU time per process and step (all "
        "threads, mean of the ranks; waiting not counted). Loss: relative difference of the two sides' "
        f"rank-averaged loss at the last of {first['steps_compared']} steps and the largest over them (loss "
        f"{first['loss_first']:.3f} -> {first['loss_last']:.3f}). Other load: share of the machine's cores used "
        "by other processes meanwhile (/proc/stat).",
        "",
        "Gradient communication hidden behind backward (one micro-batch, forward not timed; ms, median of the "
        "tries, mean of the ranks):",
        "",
        "| paratron | reduction | buckets | (a) backward, no sync | "
        "(b) sync alone | (c) backward + sync | hidden (a+b-c)/b |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name in ("ddp", "zero1"):
        for key, o in results.get(name, {}).get("overlap", {}).items():
            mode = "all-reduce, keeps its shard" if o.get("scatter_by_all_reduce") else o["mode"]
            lines.append(
                f"| {LABELS[key]} | {mode} | {o['buckets']} | {o['compute_ms']:.0f} | "
                f"{o['exposed_comm_ms']:.0f} | {o['backward_and_sync_ms']:.0f} | "
                f"{o['hidden_share']:.2f} (raw {o['hidden_share_raw']:+.2f}) |"
            )
    return "\n".join(lines + (_bf16_gradient_lines(results) if "bf16grad" in results else [])) + "\n"


def _bf16_gradient_lines(results: dict) -> list[str]:
    """The bf16grad pairing's table: gradient bytes and step times of bf16 against fp32 gradients."""
    pairing, run, t = results["bf16grad"], results["bf16grad"]["run"], results["timing"]
    lines = [
        "",
        "### bf16 gradients (--grad-reduce-in-bf16) against fp32 gradients, bf16 training",
        "",
        f"The same model in bf16 (fp32 master weights and Adam state), two gloo processes, {t['cores']} cores. "
        "Gradient buffer: this rank's persistent gradient storage; reduced: the bytes its reductions take in per "
        "step (every bucket once). gloo on a CPU says little about NCCL on GPUs, where the reduction's time "
        "follows its bytes.",
        "",
        "```",
        f"{run['command']}  # {run['rounds']} rounds x {run['steps']} step, paratron {run['commit']}, {run['date']}",
        "```",
        "",
        "| side | gradients | gradient buffer MiB | reduced MiB/step | 1/N scaling ms | all-reduce ms "
        "| reduction alone ms | ms/step | vs fp32 gradients | paired | loss rel. diff (last / max) | other load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    overlap = pairing.get("overlap", {})
    for c in pairing["comparisons"]:
        for key in (c["peer"], c["paratron"]):
            side, ours = pairing["sides"][key], key == c["paratron"]
            alone = f"{overlap[key]['exposed_comm_ms']:.1f}" if key in overlap else "-"
            ratio = f"{c['ratio']:.3f} | {c['ratio_paired_median']:.3f}" if ours else "1 | 1"
            loss = f"{c['loss_rel_diff_last']:.1e} / {c['loss_rel_diff_max']:.1e}" if ours else "-"
            lines.append(
                f"| {side['label']} | {side['gradient_dtype']} | {side['gradient_buffer_bytes'] / 2**20:.2f} | "
                f"{side['reduced_bytes_per_step'] / 2**20:.2f} | {side['scale_ms']:.1f} | "
                f"{side['all_reduce_ms']:.1f} | {alone} | {side['median_ms']:.0f} | {ratio} | "
                f"{loss} | {pairing['other_load']:.0%} |"
            )
    lines += [
        "",
        "1/N scaling and all-reduce: the two parts of reducing the whole buffer once, each timed alone on a scratch "
        "tensor of its size and type. Reduction alone: the gradient synchronisation of one micro-batch's gradients "
        "with nothing to hide behind ((b) of the overlap measurement above). Medians of the tries, mean of the ranks. "
        "ms/step: median round of whole steps (two micro-batches, clip, AdamW); ratio and paired as above.",
    ]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["step", "markdown"])
    parser.add_argument("--only", nargs="+", default=list(PAIRINGS), choices=PAIRINGS)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--overlap-repeats", type=int, default=5, help="tries per overlap measurement (0: skip)")
    for flag, default in (
        ("layers", 4),
        ("hidden", 384),
        ("heads", 6),
        ("ffn", 1536),
        ("vocab", 8192),
        ("seq", 128),
        ("micro-batch-size", 4),
        ("microbatches", 2),
    ):
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--bucket-size", type=int, default=1_000_000, help="paratron's ddp_bucket_size (elements)")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--cores", type=int, default=2, help="CPU cores shared by the two processes")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    tiny = dict(layers=2, hidden=64, heads=4, ffn=128, vocab=256, seq=32, micro_batch_size=2, rounds=1)
    apply_smoke(args, parser, **tiny, overlap_repeats=1, bucket_size=10_000)
    md_path = args.markdown or (args.output.with_suffix(".md") if args.output else None)
    if args.what == "markdown":
        if not args.output:
            parser.error("markdown needs --output (the JSON to read)")
        md_path.write_text(markdown(json.loads(args.output.read_text())))
        return
    settings = {k: v for k, v in vars(args).items() if k not in ("what", "output", "markdown", "smoke")}
    results = step(settings, forked=args.smoke)
    if args.smoke:
        check(results, args.only)
    from paratron.model.gpt import build_model

    n = sum(p.numel() for p in build_model(_config(settings).model, seed=args.seed).parameters())
    results["model"] = {
        **_config(settings).model.__dict__,
        "parameters": n,
        "seq_length": args.seq,
        "micro_batch_size": args.micro_batch_size,
        "microbatches": args.microbatches,
        "bucket_size": args.bucket_size,
        "precision": PRECISION,
    }
    results["timing"] = {
        "cores": args.cores,
        "backend": "gloo",
        "torch": torch.__version__,
        "threads_per_process": results.pop("threads_per_process"),
    }
    run = {
        "command": "python bench/data_parallel.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "commit": _commit(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "rounds": args.rounds,
        "steps": args.steps,
    }
    for name in args.only:
        results[name]["run"] = run
    if args.output:
        merged = json.loads(args.output.read_text()) if args.output.exists() else {}
        merged.update(results)
        args.output.write_text(json.dumps(merged, indent=2, default=str))
        results = merged
    text = markdown(results)
    print(text, flush=True)
    if md_path:
        md_path.write_text(text)


if __name__ == "__main__":
    main()
