"""Training-step time with --compile (each block compiled by inductor) against eager, and the one-off compile time.

    .venv/bin/python bench/compile.py                          # GPT-2-style, 4 layers, hidden 256, seq 256, fp32, CPU
    .venv/bin/python bench/compile.py --hidden 512 --steps 12
    .venv/bin/python bench/compile.py --experts 8              # every MLP a mixture of 8 experts, top-2
    .venv/bin/python bench/compile.py --smoke                  # tiny, aot_eager: does it run, do the losses agree?

Both runs train the same model (same seed, same mock samples, dropout 0, fp32) in this process through paratron's
own loop (`run_training`), eager first, then with `--compile`. A step's time is the loop's `iteration-time`; the
figure is the median over the steps after `--warmup` (the first compiled step compiles the blocks, so the
compile time is that step's time less the compiled median). The two loss curves must agree (fp32 inductor reorders
sums: relative 1e-4). It writes bench/results/compile.json and compile.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch._dynamo

from common import NO_DROPOUT, RESULTS, SEED, add_smoke_argument, apply_smoke, smoke_folder
from paratron.config import build_config
from paratron.parallel.compile import CompileReport
from paratron.storage import write_text_atomic
from paratron.training.run import run_training

TOLERANCE = 1e-4
SIZES = ("layers", "hidden", "heads", "vocab", "seq", "micro_batch", "experts", "warmup", "steps")


def settings(args: argparse.Namespace, run_dir: Path) -> dict:
    return dict(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        vocab_size=args.vocab,
        seq_length=args.seq,
        max_position_embeddings=args.seq,
        micro_batch_size=args.micro_batch,
        global_batch_size=args.micro_batch,
        train_iters=args.warmup + args.steps,
        lr=1e-4,
        seed=SEED,
        mock_data=True,
        eval_iters=0,
        progress_bar=False,
        tensorboard=False,
        log_interval=1,
        run_dir=str(run_dir),
        **NO_DROPOUT,
        **(dict(num_experts=args.experts, moe_router_topk=2) if args.experts else {}),
    )


def run(args: argparse.Namespace, backend: str | None) -> dict:
    """One training run, eager (backend None) or compiled: its losses and step times."""
    folder = (smoke_folder() if args.smoke else Path(args.work)) / f"compile-{backend or 'eager'}"
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    values = settings(args, folder)
    if backend is not None:
        values.update(compile=True, compile_backend=backend)
    run_training(build_config(values))
    records = [json.loads(line) for line in open(folder / "metrics.jsonl")]
    times = [r["iteration-time"] for r in records]
    made = CompileReport.now()
    return {
        "losses": [r["loss"] for r in records],
        "first_step_s": times[0],
        "median_step_s": statistics.median(times[args.warmup :]),
        "graphs": made.graphs,
        "graph_breaks": made.graph_breaks,
    }


def markdown(result: dict) -> str:
    s, eager, compiled = result["sizes"], result["eager"], result["compiled"]
    return "\n".join(
        [
            f"## Compiled blocks (--compile, {result['backend']})",
            "",
            f"A GPT-2-style model ({s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads, vocabulary "
            f"{s['vocab']}, sequence {s['seq']}, micro-batch {s['micro_batch']}"
            + (f"; every MLP a mixture of {s['experts']} experts, top-2" if s["experts"] else "")
            + f"), fp32 on the CPU ({s['threads']} "
            f"threads), one process, trained through paratron's loop eager and then with --compile; median of "
            f"{s['steps']} steps after {s['warmup']} warm-up steps.",
            "",
            "| run | median step | first step |",
            "|---|---|---|",
            f"| eager | {eager['median_step_s'] * 1e3:.0f} ms | {eager['first_step_s']:.2f} s |",
            f"| --compile | {compiled['median_step_s'] * 1e3:.0f} ms | {compiled['first_step_s']:.2f} s |",
            "",
            f"Step time ratio compiled/eager {result['ratio']:.2f} (speed-up {1 / result['ratio']:.2f}x); one-off "
            f"compile time {result['compile_s']:.1f} s ({compiled['graphs']} graph(s), {compiled['graph_breaks']} "
            f"graph break(s)). Losses agree to {result['largest_relative_difference']:.1e} (relative).",
            "",
            f"Command: `{result['command']}`",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--experts", type=int, default=0, help="a mixture of this many experts in every MLP")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--work", default=str(Path("/tmp") / "paratron-bench-compile"), help="the runs' folders")
    parser.add_argument("--output", type=Path, default=RESULTS / "compile.json")
    parser.add_argument("--markdown", type=Path, default=RESULTS / "compile.md")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    tiny = dict(layers=2, hidden=32, heads=4, vocab=97, seq=16, micro_batch=2, experts=args.experts, warmup=1, steps=2)
    apply_smoke(args, parser, backend="aot_eager", **tiny)
    eager, compiled = run(args, None), run(args, args.backend)
    difference = max(abs(c - e) / max(abs(e), 1e-12) for c, e in zip(compiled["losses"], eager["losses"]))
    if len(compiled["losses"]) != len(eager["losses"]) or difference > TOLERANCE:
        raise SystemExit(f"compiled and eager losses disagree: {compiled['losses']} against {eager['losses']}")
    sizes = {k: getattr(args, k) for k in SIZES}
    sizes["threads"] = torch.get_num_threads()
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in sizes.items() if k != "threads")
    result = {
        "command": f"python bench/compile.py {flags} --backend {args.backend}",
        "backend": args.backend,
        "sizes": sizes,
        "eager": eager,
        "compiled": compiled,
        "ratio": compiled["median_step_s"] / eager["median_step_s"],
        "compile_s": compiled["first_step_s"] - compiled["median_step_s"],
        "largest_relative_difference": difference,
    }
    write_text_atomic(args.output, json.dumps(result, indent=2) + "\n")
    write_text_atomic(args.markdown, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main(sys.argv[1:])
