"""Step time and activation memory of activation recomputation, side by side: none, selective
(the attention core) and full (every layer, uniform groups of one).

    .venv/bin/python bench/recompute.py
    .venv/bin/python bench/recompute.py --rounds 7 --steps 3 --hidden-size 512
    .venv/bin/python bench/recompute.py --smoke  # tiny: does it still run, with the same losses in every mode?

One process builds the same GPT-2-style model (dropout 0.1, so the attention core keeps its
quadratic activations) once per mode from the same seed and trains it in fp32 with paratron's
training step on the same batches. Rounds alternate the modes, so drift in the machine's speed
hits all of them; the time reported is the median over rounds of the mean step time. Each mode's
activations saved for backward are counted once with `paratron.training.memory_report.SavedActivations`.

Writes bench/results/recompute.json and .md (a section for BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from common import RESULTS, add_smoke_argument, apply_smoke
from paratron.distributed.local_ranks import run_ranks
from paratron.storage import write_text_atomic

MODES = {
    "none": {},
    "selective": dict(recompute_granularity="selective"),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


def run(args: dict) -> dict:
    """In a one-rank gloo world: per mode, step times of every round and saved activation bytes."""
    from paratron.config import build_config
    from paratron.config.layout import resolve_layout
    from paratron.distributed.init import initialize
    from paratron.distributed.topology import ParallelDims, Topology
    from paratron.model.batch import Batch
    from paratron.model.gpt import GPT
    from paratron.optim.build import build_optimizer
    from paratron.optim.mixed_precision import Precision
    from paratron.parallel.parallelize import parallelize
    from paratron.training.memory_report import SavedActivations
    from paratron.training.step import train_step

    torch.set_num_threads(args["threads"])
    initialize("gloo")
    topology = Topology(ParallelDims(1), 0)
    topology.create_groups()
    shape = dict(
        num_layers=args["layers"],
        hidden_size=args["hidden_size"],
        num_attention_heads=args["heads"],
        seq_length=args["seq_length"],
        max_position_embeddings=args["seq_length"],
        vocab_size=8192,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        mock_data=True,
        seed=3,
    )
    models = {}
    for mode, recompute in MODES.items():
        config = build_config(dict(shape, **recompute))
        with torch.device("meta"):
            meta = GPT(config.model)
        model = parallelize(
            meta, config, topology, torch.device("cpu"), resolve_layout(config, topology.dims.world_size)
        )
        models[mode] = (model, build_optimizer(model, config.optimizer))
    tokens = torch.randint(
        0, 8192, (args["micro_batch_size"], args["seq_length"] + 1), generator=torch.Generator().manual_seed(0)
    )
    batches = [Batch(tokens[:, :-1], tokens[:, 1:])]
    precision = Precision("fp32")
    result = {mode: {"times": [], "losses": []} for mode in MODES}

    def step(mode: str) -> None:
        model, optimizer = models[mode]
        torch.manual_seed(len(result[mode]["losses"]))  # the k-th step of every mode draws the same dropout
        result[mode]["losses"].append(float(train_step(model, optimizer, batches, precision, 1.0).loss))

    for mode, (model, _) in models.items():
        with SavedActivations(model.module) as activations:
            step(mode)
        result[mode]["activations_peak"] = activations.peak
    for _ in range(args["rounds"]):
        for mode in models:
            started = time.perf_counter()
            for _ in range(args["steps"]):
                step(mode)
            result[mode]["times"].append((time.perf_counter() - started) / args["steps"])
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=RESULTS / "recompute.json")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    tiny = dict(layers=2, hidden_size=64, heads=2, seq_length=32, micro_batch_size=2, rounds=1, steps=1)
    apply_smoke(args, parser, **tiny)

    settings = {k: v for k, v in vars(args).items() if k not in ("output", "smoke")}
    result = run_ranks(run, 1, settings, timeout=3600.0)[0]
    base = statistics.median(result["none"]["times"])
    rows = []
    for mode, r in result.items():
        median = statistics.median(r["times"])
        rows.append(
            dict(
                mode=mode,
                step_s=median,
                ratio=median / base,
                activations_peak=r["activations_peak"],
                activation_ratio=r["activations_peak"] / result["none"]["activations_peak"],
                same_losses=r["losses"] == result["none"]["losses"],
            )
        )
        print(
            f"{mode:9s} {median:.3f} s/step ({median / base:.3f}x), activations {r['activations_peak'] / 2**20:.1f} "
            f"MiB, losses equal to none: {rows[-1]['same_losses']}",
            flush=True,
        )
    if args.smoke:
        assert all(r["same_losses"] for r in rows), "a recomputation mode changed the losses"
    command = "python bench/recompute.py" + "".join(
        f" --{k.replace('_', '-')} {v}" for k, v in settings.items() if v != parser.get_default(k)
    )
    payload = {"command": command, "settings": settings, "torch": torch.__version__, "rows": rows, "raw": result}
    lines = [
        "## Activation recomputation: step time against memory",
        "",
        f"`{command}` (writes bench/results/recompute.json): a GPT-2-style model ({args.layers} layers, hidden "
        f"{args.hidden_size}, {args.heads} heads, sequence {args.seq_length}, micro-batch {args.micro_batch_size}, "
        f"dropout 0.1), fp32, one process, {args.threads} threads; median over {args.rounds} alternating rounds "
        f"of {args.steps} steps. Activations: peak bytes saved for backward in one step.",
        "",
        "| recompute | step time (s) | vs none | activations (MiB) | vs none | losses equal to none |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['step_s']:.3f} | {r['ratio']:.3f} | {r['activations_peak'] / 2**20:.1f} | "
            f"{r['activation_ratio']:.3f} | {'yes' if r['same_losses'] else 'no'} |"
        )
    text = "\n".join(lines) + "\n"
    write_text_atomic(args.output, json.dumps(payload, indent=1))
    write_text_atomic(args.output.with_suffix(".md"), text)
    print(text)


if __name__ == "__main__":
    main()
