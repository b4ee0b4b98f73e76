"""Turn each MoE layer of the plain model into this rank's expert- (and tensor-) parallel twin.

    experts        E / EP of them on this rank (dimension 0 of the stacked weights), their
                   gradients reduced over the expert-data-parallel group; with
                   --expert-tensor-parallel-size TP also split like a dense MLP (w_in's gate and
                   up rows, w_out's columns)
    tokens         under TP the router sees every token of the sequence (gathered from the
                   sequence shards, or already whole), as on one device, so routing, capacity and
                   the balancing losses are the single-device ones; the routed output is a partial
                   sum over the TP ranks, reduce-scattered (or all-reduced) like a row-parallel
                   layer's. With expert TP 1 each TP rank runs its 1/TP share of the tokens through
                   whole experts (whose gradients are then summed over TP)
    router         replicated; its gradient is a partial sum over TP, and each TP rank adds 1/TP
                   of the balancing losses' gradient
    shared expert  split like the dense MLP (column- then row-parallel)

Works on the model on the meta device, after `apply_tensor_parallel` (which leaves MoE layers alone).
"""

from __future__ import annotations

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
from paratron.parallel.tensor.layers import ColumnParallelProjections, RowParallelLinear, TPContext


class ParallelMoELayer(MoELayer):
    """A `MoELayer` whose experts are spread over the expert-parallel group (and split or shared
    by the tensor-parallel ranks): the same parameters and names, this rank's part of them."""

    tp: TPContext
    dispatcher: Dispatcher
    share_tokens: bool

    @classmethod
    def twin(cls, layer: MoELayer, tp: TPContext, dispatcher: Dispatcher, share_tokens: bool) -> ParallelMoELayer:
        """`layer` (on the meta device) as this class: the same submodules and state."""
        twin = cls.__new__(cls)
        twin.__dict__.update(layer.__dict__)
        twin.tp, twin.dispatcher, twin.share_tokens = tp, dispatcher, share_tokens
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
        if self.share_tokens:  # this tensor-parallel rank's share of the tokens, through whole experts
            start, end = n * self.tp.rank // self.tp.size, n * (self.tp.rank + 1) // self.tp.size
        mine = slice(start, end)
        y = self.dispatcher(tokens[mine], routing.probs[mine], routing.routing_map[mine], self.experts, pad_to)
        return F.pad(y, (0, 0, start, n - end)) if (start, end) != (0, n) else y


def apply_expert_parallel(
    model: GPT,
    ep_group: RankGroup,
    tp: TPContext,
    expert_tp: int,
    dispatcher: str,
    rng: RNGStates | None = None,
) -> GPT:
    """Replace `model`'s MoE layers in place by their parallel twins; returns the model.
    `expert_tp` is 1 or tp.size (--expert-tensor-parallel-size)."""
    for block in model.layers:
        if block is None or not isinstance(block.mlp, MoELayer):
            continue
        layer = block.mlp
        _split_experts(layer, ep_group, tp, expert_tp)
        if tp.size > 1:
            set_partial_grad(layer.router.weight, tp.group)
            if layer.shared_expert is not None:
                layer.shared_expert.in_proj = ColumnParallelProjections(layer.shared_expert.in_proj, tp, {})
                layer.shared_expert.out_proj = RowParallelLinear(layer.shared_expert.out_proj, tp)
            if layer.shared_expert_gate is not None and tp.sequence_parallel:
                set_partial_grad(layer.shared_expert_gate.weight, tp.group)
            if tp.sequence_parallel and rng is not None:
                layer.dropout = Forked(layer.dropout, rng, TENSOR_PARALLEL)
        engine = DISPATCHERS[dispatcher](ep_group, layer.router.num_experts)
        block.mlp = ParallelMoELayer.twin(layer, tp, engine, share_tokens=tp.size > 1 and expert_tp == 1)
    return model


def _split_experts(layer: MoELayer, ep_group: RankGroup, tp: TPContext, expert_tp: int) -> None:
    """This rank's experts (and their tensor-parallel slice) as new parameters on the meta device."""
    experts = layer.experts
    E, rows, H = experts.w_in.shape
    F_ = experts.w_out.size(2)
    local = E // ep_group.size
    expert_shard = Shard(0, ep_group.rank * local, local, E) if ep_group.size > 1 else None
    blocks = 2 if experts.gated else 1
    split = expert_tp > 1
    width = F_ // expert_tp
    shapes = {"w_in": (local, blocks * width if split else rows, H), "w_out": (local, H, width if split else F_)}
    for name, shape in shapes.items():
        old = getattr(experts, name)
        new = nn.Parameter(torch.empty(shape, device=old.device, dtype=old.dtype), old.requires_grad)
        if split:
            dim, full, parts = (1, rows, blocks) if name == "w_in" else (2, F_, 1)
            layout = [Shard(dim, t * width, width, full, blocks=parts) for t in range(tp.size)]
            set_shard(new, layout, tp.rank)
        elif tp.size > 1:  # whole experts, each tensor-parallel rank running its share of the tokens
            set_partial_grad(new, tp.group)
        if expert_shard is not None:
            update_info(new, expert_shard=expert_shard)
        setattr(experts, name, new)
