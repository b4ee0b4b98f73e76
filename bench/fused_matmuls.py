"""Forward + backward time of a block's input projections, one matmul (`Projections`) or one per layer.

    .venv/bin/python bench/fused_matmuls.py                  # 2,048 tokens, hidden 1,024, fp32 on the CPU
    .venv/bin/python bench/fused_matmuls.py --tokens 4096 --hidden 2048 --ffn 5632
    .venv/bin/python bench/fused_matmuls.py --smoke          # tiny sizes: does it still run?

Two groups of a Llama-style block: queries, keys and values (hidden -> 3 x hidden, no biases) and the SwiGLU gate
and up projections (hidden -> 2 x ffn). Each is timed both ways on the same weights, input and output gradient:
layer by layer (each `nn.Linear` called on its own: three, or two, matmuls each way) and stacked (`Projections`,
which concatenates the weights by rows and runs one matmul forward, one for the input gradient and one for the
weight gradients: `model/fused_linear.py`). The variants alternate round by round and the median is reported;
their outputs and gradients must agree. Writes bench/results/fused_matmuls.json and fused_matmuls.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from common import RESULTS, SEED, add_smoke_argument, apply_smoke
from paratron.model.mlp import Projections
from paratron.storage import write_text_atomic

TOLERANCE = 1e-5
"""Largest relative difference allowed between the two variants' outputs and gradients (fp32)."""


def _layer_by_layer(projections: Projections, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(linear(x) for linear in projections.values())


def _run(variant: str, projections: Projections, x: torch.Tensor, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """One forward + backward; the outputs and the gradients of x and of every weight."""
    x.grad = None
    projections.zero_grad(set_to_none=True)
    outputs = projections(x) if variant == "stacked" else _layer_by_layer(projections, x)
    torch.autograd.backward(outputs, grads)
    return [o.detach() for o in outputs] + [x.grad] + [p.grad for p in projections.parameters()]


def measure(name: str, widths: dict[str, int], tokens: int, hidden: int, rounds: int) -> dict:
    """Median forward + backward seconds of both variants on one group of projections."""
    gen = torch.Generator().manual_seed(SEED)
    projections = Projections(hidden, widths, bias=False)
    with torch.no_grad():
        for param in projections.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) / hidden**0.5)
    x = torch.randn(1, tokens, hidden, generator=gen).requires_grad_()
    grads = [torch.randn(1, tokens, width, generator=gen) for width in widths.values()]
    results = {variant: _run(variant, projections, x, grads) for variant in ("layer_by_layer", "stacked")}
    difference = max(
        ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        for a, b in zip(results["stacked"], results["layer_by_layer"])
    )
    if difference > TOLERANCE:
        raise SystemExit(f"{name}: stacked and layer-by-layer differ by {difference:.1e} (relative)")
    times: dict[str, list[float]] = {"layer_by_layer": [], "stacked": []}
    for _ in range(rounds):
        for variant in times:
            start = time.perf_counter()
            _run(variant, projections, x, grads)
            times[variant].append(time.perf_counter() - start)
    medians = {variant: statistics.median(values) for variant, values in times.items()}
    return {
        "group": name,
        "out_features": sum(widths.values()),
        "layer_by_layer_s": medians["layer_by_layer"],
        "stacked_s": medians["stacked"],
        "speedup": medians["layer_by_layer"] / medians["stacked"],
        "largest_relative_difference": difference,
    }


def markdown(result: dict) -> str:
    s = result["sizes"]
    return "\n".join(
        [
            "## Queries/keys/values and gate/up as one matmul",
            "",
            f"Forward + backward of a block's input projections on {s['tokens']:,} tokens at hidden {s['hidden']} "
            f"(ffn {s['ffn']}), fp32 on the CPU ({s['threads']} threads), no biases; median of {s['rounds']} rounds, "
            "the variants alternating. Layer by layer: each `nn.Linear` on its own. Stacked: `Projections`, one "
            "matmul over the concatenated weights forward and one each for the input and weight gradients.",
            "",
            "| projections | outputs | layer by layer | stacked | speed-up |",
            "|---|---|---|---|---|",
            *(
                f"| {g['group']} | {g['out_features']} | {g['layer_by_layer_s'] * 1e3:.1f} ms | "
                f"{g['stacked_s'] * 1e3:.1f} ms | {g['speedup']:.2f}x |"
                for g in result["groups"]
            ),
            "",
            "Outputs and gradients agree to "
            f"{max(g['largest_relative_difference'] for g in result['groups']):.1e} (relative).",
            "",
            f"Command: `{result['command']}`",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816, help="the gate's and up's width (Llama's 8/3 x hidden)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--output", type=Path, default=RESULTS / "fused_matmuls.json")
    parser.add_argument("--markdown", type=Path, default=RESULTS / "fused_matmuls.md")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    apply_smoke(args, parser, tokens=64, hidden=32, ffn=64, rounds=1)
    h = args.hidden
    groups = [
        measure("q, k, v", {"q": h, "k": h, "v": h}, args.tokens, h, args.rounds),
        measure("gate, up", {"gate": args.ffn, "up": args.ffn}, args.tokens, h, args.rounds),
    ]
    sizes = {"tokens": args.tokens, "hidden": h, "ffn": args.ffn, "rounds": args.rounds}
    sizes["threads"] = torch.get_num_threads()
    command = "python bench/fused_matmuls.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"sizes": sizes, "groups": groups, "command": command.strip()}
    write_text_atomic(args.output, json.dumps(result, indent=2) + "\n")
    write_text_atomic(args.markdown, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
