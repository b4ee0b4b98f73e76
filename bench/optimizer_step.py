"""Optimizer-step time: paratron's master-weight step against torch's AdamW, one process, fp32.

paratron's side is the step of `ReplicatedOptimizer` (ZeRO stage 0) over the parameters of a GPT-2-small-shaped
model (~124M parameters in the tensors a Transformer holds: embeddings, per layer the attention and MLP matrices,
their biases and norm weights), fp32, with paratron's weight-decay groups; on a CPU it steps with torch's foreach
kernels. It is timed against:

- `loop`: the same groups under torch's per-tensor loop (`foreach=False, fused=False`), what torch's default picks
  for CPU tensors and what paratron stepped with before;
- `torch_fused`: `torch.optim.AdamW(fused=True)`, torch's CPU fused kernel (not bit-equal to the loop, so
  paratron leaves it to CUDA; the largest difference from the loop after the timed steps is reported);
- `one_flat_tensor`: foreach AdamW over a single tensor of the same number of elements, the bound a step over
  the distributed optimizer's flat buffer as one tensor could reach.

Every side starts from the same weights and steps with the same gradients; paratron's weights must equal the
loop's bit for bit after the timed steps (checked). Rounds alternate so that drift hits every side; the median
round is reported, with each side's time over paratron's.

    python bench/optimizer_step.py
    python bench/optimizer_step.py --layers 24 --hidden 1024 --rounds 7
    python bench/optimizer_step.py --smoke  # tiny: does it still run and agree?
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from common import RESULTS, add_smoke_argument, apply_smoke
from paratron.config.schema import OptimizerConfig
from paratron.distributed.topology import RankGroup
from paratron.optim.master_weights import ReplicatedOptimizer, decay_groups

SMOKE = dict(layers=2, hidden=32, vocab=256, positions=32, rounds=1, steps=2)
CONFIG = OptimizerConfig(lr=3e-4, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8)


def gpt_shapes(layers: int, hidden: int, vocab: int, positions: int) -> list[tuple[int, ...]]:
    """The trained tensors of a GPT-2-style model (tied output layer, 4x MLP, biases), in model order."""
    block = [
        (hidden,), (hidden,), (3 * hidden, hidden), (3 * hidden,), (hidden, hidden), (hidden,),
        (hidden,), (hidden,), (4 * hidden, hidden), (4 * hidden,), (hidden, 4 * hidden), (hidden,),
    ]  # fmt: skip
    return [(vocab, hidden), (positions, hidden), *block * layers, (hidden,), (hidden,)]


def make_params(shapes: list[tuple[int, ...]]) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(shape, generator=generator) * 0.02) for shape in shapes]


def make_grads(shapes: list[tuple[int, ...]], count: int) -> list[list[torch.Tensor]]:
    """`count` sets of gradients, reused round after round (drawing them would dwarf a step)."""
    generator = torch.Generator().manual_seed(1)
    return [[torch.randn(shape, generator=generator) * 1e-3 for shape in shapes] for _ in range(count)]


class Side:
    """One way of stepping: its weights, and a step that takes a set of gradients."""

    def __init__(self, params: list[torch.Tensor], step: Callable[[list[torch.Tensor]], None]) -> None:
        self.params, self.step = params, step

    def time(self, grads: list[list[torch.Tensor]]) -> float:
        """Seconds per step over `grads` (the gradients are set before the clock starts)."""
        total = 0.0
        for grad in grads:
            self.set_grads(grad)
            start = time.perf_counter()
            self.step(grad)
            total += time.perf_counter() - start
        return total / len(grads)

    def set_grads(self, grad: list[torch.Tensor]) -> None:
        for param, g in zip(self.params, grad):
            param.grad = g


def paratron_side(shapes: list[tuple[int, ...]]) -> Side:
    params = make_params(shapes)
    grads = {id(p): torch.zeros_like(p) for p in params}
    optimizer = ReplicatedOptimizer(params, lambda p: grads[id(p)], CONFIG, RankGroup.solo(), lambda p: 1.0)
    assert optimizer.param_groups[0]["foreach"] is True  # the CPU's fast path

    def step(grad: list[torch.Tensor]) -> None:
        for param, g in zip(params, grad):
            grads[id(param)] = g
        optimizer.prepare_grads()
        optimizer.step()

    return Side(params, step)


def torch_side(shapes: list[tuple[int, ...]], **kernel: bool) -> Side:
    params = make_params(shapes)
    betas = (CONFIG.adam_beta1, CONFIG.adam_beta2)
    groups = decay_groups(params, params, CONFIG.weight_decay)
    optimizer = torch.optim.AdamW(groups, lr=CONFIG.lr, betas=betas, eps=CONFIG.adam_eps, **kernel)
    return Side(params, lambda grad: optimizer.step())


class FlatSide(Side):
    """All the weights as one tensor (no weight decay groups): the step's per-tensor costs gone."""

    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        flat = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in make_params(shapes)]))
        betas = (CONFIG.adam_beta1, CONFIG.adam_beta2)
        optimizer = torch.optim.AdamW([flat], lr=CONFIG.lr, betas=betas, eps=CONFIG.adam_eps, foreach=True)
        super().__init__([flat], lambda grad: optimizer.step())

    def set_grads(self, grad: list[torch.Tensor]) -> None:
        self.params[0].grad = torch.cat([g.reshape(-1) for g in grad])


def largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.detach() - y.detach()).abs().max().item() for x, y in zip(a, b))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--positions", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per side and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--output", type=Path, default=RESULTS / "optimizer_step.json")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    apply_smoke(args, parser, **SMOKE)
    torch.set_num_threads(args.threads)
    shapes = gpt_shapes(args.layers, args.hidden, args.vocab, args.positions)
    sides = {
        "paratron": paratron_side(shapes),
        "loop": torch_side(shapes, foreach=False, fused=False),
        "torch_fused": torch_side(shapes, fused=True),
        "one_flat_tensor": FlatSide(shapes),
    }
    grads = make_grads(shapes, args.steps)
    for side in sides.values():
        side.time(grads[:1])  # warm-up: the state is allocated on the first step
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, side in sides.items():
            times[name].append(side.time(grads))
    loop, paratron = sides["loop"].params, sides["paratron"].params
    assert all(torch.equal(a, b) for a, b in zip(loop, paratron)), "paratron's step parted from the loop's"
    median = {name: statistics.median(values) for name, values in times.items()}
    result = {
        "model": f"GPT-2 shapes: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, fp32 AdamW",
        "parameters": sum(p.numel() for p in paratron),
        "tensors": len(shapes),
        "threads": torch.get_num_threads(),
        "ms_per_step": {name: 1000 * value for name, value in median.items()},
        "time_over_paratron": {name: value / median["paratron"] for name, value in median.items()},
        "bit_equal_to_loop": True,
        "torch_fused_largest_difference_from_loop": largest_difference(sides["torch_fused"].params, loop),
        "rounds_ms": {name: [1000 * v for v in values] for name, values in times.items()},
    }
    print(json.dumps(result, indent=2))
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
