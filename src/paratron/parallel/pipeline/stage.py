"""Cutting the model into pipeline stages, and running this rank's chunks of it.

The model is cut into pp x chunks consecutive stages of whole layers; chunk c of pipeline rank r is
stage c x pp + r (under ZB-V: stage r, then stage 2 pp - 1 - r). An end stage may hold no layer when
the embedding or the loss is counted as one in the split (`config.layout.layer_counts`): it then runs
only the embedding, or only the head and the loss. The first stage also holds the
embeddings (and a vision-language model's encoder and projector); the last holds the final norm, the
output layer and the loss. This rank keeps the single-device `GPT` object with every piece it does
not hold set to None, so its parameters keep their single-device names (initialization, checkpoints
and gradient norms read names).

With tied embeddings the last stage keeps its own copy of the embedding matrix as its
output weight; the two copies start equal (same name, same initialization) and stay equal
because their gradients are summed over the embedding group (first and last stage) before
each step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from paratron.distributed.topology import RankGroup
from paratron.model.batch import Batch
from paratron.model.gpt import GPT
from paratron.parallel.pipeline.schedules import stage_of
from paratron.parallel.sharding import set_partial_grad, update_info


@dataclass
class StageLayout:
    """Which stages (and so which layers) this pipeline rank runs."""

    pp: int
    chunks: int
    rank: int
    ranges: list[range]
    """Layer numbers of every model stage."""
    v_shape: bool = False
    """Chunks placed as a V (ZB-V): rank r runs stages r and 2 pp - 1 - r."""

    @property
    def num_stages(self) -> int:
        return self.pp * self.chunks

    def stage(self, chunk: int) -> int:
        return stage_of(self.rank, chunk, self.pp, self.v_shape)

    def my_layers(self) -> set[int]:
        return {i for c in range(self.chunks) for i in self.ranges[self.stage(c)]}

    @property
    def holds_first(self) -> bool:
        return self.rank == 0

    @property
    def holds_last(self) -> bool:
        return self.stage(self.chunks - 1) == self.num_stages - 1


def keep_stage(model: GPT, layout: StageLayout, embedding_group: RankGroup) -> GPT:
    """Drop every piece of `model` (on the meta device) that this rank does not run; returns it.

    With tied embeddings and more than one rank, the embedding weight's gradient is marked to
    be summed over `embedding_group`, and the last stage's copy is marked as a duplicate so
    gradient norms count it once."""
    keep = layout.my_layers()
    for i in range(len(model.layers)):
        if i not in keep:
            model.layers[i] = None  # type: ignore[assignment]
    if not layout.holds_first:
        model.position_embedding = None
        model.vision = None  # (the encoder and projector run on the first stage)
        if not (layout.holds_last and model.tied):
            model.embedding = None  # type: ignore[assignment]
    if not layout.holds_last:
        model.final_norm = None  # type: ignore[assignment]
        model.output = None  # type: ignore[assignment]
    if model.tied and (layout.holds_first != layout.holds_last):  # the two ends on different ranks
        weight = model.embedding.weight
        set_partial_grad(weight, embedding_group)
        if not layout.holds_first:
            update_info(weight, pipeline_duplicate=True)
    return model


class StageRunner(nn.Module):
    """Runs one chunk of this rank's stages: the first stage starts from token ids, the last
    ends in logits (or, with `fused_loss` set, in the per-token losses); the others map hidden
    states to hidden states. (A module, so that wrappers hooked on forward, such as FSDP's, see
    each chunk run: the fused loss runs inside that forward, on the output weight FSDP gathered.)"""

    def __init__(self, model: GPT, layout: StageLayout) -> None:
        super().__init__()
        self.model, self.layout = model, layout
        self.fused_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        """(final norm's output, labels) -> per-token losses [B, T], the output layer applied inside the loss
        (--cross-entropy-loss-fusion); None: the last stage returns logits."""

    def is_first(self, chunk: int) -> bool:
        return self.layout.stage(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        return self.layout.stage(chunk) == self.layout.num_stages - 1

    def forward(self, chunk: int, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """`x` is the micro-batch's token ids on the first stage and the previous stage's output
        elsewhere (perhaps a sequence-parallel shard); every stage reads the sequence layout
        (positions, segments) from `batch`."""
        model = self.model
        positions, places = model.token_layout(
            batch.input_ids, batch.position_ids, batch.segment_ids, batch.token_index
        )
        if self.is_first(chunk):
            x = model.embed(x, positions, batch.images)
        x = model.layers(x, self.layout.ranges[self.layout.stage(chunk)], model.rotary_tables(positions), places=places)
        if not self.is_last(chunk):
            return x
        if self.fused_loss is not None:
            return self.fused_loss(model.final_norm(x), batch.labels)
        return model.head(x)
