"""Context parallelism applied to a plain model: each block's attention core is swapped for one
that attends across the ranks of the context-parallel group (before tensor parallelism and
recomputation wrap the cores), and each MoE router for one whose load-balancing losses count
the experts chosen over the whole sequence."""

from __future__ import annotations

from torch import nn

from paratron.distributed.topology import RankGroup
from paratron.model.attention import AttentionCore
from paratron.model.moe import Router
from paratron.parallel.context.attention import ContextParallelAttention
from paratron.parallel.context.router import ContextParallelRouter


def apply_context_parallel(model: nn.Module, group: RankGroup, comm_type: str) -> None:
    """Swap every attention core (and MoE router) of `model` for its context-parallel twin over `group`."""
    for module in list(model.modules()):
        router = getattr(module, "router", None)
        if isinstance(router, Router):
            module.router = ContextParallelRouter.twin(router, group)
        core = getattr(module, "core", None)
        if isinstance(core, AttentionCore):
            if core.dropout:
                raise ValueError("context parallelism runs attention without dropout")
            module.core = ContextParallelAttention(core.pattern, group, comm_type)
