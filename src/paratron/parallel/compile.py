"""Regional compilation: each transformer block compiled once by `torch.compile` (torchtitan's
approach), after the parallel swaps and recomputation wrapped it and before FSDP2 shards it.

Blocks of the same shape share one compiled graph (their parameters are the graph's inputs, not
constants), so a model compiles once per kind of block, not once per layer, and the step after
the first runs the compiled code. The embedding, the output layer and the loss stay eager.

Nothing inside a block breaks its graph under tensor, sequence, data or pipeline parallelism: the
collectives are traced (see `distributed/comm.py`), and the tensor-parallel random stream is
switched outside the graph (see `distributed/rng.py`). What still breaks it is said in
docs/training.md ("Compiled blocks").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch._dynamo
from torch import nn

from paratron.distributed.rng import Forked, draws, fork_outside
from paratron.errors import ConfigError
from paratron.model.gpt import GPT
from paratron.parallel.recompute import Recomputed


def apply_compile(model: GPT, backend: str) -> int:
    """Compile every block this rank holds (in place); returns how many. A block whose random
    draws all run under one generator fork switches to it around the compiled call."""
    blocks = [block for block in model.layers if block is not None]
    for block in blocks:
        block.compile(backend=backend)
        block._compiled_call_impl = fork_outside(block, block._compiled_call_impl)
        _check_recomputed_forks(block)
    return len(blocks)


def _check_recomputed_forks(block: nn.Module) -> None:
    """A fork that still switches inside the graph (attention dropout under tensor parallelism
    without sequence parallelism) breaks it; inside a recomputed module the break would also lose
    the stream's replay, and with it the recomputed masks: refused."""
    for module in block.modules():
        if not isinstance(module, Recomputed):
            continue
        for forked in module.modules():
            if isinstance(forked, Forked) and forked.switches and any(draws(m) for m in forked.module.modules()):
                raise ConfigError(
                    "--compile with --recompute-granularity selective and --attention-dropout > 0 under "
                    "tensor parallelism needs --sequence-parallel (or --attention-dropout 0)"
                )


@dataclass(frozen=True)
class CompileReport:
    """What compilation did so far: graphs made and graph breaks (dynamo's counters, process-wide)."""

    graphs: int
    graph_breaks: int

    @classmethod
    def now(cls) -> CompileReport:
        counters = torch._dynamo.utils.counters
        return cls(int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values())))


def is_compiled(module: nn.Module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None
