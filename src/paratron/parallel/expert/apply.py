"""Turn each MoE layer of the plain model into this rank's expert- (and tensor-) parallel twin.

The experts live on their own grid (MoE parallel folding, `distributed.topology`): inside a
pipeline stage, expert-tensor-parallel (ETP) x expert-parallel (EP) x expert-data-parallel ranks
are laid over the stage's TP x CP x DP ranks, so an expert-parallel group may hold tensor- and
context-parallel peers, and EP may exceed DP.

    router         replicated; under TP it sees every token of the sequence (gathered from the
                   sequence shards, or already whole), as on one device, so routing, capacity and
                   the balancing losses are the single-device ones. Its gradient is a partial sum
                   over TP, and each TP rank adds 1/TP of the balancing losses' gradient
    tokens         with ETP = TP the TP ranks (who are then the ETP group) run every token through
                   their slice of the experts. Otherwise each TP rank takes its 1/TP share of the
                   tokens, the ETP ranks pool their shares (all-gather; reduce-scatter of the
                   partial outputs after the experts), and the dispatcher sends each routed copy to
                   the EP rank of its expert. Either way the routed output is a partial sum over
                   the TP ranks, reduce-scattered (or all-reduced) like a row-parallel layer's
    experts        E / EP of them on this rank (dimension 0 of the stacked weights), split over the
                   ETP ranks like a dense MLP (w_in's gate and up rows, w_out's columns); their
                   gradients are summed over the expert-data-parallel group (every rank that holds
                   the same slice of the same experts), so every token counts once
    shared expert  split like the dense MLP (column- then row-parallel)

Works on the model on the meta device, after `apply_tensor_parallel` (which leaves MoE layers alone).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from paratron.distributed import comm
from paratron.distributed.rng import TENSOR_PARALLEL, Forked, RNGStates
from paratron.distributed.topology import RankGroup
from paratron.model.gpt import GPT
from paratron.model.moe import MoELayer, Routing
from paratron.parallel.expert.dispatch import DISPATCHERS, Dispatcher
from paratron.parallel.sharding import Shard, set_partial_grad, set_shard, update_info
from paratron.parallel.tensor.apply import split_by_plan
from paratron.parallel.tensor.layers import TPContext


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's groups on the experts' grid."""

    ep: RankGroup
    """the ranks that hold the other experts"""
    etp: RankGroup
    """the ranks that hold the other slices of this rank's experts"""


