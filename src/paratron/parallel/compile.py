"""Regional compilation: each transformer block compiled once by `torch.compile` (torchtitan's
approach), after the parallel swaps and recomputation wrapped it and before FSDP2 shards it.

Blocks of the same shape share one compiled graph (their parameters are the graph's inputs, not
constants), so a model compiles once per kind of block, not once per layer, and the step after
the first runs the compiled code. The embedding, the output layer and the loss stay eager.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch._dynamo
from torch import nn

from paratron.model.gpt import GPT


def apply_compile(model: GPT, backend: str) -> int:
    """Compile every block this rank holds (in place); returns how many."""
    blocks = [block for block in model.layers if block is not None]
    for block in blocks:
        block.compile(backend=backend)
    return len(blocks)


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
