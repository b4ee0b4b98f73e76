"""Regional compilation: each transformer block compiled once by `torch.compile` (torchtitan's
approach), after the parallel swaps and recomputation wrapped it and before FSDP2 shards it.

Blocks of the same shape share one compiled graph (their parameters are the graph's inputs, not
constants), so a model compiles once per kind of block, not once per layer, and the step after
the first runs the compiled code. The embedding, the output layer and the loss stay eager.

A block whose MLP is a mixture of experts is compiled in regions around the token exchange, whose
shapes the routing decides (`_regions_around_experts`): each region one graph, the experts' matmuls
one graph for any number of rows.

Nothing inside a compiled region breaks its graph under tensor, sequence, data, pipeline, context
or expert parallelism: the collectives are traced (see `distributed/comm.py`; the context-parallel
ring's shift, `parallel/context/comm.py`), the context-parallel block pairs are planned before the
graph runs (`_plans_outside`), and the tensor-parallel random stream is switched outside the graph,
dropout outside that stream drawing through an operator opaque to the compiler (`distributed/rng.py`).
docs/training.md ("Compiled blocks") says what each layout makes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paratron.distributed.rng import fork_outside
from paratron.model.attention import TokenPlaces
from paratron.model.gpt import GPT
from paratron.model.moe import ExpertKernels, MoELayer
from paratron.model.transformer import Residual
from paratron.parallel.context.attention import ContextParallelAttention


def apply_compile(model: GPT, backend: str) -> int:
    """Compile every block this rank holds (in place); returns how many. A block that draws under a
    generator fork switches to it around the compiled call."""
    blocks = [block for block in model.layers if block is not None]
    for block in blocks:
        moe = block.kind_of(MoELayer) if isinstance(block, Residual) else None
        if moe is None:
            _compile_region(block, backend)
            continue
        for region in _regions_around_experts(block, moe):
            _compile_region(region, backend)
        moe.experts.kernels = compiled_expert_kernels(backend)
    return len(blocks)


def _compile_region(module: nn.Module, backend: str) -> None:
    module.compile(backend=backend)
    module._compiled_call_impl = _plans_outside(module, fork_outside(module, module._compiled_call_impl))


def _regions_around_experts(block: nn.Module, moe: MoELayer) -> list[nn.Module]:
    """What is compiled of a block whose MLP is a mixture of experts (torchtitan's way with MoE blocks):
    its other parts (norms, attention), the router and the shared expert, each whole. Between them the
    tokens are sorted by expert and exchanged with the other expert-parallel ranks, shapes that the
    routing decides, in eager; the experts' own matmuls run compiled with their rows dynamic."""
    parts = [child for child in block.children() if child is not moe]
    return [*parts, moe.router, *([moe.shared_expert] if moe.shared_expert is not None else [])]


_EXPERT_KERNELS: dict[str, ExpertKernels] = {}


def compiled_expert_kernels(backend: str) -> ExpertKernels:
    """The experts' kernels compiled once per backend and shared by every MoE layer; their rows' count is
    unbacked (any count, 0 and 1 included, runs the one graph: no recompile as the routing changes). The
    grouped one runs compiled in bf16 only, the one type torch's grouped matmul can be traced in."""
    if backend not in _EXPERT_KERNELS:
        eager = ExpertKernels()
        one, grouped = (_rows_unbacked(torch.compile(fn, backend=backend)) for fn in (eager.one, eager.grouped))

        def grouped_where_traceable(x: torch.Tensor, *rest: Any) -> torch.Tensor:
            return (grouped if x.dtype == torch.bfloat16 else eager.grouped)(x, *rest)

        _EXPERT_KERNELS[backend] = ExpertKernels(one, grouped_where_traceable)
    return _EXPERT_KERNELS[backend]


def _rows_unbacked(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def call(x: torch.Tensor, probs: torch.Tensor, *rest: Any) -> torch.Tensor:
        torch._dynamo.decorators.mark_unbacked(x, 0)
        torch._dynamo.decorators.mark_unbacked(probs, 0)
        return fn(x, probs, *rest)

    return call


def _plans_outside(block: nn.Module, call: Callable) -> Callable:
    """`call`, after the block's context-parallel attention cores have planned their block pairs for
    the call's token places (cached on the places, where the traced core finds them as inputs): the
    plan branches on tensors' values (which chunk pairs a pattern connects), which would break the graph."""
    cores = [m for m in block.modules() if isinstance(m, ContextParallelAttention)]
    if not cores:
        return call

    def planned_call(*args: Any, **kwargs: Any) -> Any:
        for places in (a for a in (*args, *kwargs.values()) if isinstance(a, TokenPlaces)):
            for core in cores:
                core.plan(places)
        return call(*args, **kwargs)

    return planned_call


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
