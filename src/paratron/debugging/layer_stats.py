"""Per-layer statistics of one training step (`--log-layer-stats N`), under single-device layer names at any layout.

Every N steps the trainer records, for each layer of the model (`embedding`, `layers.<i>`, `final_norm`,
`output`; `vision` for a vision-language model's encoder and projector):

    act_rms         root mean square of the layer's output (the residual stream after it; the logits for
                    `output`), over every element of the step's global batch: all its micro-batches, every
                    sequence and context shard, every data-parallel rank
    act_max         the largest magnitude among those elements
    grad_norm       L2 norm of the gradient of the layer's parameters as the optimizer sees it (reduced over
                    data-parallel ranks, unscaled, before clipping): the squares of all layers' norms add up to
                    the step's `grad_norm`
    update_ratio    ||W_after - W_before|| / ||W_before|| over the layer's parameters for the step (of the fp32
                    master weights the optimizer steps; 0 when the step was not applied)
    router_entropy  an MoE layer's mean entropy (nats) of its router's distributions over experts, per token

as metrics.jsonl keys `layers/<layer>/<statistic>` of the step's record (TensorBoard: `train/layers/...`).

Each rank sums what it holds, weighted so that a tensor held by several ranks counts once: activations are
replicated over tensor-parallel ranks unless sequence parallelism splits them (the logits are split by vocabulary,
the router sees every token of the tensor-parallel group), and parameter pieces carry the gradient norm's own
weights (`parallel.sharding.grad_norm_weight`). One sum and one max over every rank then give the single process's
numbers, whichever ranks hold which layers.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratron.distributed import comm
from paratron.distributed.topology import Axis, RankGroup
from paratron.model.moe import MoELayer, Router
from paratron.optim.protocol import GradsForNorm, TrainingOptimizer
from paratron.parallel.data_parallel.fully_sharded import local_tensor
from paratron.parallel.model import ParallelModel
from paratron.parallel.recompute import is_recomputing
from paratron.parallel.tensor.layers import VocabParallelOutput

PREFIX = "layers/"
"""Keys of a step's record holding layer statistics: `layers/<layer>/<statistic>`."""
STATISTICS = ("act_rms", "act_max", "grad_norm", "update_ratio", "router_entropy")


def layer_names(num_layers: int, vision: bool = False) -> list[str]:
    """The model's layers in order, by their single-device module names."""
    return [
        "embedding",
        *(["vision"] if vision else []),
        *(f"layers.{i}" for i in range(num_layers)),
        "final_norm",
        "output",
    ]


def layer_of(param_name: str) -> str:
    """The layer a single-device parameter name belongs to (learned positions belong to the embedding)."""
    head, _, rest = param_name.partition(".")
    if head == "layers":
        return f"layers.{rest.partition('.')[0]}"
    return "embedding" if head == "position_embedding" else head


def router_entropy(router: Router, tokens: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each token's distribution over the experts [N]: the softmax of the router's logits, or its
    sigmoid scores normalised per token."""
    logits = tokens.detach().float() @ router.weight.detach().float().t()
    if router.score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        probs = scores / scores.sum(dim=-1, keepdim=True).clamp(min=1e-20)
    else:
        probs = torch.softmax(logits, dim=-1)
    return -(probs * probs.clamp(min=1e-30).log()).sum(dim=-1)


def finish_statistics(
    names: list[str], sums: torch.Tensor, maxima: torch.Tensor, params: torch.Tensor, moe: dict[int, str]
) -> dict[str, float]:
    """The record's entries from the reduced sums: `sums` [L + M, 6] holds per layer (activation squares, activation
    elements, gradient squares, update squares, weight squares, parameter pieces) and then per MoE layer (entropy
    sum, tokens) in its first two columns; `maxima` [L] the largest activation magnitudes; `params` [L] whether any
    rank holds the layer's trained parameters. A statistic no rank measured is left out."""
    record: dict[str, float] = {}
    rows = sums.double().cpu().tolist()
    top = maxima.double().cpu().tolist()
    held = params.double().cpu().tolist()
    for i, name in enumerate(names):
        squares, elements, grad, update, weight, _ = rows[i]
        key = f"{PREFIX}{name}/"
        if elements > 0:
            record[key + "act_rms"] = math.sqrt(squares / elements)
            record[key + "act_max"] = top[i]
        if held[i] > 0:
            record[key + "grad_norm"] = math.sqrt(grad)
            record[key + "update_ratio"] = math.sqrt(update) / math.sqrt(weight) if weight > 0 else 0.0
    for row, name in moe.items():
        entropy, tokens = rows[len(names) + row][:2]
        if tokens > 0:
            record[f"{PREFIX}{name}/router_entropy"] = entropy / tokens
    return record


