"""Peak memory and time of the output layer + cross-entropy + backward, fused (--cross-entropy-loss-fusion) or not.

    .venv/bin/python bench/fused_loss.py                              # 8,192 tokens, vocabulary 128,256, hidden 256
    .venv/bin/python bench/fused_loss.py --tokens 4096 --hidden 512
    .venv/bin/python bench/fused_loss.py --smoke                      # tiny sizes: does it still run?

(--smoke runs the fused variant in the benchmark's own process: a process start less, and its memory figure
means nothing there; the unfused one still runs in a child.)

Each variant runs in a process of its own (so that one's peak does not hide the other's): it makes the same fp32
hidden states [tokens, hidden], output weight [vocab, hidden] and labels (a tenth of them ignored) from one seed,
then runs the loss and its backward once: unfused, `token_losses(hidden @ W.T)` as the model does without the flag;
fused, `model.fused_loss.fused_token_losses`. The memory is the process's resident-set peak
(`distributed.init.peak_memory_bytes`, the repo's CPU meter) minus its resident set once the inputs exist: what the
loss and backward add. Both report the summed loss and the gradients' norms, which must agree.

Liger-Kernel's fused linear cross-entropy is the GPU peer of this method, but it needs triton and a GPU: it does
not run on this CPU, so no figure of it is given. It writes bench/results/fused_loss.json and fused_loss.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from common import RESULTS, SEED, add_smoke_argument, apply_smoke
from paratron.distributed.init import memory_now, peak_memory_bytes
from paratron.model.batch import IGNORE_INDEX
from paratron.model.fused_loss import chunk_tokens, fused_token_losses
from paratron.model.loss import token_losses
from paratron.storage import write_text_atomic

CPU = torch.device("cpu")


def measure(variant: str, tokens: int, vocab: int, hidden: int) -> dict:
    """One loss + backward of `variant` in this process: the memory it added, its time, and what it computed."""
    gen = torch.Generator().manual_seed(SEED)
    states = (torch.randn(1, tokens, hidden, generator=gen) / hidden**0.5).requires_grad_()
    weight = torch.randn(vocab, hidden, generator=gen).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), generator=gen)
    labels[torch.rand(1, tokens, generator=gen) < 0.1] = IGNORE_INDEX
    before = memory_now(CPU)["mem_allocated_bytes"]
    start = time.perf_counter()
    if variant == "fused":
        losses = fused_token_losses(states, weight, labels)
    else:
        losses = token_losses(states @ weight.t(), labels)
    total = losses.sum()
    total.backward()
    seconds = time.perf_counter() - start
    return {
        "variant": variant,
        "added_peak_bytes": peak_memory_bytes(CPU) - before,
        "seconds": seconds,
        "loss_sum": total.item(),
        "grad_hidden_norm": states.grad.norm().item(),
        "grad_weight_norm": weight.grad.norm().item(),
    }


def run_child(variant: str, args: argparse.Namespace) -> dict:
    """`measure` in a fresh process (its resident-set peak is its own)."""
    sizes = ["--tokens", str(args.tokens), "--vocab", str(args.vocab), "--hidden", str(args.hidden)]
    out = subprocess.run(
        [sys.executable, __file__, "--variant", variant, *sizes], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def markdown(result: dict) -> str:
    s, fused, plain = result["sizes"], result["fused"], result["unfused"]
    gib = 1 << 30
    return "\n".join(
        [
            "## Fused output layer + cross-entropy (--cross-entropy-loss-fusion)",
            "",
            f"Loss + backward of {s['tokens']:,} tokens through an output layer of vocabulary {s['vocab']:,} and "
            f"hidden {s['hidden']} in fp32 on the CPU ({s['threads']} threads), each variant in a process of its own; "
            f"memory is the resident-set peak above the inputs. The fused loss runs {s['chunk']} tokens per chunk.",
            "",
            "| variant | added peak memory | time |",
            "|---|---|---|",
            *(
                f"| {name} | {entry['added_peak_bytes'] / gib:.2f} GiB | {entry['seconds']:.1f} s |"
                for name, entry in (
                    ("unfused (`token_losses(h @ W.T)`)", plain),
                    ("fused (`fused_token_losses`)", fused),
                )
            ),
            "",
            f"Memory {result['memory_ratio']:.1f}x lower fused; time ratio fused/unfused {result['time_ratio']:.2f}. "
            f"Losses and gradient norms agree to {result['largest_relative_difference']:.1e} (relative). "
            "Liger-Kernel's fused linear cross-entropy needs triton and a GPU and does not run on this machine.",
            "",
            f"Command: `{result['command']}`",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--variant", choices=["fused", "unfused"], help="measure one variant in this process")
    parser.add_argument("--output", type=Path, default=RESULTS / "fused_loss.json")
    parser.add_argument("--markdown", type=Path, default=RESULTS / "fused_loss.md")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    if args.variant is not None:
        print(json.dumps(measure(args.variant, args.tokens, args.vocab, args.hidden)))
        return
    apply_smoke(args, parser, tokens=200, vocab=300_000, hidden=16)
    plain = run_child("unfused", args)
    fused = measure("fused", args.tokens, args.vocab, args.hidden) if args.smoke else run_child("fused", args)
    keys = ("loss_sum", "grad_hidden_norm", "grad_weight_norm")
    difference = max(abs(fused[k] - plain[k]) / max(abs(plain[k]), 1e-12) for k in keys)
    if difference > 1e-4:
        raise SystemExit(f"fused and unfused disagree: {fused} against {plain}")
    sizes = {"tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden, "chunk": chunk_tokens(args.vocab)}
    sizes["threads"] = torch.get_num_threads()
    result = {
        "command": f"python bench/fused_loss.py --tokens {args.tokens} --vocab {args.vocab} --hidden {args.hidden}",
        "sizes": sizes,
        "unfused": plain,
        "fused": fused,
        "memory_ratio": plain["added_peak_bytes"] / max(fused["added_peak_bytes"], 1),
        "time_ratio": fused["seconds"] / plain["seconds"],
        "largest_relative_difference": difference,
    }
    write_text_atomic(args.output, json.dumps(result, indent=2) + "\n")
    write_text_atomic(args.markdown, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
