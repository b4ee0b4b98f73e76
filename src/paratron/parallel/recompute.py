"""Activation recomputation: keep less for backward, compute it again when backward needs it.

    full, uniform   layers in groups of N (counted from the start of each pipeline chunk):
                    only each group's input is kept; the group runs again in backward
    full, block     the first N layers of each pipeline chunk are recomputed one by one,
                    the others keep everything
    selective       only what each layer kind names (`LayerKind.selective_recompute`): attention's
                    core (softmax(q k^T) v and its dropout), the part whose saved activations
                    grow with the square of the sequence length

Applied as module swaps, the way tensor parallelism swaps layers: the model's stack of blocks
is replaced by a `RecomputedLayers` holding the same blocks (so every parameter keeps its
single-device name), and each attention core is wrapped in a `Recomputed` module.

Built on `torch.utils.checkpoint` (non-reentrant). Dropout draws the same masks in the
recomputation: the default generators are restored by torch, and the named generators of
tensor-parallel regions are set back to their states at the first forward for the
recomputation, then returned to where they were.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from paratron.distributed.rng import RNGStates
from paratron.model.attention import TokenPlaces
from paratron.model.gpt import GPT
from paratron.model.transformer import LayerCaches, TransformerLayers


def _rng_contexts(rng: RNGStates | None) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """(forward context, recomputation context) for `checkpoint(context_fn=...)`."""
    if rng is None:
        return contextlib.nullcontext(), contextlib.nullcontext()
    at_forward = dict(rng.states)

    @contextlib.contextmanager
    def replay() -> Iterator[None]:
        live = dict(rng.states)
        rng.states.update(at_forward)
        try:
            yield
        finally:
            rng.states.update(live)

    return contextlib.nullcontext(), replay()


def is_recomputing() -> bool:
    """Whether this forward runs inside autograd's backward: activation recomputation running a layer again (hooks
    that observe forwards skip it, or they would see each recomputed layer twice)."""
    return torch._C._current_graph_task_id() != -1


def _recomputed_call(fn: Callable[..., Any], rng: RNGStates | None, *args: Any) -> Any:
    """`fn(*args)` with its activations recomputed in backward (plain when no gradient is recorded)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    if torch.compiler.is_compiling():  # (a compiled block switches streams outside its graph: nothing to replay)
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, context_fn=partial(_rng_contexts, rng))


class Recomputed(nn.Module):
    """Runs the wrapped module keeping only its inputs for backward (used for parameter-free
    modules, such as the attention core, so that names do not change)."""

    def __init__(self, module: nn.Module, rng: RNGStates | None) -> None:
        super().__init__()
        self.module, self.rng = module, rng

    def forward(self, *args: Any) -> Any:
        return _recomputed_call(self.module, self.rng, *args)


class RecomputedLayers(TransformerLayers):
    """The model's stack of blocks (the same block objects, under the same names) run with full
    recomputation: `method` uniform recomputes groups of `group` layers, block the first
    `group` layers of each range it is asked to run (a pipeline chunk)."""

    def __init__(self, layers: TransformerLayers, method: str, group: int, rng: RNGStates | None) -> None:
        super().__init__(layers)
        self.method, self.group, self.rng = method, group, rng

    def forward(
        self,
        x: torch.Tensor,
        indices: range,
        rotary: Any = None,
        cache: LayerCaches | None = None,
        places: TokenPlaces | None = None,
    ) -> torch.Tensor:
        if cache is not None or not torch.is_grad_enabled():
            return super().forward(x, indices, rotary, cache, places)
        run = partial(super().forward, rotary=rotary, places=places)
        if self.method == "block":
            recompute = range(indices.start, min(indices.start + self.group, indices.stop))
            for i in indices:
                layer = partial(run, indices=range(i, i + 1))
                x = _recomputed_call(layer, self.rng, x) if i in recompute else layer(x)
            return x
        for first in range(indices.start, indices.stop, self.group):
            layers = range(first, min(first + self.group, indices.stop))
            x = _recomputed_call(partial(run, indices=layers), self.rng, x)
        return x


def apply_recompute(
    model: GPT, granularity: str, method: str | None, num_layers: int | None, rng: RNGStates | None
) -> None:
    """Switch recomputation on in `model` (in place, on the meta device or not): in the language model's layers
    and a vision encoder's alike."""
    stacks = [model] + ([model.vision.encoder] if model.vision is not None else [])
    for stack in stacks:
        if granularity == "selective":  # (each kind names the children whose activations grow fastest)
            for block in stack.layers:
                for kind in block.kinds().values():
                    for name in kind.selective_recompute:
                        setattr(kind, name, Recomputed(getattr(kind, name), rng))
        else:
            stack.layers = RecomputedLayers(stack.layers, method or "uniform", num_layers or 1, rng)