class LayerStats:
    """One logged step's statistics of this rank's part of the model. The trainer `watch`es the step's forwards,
    hands over the gradients before clipping (`take_grads`) and the masters after the optimizer stepped
    (`take_update`), then every rank calls `finish` (collective) for the record's entries."""

    def __init__(
        self, model: ParallelModel, optimizer: TrainingOptimizer, sequence_parallel: bool, every: int = 1
    ) -> None:
        self.model, self.optimizer, self.every = model, optimizer, every
        config = model.module.config
        self.names = layer_names(config.num_layers, config.has_vision)
        self.index = {name: i for i, name in enumerate(self.names)}
        tp = model.topology.size(Axis.TP)
        self.activation_share = 1.0 if sequence_parallel or tp == 1 else 1.0 / tp
        """Weight of this rank's residual-stream sums: TP ranks hold copies of it unless SP splits it."""
        self.router_share = 1.0 / tp  # (the router sees every token of the tensor-parallel group)
        self.moe = self._moe_layers(model.module)
        self.device = next(model.module.parameters()).device
        self.piece_layers: list[int] | None = None
        self._reset()

    def due(self, iteration: int) -> bool:
        """Whether step `iteration` records statistics (every `every` steps; never when 0)."""
        return self.every > 0 and iteration % self.every == 0

    @staticmethod
    def _moe_layers(module: nn.Module) -> dict[int, str]:
        """Row (ordinal among the model's MoE layers) -> layer name, for every MoE layer of the model."""
        pattern = module.config.moe_layer_pattern
        return {sum(pattern[:i]): f"layers.{i}" for i, moe in enumerate(pattern) if moe}

    def _reset(self) -> None:
        rows = len(self.names) + len(self.moe)
        self.sums = torch.zeros(rows, 6, dtype=torch.float64, device=self.device)
        self.maxima = torch.zeros(len(self.names), dtype=torch.float64, device=self.device)
        self.before: list[torch.Tensor] | None = None
        self.weights: torch.Tensor | None = None
        self.group: RankGroup | None = None

    # ---------------------------------------------------------------- activations

    def _watched_modules(self) -> list[tuple[int, nn.Module]]:
        """(layer row, module whose output is the layer's output) for what this rank runs."""
        module, found = self.model.module, []
        if module.embedding is not None:  # (the embedded stream: tokens, image features, positions, dropout)
            found.append((self.index["embedding"], module.embedding_dropout))
        for i, block in enumerate(module.layers):
            if block is not None:
                found.append((self.index[f"layers.{i}"], block))
        for name in ("final_norm", "output"):
            if getattr(module, name) is not None:
                found.append((self.index[name], getattr(module, name)))
        return found

    def _record_output(self, row: int, layer: nn.Module, output: Any) -> None:
        if is_recomputing() or not torch.is_grad_enabled():
            return
        tensor = (output[0] if isinstance(output, tuple) else output).detach()
        share = self.activation_share
        if isinstance(layer, VocabParallelOutput):  # this rank's vocabulary rows, padding left out
            tensor, share = tensor[..., : layer.valid_rows], 1.0
        values = tensor.float()
        self.sums[row, 0] += values.square().sum(dtype=torch.float64) * share
        self.sums[row, 1] += values.numel() * share
        if values.numel():
            self.maxima[row] = torch.maximum(self.maxima[row], values.abs().max().double())

    def _record_router(self, row: int, router: Router, inputs: tuple) -> None:
        if is_recomputing() or not torch.is_grad_enabled():
            return
        entropy = router_entropy(router, inputs[0])
        self.sums[len(self.names) + row, 0] += entropy.sum(dtype=torch.float64) * self.router_share
        self.sums[len(self.names) + row, 1] += entropy.numel() * self.router_share

    @contextlib.contextmanager
    def watch(self) -> Iterator[LayerStats]:
        """Hooks on this rank's layers for the step's forwards (recomputations inside backward are not counted)."""
        self._reset()
        handles = [
            module.register_forward_hook(lambda m, i, o, row=row: self._record_output(row, m, o))
            for row, module in self._watched_modules()
        ]
        ordinals = {name: row for row, name in self.moe.items()}
        for name, module in self.model.module.named_modules():
            if isinstance(module, MoELayer):
                row = ordinals[layer_of(name)]
                hook = module.router.register_forward_hook(lambda m, i, o, row=row: self._record_router(row, m, i))
                handles.append(hook)
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    # ---------------------------------------------------------------- gradients and updates

    def _layers_of_pieces(self) -> torch.Tensor:
        """Each optimizer piece's layer row (the row past the last for a parameter of no listed layer)."""
        if self.piece_layers is None:
            names = {id(p): n for n, p in self.model.module.named_parameters()}  # (tied: the first name)
            rows = [
                self.index.get(layer_of(names.get(id(piece.param), "")), len(self.names))
                for piece in self.optimizer.pieces()
            ]
            self.piece_layers = torch.tensor(rows, dtype=torch.long, device=self.device)
        return self.piece_layers

    def _per_layer(self, tensors: list[torch.Tensor], column: int) -> None:
        """Add each piece's square norm, times its weight, to its layer's row in `column`."""
        if not tensors:
            return
        squares = torch.stack(torch._foreach_norm([t.float() for t in tensors])).to(self.device, torch.float64) ** 2
        if self.weights is not None:
            squares = squares * self.weights
        totals = torch.zeros(len(self.names) + 1, dtype=torch.float64, device=self.device)
        totals.index_add_(0, self._layers_of_pieces(), squares)
        self.sums[: len(self.names), column] += totals[:-1]

    def take_grads(self, grads: GradsForNorm) -> None:
        """The gradients the optimizer sees (unscaled, not yet clipped), and a copy of the masters for the update."""
        self.group = grads.group
        self.weights = grads.weights.to(self.device, torch.float64) if grads.weights is not None else None
        self._per_layer([local_tensor(g).detach() for g in grads.tensors], 2)
        counted = torch.ones(len(grads.tensors), dtype=torch.float64, device=self.device)
        if self.weights is not None:
            counted = (self.weights > 0).to(torch.float64)
        totals = torch.zeros(len(self.names) + 1, dtype=torch.float64, device=self.device)
        totals.index_add_(0, self._layers_of_pieces(), counted)
        self.sums[: len(self.names), 5] += totals[:-1]
        self.before = [local_tensor(piece.master.detach()).float().clone() for piece in self.optimizer.pieces()]

    def take_update(self) -> None:
        """The masters after the optimizer stepped: each layer's squared update and weight norms."""
        if self.before is None:
            return
        after = [local_tensor(piece.master.detach()).float() for piece in self.optimizer.pieces()]
        self._per_layer([a - b for a, b in zip(after, self.before)], 3)
        self._per_layer(self.before, 4)
        self.before = None

    # ---------------------------------------------------------------- the record

    def finish(self) -> dict[str, float]:
        """The step's statistics over every rank (collective: every rank calls it at the same steps)."""
        world = self.model.topology.group(Axis.WORLD)
        if self.before is not None:  # the optimizer did not step (an overflow, a withheld step)
            self._per_layer(self.before, 4)
            self.before = None
        params = self.sums[: len(self.names), 5].clone()
        parameter_sums = self.sums[: len(self.names), 2:5].clone()
        activations = self.sums.clone()
        activations[: len(self.names), 2:] = 0
        if self.group is not None:  # (the gradient norm's group: every rank of it holds some of the gradients)
            both = torch.cat([parameter_sums, params.unsqueeze(1)], dim=1)
            comm.all_reduce(both, self.group)
            parameter_sums, params = both[:, :3], both[:, 3]
        comm.all_reduce(activations, world)
        comm.all_reduce(self.maxima, world, op=dist.ReduceOp.MAX)
        activations[: len(self.names), 2:5] = parameter_sums
        return finish_statistics(self.names, activations, self.maxima, params, self.moe)
