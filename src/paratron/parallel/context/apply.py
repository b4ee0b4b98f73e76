"""Context parallelism applied to a plain model, as each layer kind declares it runs with the sequence split
(`LayerKind.context_parallel`): an attention core is swapped for one that attends across the ranks of the
context-parallel group (before tensor parallelism and recomputation wrap the cores), an MoE router for one whose
load-balancing losses count the experts chosen over the whole sequence, a tokenwise kind is left as it is, and a
kind that refuses context parallelism stops the run with its reason."""

from __future__ import annotations

from torch import nn

from paratron.distributed.topology import RankGroup
from paratron.model.layer_kind import ContextParallel, LayerKind
from paratron.parallel.context.attention import ContextParallelAttention
from paratron.parallel.context.router import ContextParallelRouter


def apply_context_parallel(model: nn.Module, group: RankGroup, comm_type: str) -> None:
    """Swap the parts of every layer kind in `model` that see the whole sequence for their context-parallel twins
    over `group`."""
    for kind in [module for module in model.modules() if isinstance(module, LayerKind)]:
        if kind.context_parallel_refusal is not None:
            raise ValueError(f"context parallelism: {kind.kind_name} layers {kind.context_parallel_refusal}")
        if kind.context_parallel is ContextParallel.SEQUENCE_ROUTER:
            kind.router = ContextParallelRouter.twin(kind.router, group)
        elif kind.context_parallel is ContextParallel.ATTENTION_CORE:
            if kind.core.dropout:
                raise ValueError("context parallelism runs attention without dropout")
            kind.core = ContextParallelAttention(kind.core.pattern, group, comm_type)
