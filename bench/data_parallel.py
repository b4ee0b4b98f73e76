"""Data parallelism and ZeRO benchmark: paratron against PyTorch's own DDP, ZeroRedundancyOptimizer and FSDP2.

    python bench/data_parallel.py step --output bench/results/data_parallel.json     # everything (~6 min, 2 cores)
    python bench/data_parallel.py step --only zero3 --rounds 4 --output bench/results/data_parallel.json
    python bench/data_parallel.py step --layers 2 --hidden 64 --vocab 512 --seq 32 --rounds 1 --steps 1  # smoke
    python bench/data_parallel.py markdown --output bench/results/data_parallel.json  # redo the .md from the JSON

`step` trains the same GPT (paratron's model code, same seed, untied embeddings, fp32, no dropout)
on two gloo processes (data-parallel size 2) in several ways side by side, every side from the
same initial weights and on the same batches: each step is `--microbatches` micro-batches per
rank (gradients accumulate; only the last micro-batch synchronises), a global-norm clip at 1.0
and an AdamW step (same hyper-parameters, weight decay on matrices only). Pairings (`--only`):

    ddp    paratron stage 0, with and without --overlap-grad-reduce, vs torch DistributedDataParallel
           (default buckets: 25 MiB, first one 1 MiB; and bucket_cap_mb matched to paratron's
           --bucket-size), `no_sync()` on the first micro-batch, torch AdamW, clip_grad_norm_
    zero1  paratron --zero-stage 1, with and without --overlap-grad-reduce, vs torch
           ZeroRedundancyOptimizer(optimizer_class=AdamW) over DDP (default buckets)
    zero3  paratron --zero-stage 3, vs FSDP2 fully_shard applied by hand to each transformer block
           and then the root, set_requires_gradient_sync(False) on all but the last micro-batch

Every side of a pairing makes one warm-up step, then `--rounds` rounds of `--steps` timed steps
(barriers around each round; the order of the sides rotates every round). Reported: the median
round of each side, the ratio of medians and the median of per-round ratios paratron / peer
(below 1: paratron faster). Every side takes the same number of steps on the same batches, so
the two sides' rank-averaged losses are compared step by step (relative difference).

Communication overlap (`ddp` and `zero1` pairings, paratron sides): on one micro-batch, with
the forward pass never timed, (a) backward with gradient sync disabled: compute only; (b) then,
after a barrier, `finish_grad_sync()`, which reduces every bucket at once: the communication
when nothing hides it; (c) backward + `finish_grad_sync()` with sync enabled. The share of
communication hidden behind backward is (a + b - c) / b, clipped to [0, 1]: 0 when the
reduction adds its whole time, 1 when it adds nothing. Medians of `--overlap-repeats` tries,
averaged over the two ranks. Results merge into `--output` by pairing; the Markdown summary
(`--markdown`, default: the output's name with .md) is written from the merged results.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

Batch = list[tuple[torch.Tensor, torch.Tensor]]
PAIRINGS = ("ddp", "zero1", "zero3")
LABELS = {
    "paratron": "paratron stage 0", "paratron-overlap": "paratron stage 0 + overlap_grad_reduce",
    "torch-ddp": "torch DDP (default buckets)", "torch-ddp-matched": "torch DDP (bucket_cap_mb matched)",
    "paratron-zero1": "paratron ZeRO-1", "paratron-zero1-overlap": "paratron ZeRO-1 + overlap_grad_reduce",
    "torch-zero1": "torch ZeroRedundancyOptimizer + DDP",
    "paratron-zero3": "paratron ZeRO-3", "torch-fsdp2": "torch FSDP2 fully_shard",
}
COMPARISONS = {
    "ddp": [("paratron", "torch-ddp"), ("paratron", "torch-ddp-matched"), ("paratron-overlap", "torch-ddp"),
            ("paratron-overlap", "torch-ddp-matched")],
    "zero1": [("paratron-zero1", "torch-zero1"), ("paratron-zero1-overlap", "torch-zero1")],
    "zero3": [("paratron-zero3", "torch-fsdp2")],
}


def _config(args: dict, **parallel: Any) -> Any:
    from paratron.config import build_config

    return build_config(dict(
        num_layers=args["layers"], hidden_size=args["hidden"], num_attention_heads=args["heads"],
        ffn_hidden_size=args["ffn"], vocab_size=args["vocab"], max_position_embeddings=args["seq"],
        make_vocab_size_divisible_by=1, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
        attention_dropout=0.0, seq_length=args["seq"], micro_batch_size=args["micro_batch_size"],
        global_batch_size=args["micro_batch_size"] * args["microbatches"] * 2, mock_data=True, seed=args["seed"],
        ddp_bucket_size=args["bucket_size"], **parallel))


@dataclass
class Side:
    """One way of training: a step function over this rank's micro-batches, returning the step's loss."""

    step: Callable[[Batch], torch.Tensor]
    model: Any = None  # paratron's DataParallel wrapper (for the overlap measurement)
    losses: list[torch.Tensor] = field(default_factory=list)

    def run(self, pool: list[Batch]) -> None:
        self.losses.append(self.step(pool[len(self.losses) % len(pool)]))


def _paratron(args: dict, topology: Any, **parallel: Any) -> Side:
    from paratron.model.gpt import GPT
    from paratron.optim.build import build_optimizer
    from paratron.parallel.parallelize import parallelize
    from paratron.training.step import Precision, train_step

    config = _config(args, **parallel)
    with torch.device("meta"):
        meta = GPT(config.model)
    model = parallelize(meta, config, topology, torch.device("cpu"))
    optimizer = build_optimizer(model, config.optimizer)
    precision = Precision("fp32", torch.device("cpu"), model.norm_group)
    return Side(lambda batches: train_step(model, optimizer, batches, precision, 1.0).loss, model)


def _adamw_groups(model: nn.Module, args: dict) -> tuple[list[dict], dict]:
    """What a PyTorch user writes: decay on matrices only; paratron's defaults for the rest."""
    o = _config(args).optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return groups, dict(lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)


