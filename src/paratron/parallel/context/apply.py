"""Context parallelism applied to a plain model: each block's attention core is swapped for one
that attends across the ranks of the context-parallel group (before tensor parallelism and
recomputation wrap the cores)."""

from __future__ import annotations

from torch import nn

from paratron.distributed.topology import RankGroup
from paratron.model.attention import AttentionCore
from paratron.parallel.context.attention import ContextParallelAttention


def apply_context_parallel(model: nn.Module, group: RankGroup, comm_type: str) -> None:
    """Swap every attention core of `model` for its context-parallel twin over `group`."""
    for module in model.modules():
        core = getattr(module, "core", None)
        if isinstance(core, AttentionCore):
            if core.dropout:
                raise ValueError("context parallelism runs attention without dropout")
            module.core = ContextParallelAttention(core.pattern, group, comm_type)
