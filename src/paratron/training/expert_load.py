"""How the router spreads tokens over experts, for the log and for `--log-expert-load`.

Every MoE layer counts the tokens it sends to each expert; the trainer sums the counts over the
steps of a log interval and over the data- and context-parallel ranks, and reports per layer the load
balance (the busiest expert's share over the mean share: 1.0 is perfect balance, E means one
expert takes everything), the load-balancing loss and the z-loss. With --log-expert-load the
trainer keeps the shares of every logged step for `training.plot.plot_expert_load`. After every
step the aux-loss-free expert biases move toward an even load (`update_expert_biases`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from paratron.distributed import comm
from paratron.distributed.topology import Axis
from paratron.parallel.model import ParallelModel


@dataclass
class ExpertStats:
    """Sums over forward passes of this rank's MoE layers, indexed by the layer's ordinal among
    the model's MoE layers (the same on every pipeline stage; a stage's rows for layers it does
    not hold stay zero)."""

    tokens: torch.Tensor
    """[moe layers, experts] tokens routed to each expert."""
    losses: torch.Tensor
    """[2, moe layers] load-balancing and z losses (with their coefficients), summed over forwards."""
    forwards: int

    def add(self, other: ExpertStats) -> None:
        self.tokens += other.tokens
        self.losses += other.losses
        self.forwards += other.forwards


def take_expert_stats(model: ParallelModel) -> ExpertStats | None:
    """What this rank's MoE layers counted since the last call (their counters are reset)."""
    layers = model.moe_layers
    if not layers and not model.module.config.num_experts:
        return None
    config = model.module.config
    count = sum(config.moe_layer_pattern)
    device = next(model.module.parameters()).device
    tokens = torch.zeros(count, config.num_experts, device=device)
    losses = torch.zeros(2, count, device=device)
    forwards = 0
    for ordinal, layer in layers.items():
        tokens[ordinal], losses[:, ordinal], forwards = layer.take_stats()
    return ExpertStats(tokens, losses, forwards)


def update_expert_biases(model: ParallelModel, stats: ExpertStats | None) -> None:
    """Aux-loss-free balancing: each router's bias moves toward the global batch's even load (the
    tokens summed over the data- and context-parallel ranks; one all-reduce)."""
    layers = {o: layer for o, layer in model.moe_layers.items() if layer.router.expert_bias is not None}
    if stats is None or not layers:
        return
    tokens = stats.tokens.clone()
    comm.all_reduce(tokens, model.topology.group(Axis.DP_CP))
    for ordinal, layer in layers.items():
        layer.router.update_expert_bias(tokens[ordinal])


def reduce_expert_stats(model: ParallelModel, stats: ExpertStats) -> dict:
    """The log's MoE fields over a log interval: tokens summed over data- and context-parallel
    ranks, losses per forward averaged over the data-parallel ranks (each context-parallel rank
    holds its part of them: summed), every pipeline stage's layers together."""
    tokens, losses = stats.tokens.clone(), stats.losses / max(stats.forwards, 1)
    pp, dp_cp = model.topology.group(Axis.PP), model.topology.group(Axis.DP_CP)
    for group in (pp, dp_cp):
        comm.all_reduce(tokens, group)
        comm.all_reduce(losses, group)
    losses /= model.topology.size(Axis.DP)
    per_layer = tokens.double().cpu().numpy()
    balance = [load_balance(row) for row in per_layer]
    return {
        "moe_aux_loss": float(losses[0].mean()),
        "moe_z_loss": float(losses[1].mean()),
        "moe_load_balance": max(balance) if balance else 0.0,
        "moe_layer_load_balance": balance,
        "moe_tokens_per_expert": [[int(round(x)) for x in row] for row in per_layer],
    }


def load_balance(tokens_per_expert: np.ndarray) -> float:
    """max / mean of the tokens per expert (1.0 when perfectly balanced; 0 without tokens)."""
    mean = float(tokens_per_expert.mean())
    return float(tokens_per_expert.max()) / mean if mean > 0 else 0.0