def _torch_step(model: nn.Module, optimizer: Any, sync: Callable[[bool], Any]) -> Callable[[Batch], torch.Tensor]:
    """The plain training step: `sync(last)` is the context a micro-batch's forward and backward run in."""
    from paratron.model.loss import language_model_loss

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

    return step


def _torch_ddp(args: dict, bucket_cap_mb: float | None = None, zero: bool = False) -> Side:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from paratron.model.gpt import build_model

    ddp = DistributedDataParallel(build_model(_config(args).model, seed=args["seed"]), bucket_cap_mb=bucket_cap_mb)
    groups, settings = _adamw_groups(ddp, args)
    if zero:
        optimizer = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **settings)
    else:
        optimizer = torch.optim.AdamW(groups, **settings)
    return Side(_torch_step(ddp, optimizer, lambda last: contextlib.nullcontext() if last else ddp.no_sync()), ddp)


def _torch_fsdp2(args: dict) -> Side:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from paratron.model.gpt import build_model

    model = build_model(_config(args).model, seed=args["seed"])
    mesh = init_device_mesh("cpu", (2,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    groups, settings = _adamw_groups(model, args)
    optimizer = torch.optim.AdamW(groups, **settings)

    def sync(last: bool) -> contextlib.AbstractContextManager:
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    return Side(_torch_step(model, optimizer, sync), model)


def _sides(name: str, args: dict, topology: Any) -> dict[str, Side]:
    if name == "ddp":
        matched = args["bucket_size"] * 4 / 2**20  # fp32 elements -> MiB
        return {"paratron": _paratron(args, topology), "paratron-overlap": _paratron(args, topology, overlap_grad_reduce=True),
                "torch-ddp": _torch_ddp(args), "torch-ddp-matched": _torch_ddp(args, bucket_cap_mb=matched)}
    if name == "zero1":
        return {"paratron-zero1": _paratron(args, topology, zero_stage=1),
                "paratron-zero1-overlap": _paratron(args, topology, zero_stage=1, overlap_grad_reduce=True),
                "torch-zero1": _torch_ddp(args, zero=True)}
    return {"paratron-zero3": _paratron(args, topology, zero_stage=3), "torch-fsdp2": _torch_fsdp2(args)}


def _timed_round(side: Side, pool: list[Batch], steps: int) -> float:
    """ms per step, between barriers, so that both ranks' last operation is inside the time."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        side.run(pool)
    dist.barrier()
    return (time.perf_counter() - start) / steps * 1e3


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
        model.zero_grad_buffer()
        model.require_grad_sync(sync)
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
        model.require_grad_sync(True)
        model.zero_grad_buffer()
        a, b, c = _rank_mean([statistics.median(x) * 1e3 for x in tries[key]])
        raw = (a + b - c) / b
        out[key] = {"buckets": len(model.reducer.buckets), "overlap_grad_reduce": model.reducer.overlap,
                    "mode": model.reducer.mode, "compute_ms": a, "exposed_comm_ms": b, "backward_and_sync_ms": c,
                    "hidden_share": min(1.0, max(0.0, raw)), "hidden_share_raw": raw}
    return out


def _pairing(name: str, args: dict, topology: Any, pool: list[Batch]) -> dict:
    import torch.distributed as dist

    sides = _sides(name, args, topology)
    for side in sides.values():
        side.run(pool)  # warm-up (DDP rebuilds its buckets after its first step)
    keys = list(sides)
    times: dict[str, list[float]] = {k: [] for k in keys}
    for r in range(args["rounds"]):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            times[key].append(_timed_round(sides[key], pool, args["steps"]))
    losses = {k: _rank_mean([float(x) for x in side.losses]) for k, side in sides.items()}
    result: dict[str, Any] = {"sides": {}, "comparisons": []}
    for key in keys:
        result["sides"][key] = {"label": LABELS[key], "median_ms": statistics.median(times[key]),
                                "rounds_ms": times[key], "losses": losses[key]}
    for ours, peer in COMPARISONS[name]:
        rel = [abs(a - b) / abs(b) for a, b in zip(losses[ours], losses[peer])]
        result["comparisons"].append({
            "paratron": ours, "peer": peer, "ratio": result["sides"][ours]["median_ms"] / result["sides"][peer]["median_ms"],
            "ratio_paired_median": statistics.median(a / b for a, b in zip(times[ours], times[peer])),
            "steps_compared": len(rel), "loss_first": losses[ours][0], "loss_last": losses[ours][-1],
            "loss_rel_diff_last": rel[-1], "loss_rel_diff_max": max(rel)})
    if name in ("ddp", "zero1") and args["overlap_repeats"] > 0:
        result["overlap"] = _overlap({k: side.model for k, side in sides.items() if k.startswith("paratron")},
                                     pool[0][-1], args["overlap_repeats"])
    model = sides[keys[0]].model
    if model.reducer is not None:
        result["paratron_bucket_elements"] = [b.end - b.start for b in model.reducer.buckets]
    if "torch-ddp" in sides:
        result["torch_ddp_buckets"] = {k: {n: v for n, v in sides[k].model._get_ddp_logging_data().items()
                                           if n in ("rebuilt_bucket_sizes", "bucket_cap_bytes")}
                                       for k in ("torch-ddp", "torch-ddp-matched")}
    dist.barrier()
    return result


def _step_worker(rank: int, world: int, port: int, args: dict, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
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
        ids = torch.randint(0, args["vocab"], (world * mb * m, seq + 1), generator=generator)[rank * mb * m:][:mb * m]
        pool.append([(ids[i:i + mb, :-1].contiguous(), ids[i:i + mb, 1:].contiguous()) for i in range(0, mb * m, mb)])
    results: dict[str, Any] = {}
    for name in args["only"]:
        results[name] = _pairing(name, args, topology, pool)
        if rank == 0:
            print(f"{name}: done", flush=True)
    if rank == 0:
        results["threads_per_process"] = torch.get_num_threads()
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def step(args: dict) -> dict:
    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from multiprocess import free_port

    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        mp.spawn(_step_worker, args=(2, free_port(), args, out.name), nprocs=2)
        return json.loads(Path(out.name).read_text())


def markdown(results: dict) -> str:
    """The summary section for BENCHMARKS.md, from the merged results."""
    m, t = results["model"], results["timing"]
    lines = ["## Data parallelism and ZeRO against PyTorch", "",
             f"Two gloo processes on a {t['cores']}-core CPU ({t['threads_per_process']} thread(s) each), fp32, "
             f"torch {t['torch']}. Model: paratron's GPT, {m['num_layers']} layers, hidden {m['hidden_size']}, "
             f"{m['num_attention_heads']} heads, FFN {m['ffn_hidden_size']}, vocab {m['vocab_size']} (untied), "
             f"{m['parameters'] / 1e6:.1f} M parameters; sequence {m['seq_length']}, micro-batch "
             f"{m['micro_batch_size']}, {m['microbatches']} micro-batches per rank and step (sync on the last only), "
             f"clip 1.0, AdamW. Step = forward + backward of every micro-batch + clip + optimizer step. "
             f"paratron buckets: {m['bucket_size']:,} elements; DDP matched: bucket_cap_mb "
             f"{m['bucket_size'] * 4 / 2**20:.2f}. {t['rounds']} rounds of {t['steps']} steps after one warm-up step, "
             f"side order rotating every round.", "", "```"]
    lines += list(dict.fromkeys(results["commands"][name] for name in PAIRINGS if name in results["commands"]))
    lines += ["```", "", "| paratron | PyTorch peer | paratron ms | peer ms | ratio | paired ratio | loss rel. diff (last / max) |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for name in PAIRINGS:
        if name not in results:
            continue
        sides = results[name]["sides"]
        for c in results[name]["comparisons"]:
            ours, peer = sides[c["paratron"]], sides[c["peer"]]
            lines.append(f"| {ours['label']} | {peer['label']} | {ours['median_ms']:.0f} | {peer['median_ms']:.0f} | "
                         f"{c['ratio']:.3f} | {c['ratio_paired_median']:.3f} | "
                         f"{c['loss_rel_diff_last']:.1e} / {c['loss_rel_diff_max']:.1e} |")
    lines += ["", "Ratio: paratron's median round over the peer's (below 1: paratron faster); paired: median of the "
              "per-round ratios. Loss: rank-averaged loss of the same step on both sides, "
              "relative difference at the last step and the largest over all steps (the same batches cycle, so "
              "the loss falls fast: " + ", ".join(f"{name} {c['loss_first']:.3f} -> {c['loss_last']:.3f}" for name in PAIRINGS
                                                 if name in results for c in results[name]["comparisons"][:1]) + ").",
              "", "Gradient communication hidden behind backward (one micro-batch, forward not timed; ms, mean of the ranks):",
              "", "| paratron | reduction | buckets | (a) backward, no sync | (b) sync alone | (c) backward + sync | hidden (a+b-c)/b |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for name in ("ddp", "zero1"):
        for key, o in results.get(name, {}).get("overlap", {}).items():
            lines.append(f"| {LABELS[key]} | {o['mode']} | {o['buckets']} | {o['compute_ms']:.0f} | "
                         f"{o['exposed_comm_ms']:.0f} | {o['backward_and_sync_ms']:.0f} | "
                         f"{o['hidden_share']:.2f} (raw {o['hidden_share_raw']:+.2f}) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["step", "markdown"])
    parser.add_argument("--only", nargs="+", default=list(PAIRINGS), choices=PAIRINGS)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--overlap-repeats", type=int, default=5, help="tries per overlap measurement (0: skip)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--ffn", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--bucket-size", type=int, default=1_000_000, help="paratron's ddp_bucket_size (elements)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--cores", type=int, default=2, help="CPU cores shared by the two processes")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()
    md_path = args.markdown or (args.output.with_suffix(".md") if args.output else None)
    if args.what == "markdown":
        if not args.output:
            parser.error("markdown needs --output (the JSON to read)")
        md_path.write_text(markdown(json.loads(args.output.read_text())))
        return
    settings = {k: v for k, v in vars(args).items() if k not in ("what", "output", "markdown")}
    results = step(settings)
    from paratron.model.gpt import build_model

    n = sum(p.numel() for p in build_model(_config(settings).model, seed=args.seed).parameters())
    results["model"] = {**_config(settings).model.__dict__, "parameters": n, "seq_length": args.seq,
                        "micro_batch_size": args.micro_batch_size, "microbatches": args.microbatches,
                        "bucket_size": args.bucket_size, "precision": "fp32"}
    results["timing"] = {"rounds": args.rounds, "steps": args.steps, "cores": args.cores, "backend": "gloo",
                         "threads_per_process": results.pop("threads_per_process"), "torch": torch.__version__}
    command = "python bench/data_parallel.py " + " ".join(sys.argv[1:])
    results["commands"] = {name: command for name in args.only}
    if args.output:
        merged = json.loads(args.output.read_text()) if args.output.exists() else {}
        merged.update({k: v for k, v in results.items() if k != "commands"})
        merged["commands"] = {**merged.get("commands", {}), **results["commands"]}
        args.output.write_text(json.dumps(merged, indent=2, default=str))
        results = merged
    text = markdown(results)
    print(text, flush=True)
    if md_path:
        md_path.write_text(text)


if __name__ == "__main__":
    main()