class ParallelMoELayer(MoELayer):
    """A `MoELayer` whose experts are spread over the expert-parallel group (and split over the
    expert-tensor-parallel ranks): the same parameters and names, this rank's part of them."""

    tp: TPContext
    dispatcher: Dispatcher
    expert_tp: RankGroup
    pooled: bool
    """The expert-tensor-parallel group is not the tensor-parallel one: each tensor-parallel rank takes its share
    of the tokens, and the expert-tensor-parallel ranks pool their shares."""

    @classmethod
    def twin(cls, layer: MoELayer, tp: TPContext, dispatcher: Dispatcher, expert_tp: RankGroup) -> ParallelMoELayer:
        """`layer` (on the meta device) as this class: the same submodules and state."""
        twin = cls.__new__(cls)
        twin.__dict__.update(layer.__dict__)
        twin.tp, twin.dispatcher, twin.expert_tp = tp, dispatcher, expert_tp
        twin.pooled = expert_tp.size != tp.size  # (ETP = TP: the ETP group is the TP group, which has every token)
        twin.aux_loss_copies = tp.size
        return twin

    def gather_tokens(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.sequence_parallel:
            return comm.gather_from_sequence(x, self.tp.group, dim=1)
        return comm.copy_to_region(x, self.tp.group)

    def scatter_output(self, y: torch.Tensor) -> torch.Tensor:
        if self.tp.sequence_parallel:
            return comm.reduce_scatter_to_sequence(y, self.tp.group, dim=1)
        return comm.reduce_from_region(y, self.tp.group)

    def routed(self, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        pad_to = routing.capacity if self.pad_to_capacity else None
        n = tokens.size(0)
        start, end = 0, n
        if self.pooled and self.tp.size > 1:  # this tensor-parallel rank's share of the tokens
            if n % self.tp.size:
                raise ValueError(
                    f"{n} tokens per micro-batch do not split evenly over {self.tp.size} tensor-parallel ranks for "
                    "experts with an expert-tensor-parallel size other than the tensor-parallel size"
                )
            start, end = n * self.tp.rank // self.tp.size, n * (self.tp.rank + 1) // self.tp.size
        mine = slice(start, end)
        x, probs, chosen = tokens[mine], routing.probs[mine], routing.routing_map[mine]
        etp = self.expert_tp if self.pooled else RankGroup.solo()
        if etp.size > 1:  # the expert-tensor-parallel ranks pool their tokens (each runs its slice of the experts)
            x = comm.gather_from_sequence(x, etp, dim=0)
            probs = comm.gather_from_sequence(probs, etp, dim=0)
            chosen = comm.all_gather(chosen.to(torch.uint8), 0, etp).bool()
            pad_to = pad_to * etp.size if pad_to is not None else None
        y = self.dispatcher(x, probs, chosen, self.experts, pad_to)
        if etp.size > 1:  # each rank's share of the slices' partial sums, summed
            y = comm.reduce_scatter_to_sequence(y, etp, dim=0)
        return F.pad(y, (0, 0, start, n - end)) if (start, end) != (0, n) else y


def apply_expert_parallel(
    model: GPT,
    groups: ExpertGroups,
    tp: TPContext,
    dispatcher: str,
    rng: RNGStates | None = None,
) -> GPT:
    """Replace `model`'s MoE layers in place by their parallel twins; returns the model."""
    for block in model.layers:
        for slot, layer in (block.kinds() if block is not None else {}).items():
            if isinstance(layer, MoELayer):
                setattr(block, slot, _parallel_moe(layer, groups, tp, dispatcher, rng))
    return model


def _parallel_moe(
    layer: MoELayer, groups: ExpertGroups, tp: TPContext, dispatcher: str, rng: RNGStates | None
) -> ParallelMoELayer:
    """One MoE layer's parallel twin: this rank's experts; under TP the router whole (its gradient summed) and
    the shared expert split as a dense MLP is (its dropout, which drops nothing, left alone)."""
    _split_experts(layer, groups)
    if tp.size > 1:
        set_partial_grad(layer.router.weight, tp.group)
        if layer.shared_expert is not None:
            split_by_plan(layer.shared_expert, tp, None, None)
        if layer.shared_expert_gate is not None and tp.sequence_parallel:
            set_partial_grad(layer.shared_expert_gate.weight, tp.group)
        if tp.sequence_parallel and rng is not None:
            layer.dropout = Forked(layer.dropout, rng, TENSOR_PARALLEL)
    engine = DISPATCHERS[dispatcher](groups.ep, layer.router.num_experts)
    return ParallelMoELayer.twin(layer, tp, engine, groups.etp)


def _split_experts(layer: MoELayer, groups: ExpertGroups) -> None:
    """This rank's experts (and their expert-tensor-parallel slice) as new parameters on the meta device."""
    experts, ep, etp = layer.experts, groups.ep, groups.etp
    E, rows, H = experts.w_in.shape
    F_ = experts.w_out.size(2)
    local = E // ep.size
    blocks = 2 if experts.gated else 1
    width = F_ // etp.size
    shapes = {"w_in": (local, blocks * width, H), "w_out": (local, H, width)}
    for name, shape in shapes.items():
        old = getattr(experts, name)
        new = nn.Parameter(torch.empty(shape, device=old.device, dtype=old.dtype), old.requires_grad)
        if etp.size > 1:
            dim, full, parts = (1, rows, blocks) if name == "w_in" else (2, F_, 1)
            layout = [Shard(dim, t * width, width, full, blocks=parts) for t in range(etp.size)]
            set_shard(new, layout, etp.rank)
        update_info(new, expert_shard=Shard(0, ep.rank * local, local, E))
        setattr(experts, name, new)
