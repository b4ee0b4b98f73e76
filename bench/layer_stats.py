"""What per-layer statistics cost (`--log-layer-stats N`): step time with them off, every 10 steps and every step.

    .venv/bin/python bench/layer_stats.py
    .venv/bin/python bench/layer_stats.py --rounds 7 --layers 12
    .venv/bin/python bench/layer_stats.py --smoke  # tiny: does it still run, with the same losses in every mode?

This process trains a GPT-2-style model in fp32 with paratron's training step, as the trainer does: on a recording
step the statistics watch the forwards, take the gradients and the update, and are reduced into the step's record
(`LayerStats.finish`, then the record is serialized as for metrics.jsonl). The statistics only read: a fresh model per
mode, from the same seed, must give the same losses on the same batches. The times come from one model (so that
where each model's memory happens to lie does not weigh in), in rounds of --every steps (10) of each mode in turn,
each round beginning with the next mode, so drift in the machine's speed hits all of them; the time reported is the
median over rounds of the mean step time.

Writes bench/results/layer_stats.json and .md (a section for BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from common import RESULTS, add_smoke_argument, apply_smoke
from paratron.config import build_config
from paratron.config.layout import resolve_layout
from paratron.debugging.layer_stats import LayerStats
from paratron.distributed.topology import ParallelDims, Topology
from paratron.model.batch import Batch
from paratron.model.gpt import GPT
from paratron.optim.build import build_optimizer
from paratron.optim.mixed_precision import Precision
from paratron.optim.protocol import TrainingOptimizer
from paratron.parallel.model import ParallelModel
from paratron.parallel.parallelize import parallelize
from paratron.storage import write_text_atomic
from paratron.training.step import StepOptions, train_step


def modes(every: int) -> dict[str, int]:
    """Each mode's --log-layer-stats: off, every `every` steps (rounds of that many steps: one recording step each)
    and every step."""
    return {"off": 0, f"every {every}": every, "every 1": 1}


def model_builder(args: dict) -> Callable[[], tuple[ParallelModel, TrainingOptimizer]]:
    """What builds the benchmark's model and its optimizer, the same each time (one process)."""
    topology = Topology(ParallelDims(1), 0)
    topology.create_groups()
    shape = dict(num_layers=args["layers"], hidden_size=args["hidden_size"], num_attention_heads=args["heads"])
    config = build_config(
        dict(
            shape,
            seq_length=args["seq_length"],
            max_position_embeddings=args["seq_length"],
            vocab_size=8192,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            mock_data=True,
            seed=3,
        )
    )

    def build() -> tuple[ParallelModel, TrainingOptimizer]:
        with torch.device("meta"):
            meta = GPT(config.model)
        model = parallelize(
            meta, config, topology, torch.device("cpu"), resolve_layout(config, topology.dims.world_size)
        )
        return model, build_optimizer(model, config.optimizer)

    return build


def run(args: dict) -> dict:
    """In this process (one rank): per mode, the mean step time of every round and the losses."""
    torch.set_num_threads(args["threads"])
    build = model_builder(args)
    tokens = torch.randint(
        0, 8192, (args["micro_batch_size"], args["seq_length"] + 1), generator=torch.Generator().manual_seed(0)
    )
    batches = [Batch(tokens[:, :-1], tokens[:, 1:])]
    precision = Precision("fp32")
    every = modes(args["every"])
    result = {mode: {"times": [], "losses": [], "keys": 0} for mode in every}

    def step(model: ParallelModel, optimizer: TrainingOptimizer, stats: LayerStats, number: int, mode: str) -> float:
        options = StepOptions(layer_stats=stats if stats.due(number) else None)
        loss = float(train_step(model, optimizer, batches, precision, 1.0, options=options).loss)
        if options.layer_stats is not None:
            record = {"step": number, **options.layer_stats.finish()}
            json.dumps(record)  # (as the record is written to metrics.jsonl)
            result[mode]["keys"] = len(record) - 1
        return loss

    # the losses: a fresh model per mode, the same steps
    for mode, n in every.items():
        model, optimizer = build()
        stats = LayerStats(model, optimizer, sequence_parallel=False, every=n)
        result[mode]["losses"] = [step(model, optimizer, stats, i, mode) for i in range(1, args["every"] + 1)]
    # the times: one model, rounds of each mode in turn (each round begins with the next mode)
    model, optimizer = build()
    stats = {mode: LayerStats(model, optimizer, sequence_parallel=False, every=n) for mode, n in every.items()}
    names = list(every)
    for round_ in range(args["rounds"]):
        for mode in names[round_ % 3 :] + names[: round_ % 3]:
            started = time.perf_counter()
            for i in range(1, args["every"] + 1):
                step(model, optimizer, stats[mode], i, mode)
            result[mode]["times"].append((time.perf_counter() - started) / args["every"])
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--every", type=int, default=10, help="the sparse mode's --log-layer-stats (steps per round)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", type=Path, default=RESULTS / "layer_stats.json")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    apply_smoke(args, parser, layers=2, hidden_size=32, heads=2, seq_length=16, micro_batch_size=2, rounds=1, every=2)

    settings = {k: v for k, v in vars(args).items() if k not in ("output", "smoke")}
    result = run(settings)
    base, base_best = statistics.median(result["off"]["times"]), min(result["off"]["times"])
    rows = []
    for mode, r in result.items():
        median, best = statistics.median(r["times"]), min(r["times"])
        same = r["losses"] == result["off"]["losses"]
        row = dict(mode=mode, step_s=median, ratio=median / base, best_s=best, best_ratio=best / base_best)
        rows.append(dict(row, keys=r["keys"], same_losses=same))
        print(
            f"{mode:8s} median {median:.4f} s/step ({median / base:.3f}x), best {best:.4f} ({best / base_best:.3f}x), "
            f"{r['keys']} keys, same losses: {same}"
        )
    assert all(r["same_losses"] for r in rows), "recording layer statistics changed the losses"
    assert rows[0]["keys"] == 0 and rows[1]["keys"] == rows[2]["keys"] > 4 * args.layers, "statistics went missing"
    command = "python bench/layer_stats.py" + "".join(
        f" --{k.replace('_', '-')} {v}" for k, v in settings.items() if v != parser.get_default(k)
    )
    payload = {"command": command, "settings": settings, "torch": torch.__version__, "rows": rows, "raw": result}
    lines = [
        "## Per-layer statistics: their cost in step time",
        "",
        f"`{command}` (writes bench/results/layer_stats.json): a GPT-2-style model ({args.layers} layers, hidden "
        f"{args.hidden_size}, {args.heads} heads, sequence {args.seq_length}, micro-batch {args.micro_batch_size}), "
        f"fp32, one process, {args.threads} thread(s), paratron's training step on one model; median over "
        f"{args.rounds} rounds of {args.every} steps of each mode in turn of the mean step time, and the best round "
        "(the least disturbed by other work on the machine). A recording step also reduces the statistics into the "
        "step's record. Losses: a fresh model per mode, the same steps.",
        "",
        "| --log-layer-stats | median step time (s) | vs off | best round (s) | vs off | statistics per record | "
        "losses equal to off |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['step_s']:.4f} | {r['ratio']:.3f} | {r['best_s']:.4f} | {r['best_ratio']:.3f} | "
            f"{r['keys']} | "
            f"{'yes' if r['same_losses'] else 'no'} |"
        )
    text = "\n".join(lines) + "\n"
    write_text_atomic(args.output, json.dumps(payload, indent=1))
    write_text_atomic(args.output.with_suffix(".md"), text)
    print(text)


if __name__ == "__main__":
    main()
