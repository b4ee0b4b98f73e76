"""Attention cost against sequence length: forward + backward time and peak memory of one
attention call, one process, fp32.

    python bench/attention.py --output bench/results/attention.json --plot docs/images/attention_scaling.png
    python bench/attention.py --smoke  # short sequences in this process: does it still run?

Kinds, each at lengths 1K-16K (batch 1, 8 heads of 64, sliding window W = 512):

- `causal`: SDPA's fused causal kernel (paratron's `causal`);
- `window-dense-mask`: a sliding window as one would write it with SDPA alone, a T x T boolean mask;
- `sliding-window`: paratron's `sliding-window` (SDPA over only the key blocks each query block
  reaches).

Each (kind, length) runs in a fresh process, so its peak resident memory (minus the process's
resident memory once the inputs exist) is that attention's own; time is the median of the
timed rounds after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from common import add_smoke_argument, apply_smoke
from paratron.model.attention import Causal, SlidingWindow, TokenPlaces, attend

KINDS = ("causal", "window-dense-mask", "sliding-window")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def one(kind: str, length: int, window: int, rounds: int) -> dict:
    """Time and memory of `kind` at `length` (run in its own process)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, length, 64, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, 8, length, 64)
    pattern = Causal() if kind == "causal" else SlidingWindow(window)

    def run() -> None:
        if kind == "window-dense-mask":
            mask = pattern.allows(torch.arange(length)[:, None], torch.arange(length)[None, :])
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            out = attend(pattern, q, k, v, TokenPlaces.row(length, q.device))
        out.backward(grad)

    base = _rss_bytes()
    times = []
    for r in range(rounds + 1):
        start = time.perf_counter()
        run()
        if r:
            times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"kind": kind, "length": length, "seconds": statistics.median(times), "peak_mb": (peak - base) / 2**20}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for kind in KINDS:
        rows = [r for r in results if r["kind"] == kind]
        lengths = [r["length"] for r in rows]
        left.plot(lengths, [r["seconds"] for r in rows], marker="o", label=kind)
        right.plot(lengths, [r["peak_mb"] for r in rows], marker="o", label=kind)
    for axis, label in ((left, "forward + backward (s)"), (right, "peak memory above inputs (MiB)")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("sequence length")
        axis.set_ylabel(label)
        axis.grid(True, which="both", alpha=0.3)
    left.legend()
    fig.suptitle("Attention cost, 8 heads x 64, fp32, one CPU process (window 512)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--one", nargs=2, metavar=("KIND", "LENGTH"), help=argparse.SUPPRESS)
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    apply_smoke(args, parser, lengths="256,512", window=128, rounds=1)
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), args.window, args.rounds)))
        return
    results = []
    for length in map(int, args.lengths.split(",")):
        for kind in KINDS:
            if args.smoke:  # (in this process: the memory figure means nothing, the code runs)
                row = one(kind, length, args.window, args.rounds)
            else:
                command = [sys.executable, __file__, "--one", kind, str(length)]
                command += ["--window", str(args.window), "--rounds", str(args.rounds)]
                row = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
            results.append(row)
            print(f"{kind:>18} {length:>6}: {row['seconds']:.3f} s, {row['peak_mb']:.0f} MiB", flush=True)
    for kind in KINDS:  # growth from the shortest to the longest length, against the length's
        rows = [r for r in results if r["kind"] == kind]
        grow = rows[-1]["length"] / rows[0]["length"]
        print(f"{kind}: x{grow:.0f} length -> time x{rows[-1]['seconds'] / rows[0]['seconds']:.1f}")
    if args.output:
        args.output.write_text(json.dumps({"window": args.window, "results": results}, indent=1) + "\n")
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
