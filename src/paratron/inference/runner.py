"""Running engine steps on the ranks of one model replica (tensor x pipeline parallel).

The controller (the replica's first rank) plans each step and sends the plan to the replica's other ranks; every
rank runs its part of the model on it: the first pipeline stage embeds the tokens, each stage runs its layers on
the step's row and hands the hidden states to the next, the last stage computes the logits of the rows the plan
asks for (gathered over the tensor-parallel vocabulary shards) and sends them to the controller, which samples.
Ranks that are not the controller spend their life in `follow()`, running plans until the controller closes.

Messages go over the replica's model-parallel group as device tensors, so the same code runs on gloo and NCCL.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from paratron.distributed import comm
from paratron.distributed.topology import RankGroup
from paratron.inference.kv_cache import PagedKVCache, StepPlan
from paratron.inference.paged_attention import PagedAttention, key_value_kinds, paged_cores
from paratron.model.attention import make_pattern
from paratron.model.gpt import GPT

STEP, IDLE, CLOSE = 0, 1, 2
"""What a message from the controller says: run this plan, nothing to do yet, stop following."""

KEEP_ALIVE_S = 1.0
"""How often an idle controller tells the other ranks it is still there (`Engine.keep_alive`): a server waiting for
requests, a chat waiting for its next line, the harness building its tasks."""


@dataclass(frozen=True)
class ReplicaGroups:
    """The groups of one model replica this rank belongs to, and its place in them."""

    model: RankGroup
    """Every rank of the replica (the controller is its first)."""
    tensor: RankGroup
    pipeline: RankGroup

    @classmethod
    def single(cls) -> ReplicaGroups:
        solo = RankGroup.solo("inference", dist.get_rank() if dist.is_initialized() else 0)
        return cls(solo, solo, solo)

    @property
    def controller(self) -> int:
        return self.model.ranks[0]

    @property
    def is_controller(self) -> bool:
        return self.model.size == 1 or self.model.rank == 0

    @property
    def first_stage(self) -> bool:
        return self.pipeline.size == 1 or self.pipeline.rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pipeline.size == 1 or self.pipeline.rank == self.pipeline.size - 1


class ModelRunner:
    """This rank's part of the model (a `GPT`, or the pieces of it a pipeline stage keeps) and its KV cache."""

    def __init__(
        self,
        model: GPT,
        groups: ReplicaGroups,
        cache: PagedKVCache,
        vocab_size: int,
        progress: Callable[[], None] | None = None,
    ) -> None:
        """`progress` is called at every message between the ranks (a step, or the controller's keep-alive): a
        training run's watchdog hears that its ranks move while they evaluate tasks."""
        self.model, self.groups, self.cache, self.vocab_size = model, groups, cache, vocab_size
        self.progress = progress or (lambda: None)
        held = [i for i, layer in enumerate(model.layers) if layer is not None]
        self.layers = range(held[0], held[-1] + 1) if held else range(0)  # (a stage's layers are consecutive)
        pattern = make_pattern(model.config)
        self.cores = {kind: PagedAttention(pattern, cache.layers[i]) for i, kind in key_value_kinds(model).items()}  # type: ignore[arg-type]
        self.device = next(p.device for p in model.parameters())
        self.dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())

    @property
    def is_controller(self) -> bool:
        return self.groups.is_controller

    # ------------------------------------------------------------ the controller's side

    def run(self, plan: StepPlan) -> torch.Tensor:
        """Run one step on every rank; the logits [R, vocab] (fp32) of the plan's rows, on the controller."""
        self.progress()
        self._send(STEP, plan)
        logits = self._execute(plan)
        if not self.groups.last_stage:  # (the controller is on the first stage)
            logits = torch.empty(len(plan.logit_rows), self.vocab_size, dtype=torch.float32, device=self.device)
            dist.recv(logits, src=self.groups.pipeline.ranks[-1])  # (the last stage's first tensor-parallel rank)
        assert logits is not None
        return logits

    def idle(self) -> None:
        """Tell the other ranks there is nothing to run yet (they wait in a collective that must not time out)."""
        self.progress()
        self._send(IDLE)

    def close(self) -> None:
        self._send(CLOSE)

    # ------------------------------------------------------------ every other rank

    def follow(self) -> None:
        """Run the controller's steps until it closes."""
        while True:
            kind, plan = self._receive()
            self.progress()
            if kind == CLOSE:
                return
            if kind == STEP:
                assert plan is not None
                logits = self._execute(plan)
                if logits is not None and self.groups.tensor.rank == 0:  # (the last stage's first rank)
                    dist.send(logits.contiguous(), dst=self.groups.controller)

    # ------------------------------------------------------------ the step

    @torch.inference_mode()
    def _execute(self, plan: StepPlan) -> torch.Tensor | None:
        """This rank's part of a step: the logits of the plan's rows on the last stage, None elsewhere. (Inference
        mode: no autograd bookkeeping on any tensor, a few hundredths of a decoding step.)"""
        model, groups = self.model, self.groups
        positions = plan.positions[None]
        self.cache.prepare(plan)
        if groups.first_stage:
            x = model.embed(plan.input_ids[None], positions, plan.images)
        else:
            x = torch.empty(1, len(plan.input_ids), model.config.hidden_size, dtype=self.dtype, device=self.device)
            dist.recv(x, src=groups.pipeline.ranks[groups.pipeline.rank - 1])
        with paged_cores(self.cores):
            x = model.layers(x, self.layers, model.rotary_tables(positions), self.cache)
        if not groups.last_stage:
            dist.send(x.contiguous(), dst=groups.pipeline.ranks[groups.pipeline.rank + 1])
            return None
        logits = model.head(x[:, plan.logit_rows])[0]
        if groups.tensor.size > 1:  # (vocabulary-parallel: each rank holds a slice of the rows' logits)
            logits = comm.all_gather(logits, -1, groups.tensor)
        return logits[:, : self.vocab_size].float()

    # ------------------------------------------------------------ messages

    def _send(self, kind: int, plan: StepPlan | None = None) -> None:
        group = self.groups.model
        if group.size == 1:
            return
        images = plan.images if plan is not None else None
        sizes = [len(getattr(plan, names[0])) if plan is not None else 0 for names in StepPlan.SIZED.values()]
        image_shape = list(images.shape) if images is not None else [0, 0, 0, 0]
        header = torch.tensor([kind, *sizes, *image_shape], dtype=torch.long, device=self.device)
        self._broadcast(header)
        if plan is None:
            return
        self._broadcast(torch.cat([getattr(plan, name) for names in StepPlan.SIZED.values() for name in names]))
        if images is not None:
            self._broadcast(images.to(self.device, torch.float32).contiguous())

    def _receive(self) -> tuple[int, StepPlan | None]:
        header = torch.empty(1 + len(StepPlan.SIZED) + 4, dtype=torch.long, device=self.device)
        self._broadcast(header)
        kind, *rest = header.tolist()
        sizes, image_shape = rest[: len(StepPlan.SIZED)], rest[len(StepPlan.SIZED) :]
        if kind != STEP:
            return kind, None
        lengths = [size for size, names in zip(sizes, StepPlan.SIZED.values()) for _ in names]
        flat = torch.empty(sum(lengths), dtype=torch.long, device=self.device)
        self._broadcast(flat)
        names = [name for names in StepPlan.SIZED.values() for name in names]
        fields = dict(zip(names, flat.split(lengths)))
        images = None
        if image_shape[0]:
            images = torch.empty(image_shape, dtype=torch.float32, device=self.device)
            self._broadcast(images)
        return kind, StepPlan(**fields, images=images)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=self.groups.controller, group=self.groups.model.process_group)
