"""Activation recomputation: keep less for backward, compute it again when backward needs it.

    full, uniform   layers in groups of N (counted from the start of each pipeline chunk):
                    only each group's input is kept; the group runs again in backward
    full, block     the first N layers of each pipeline chunk are recomputed one by one,
                    the others keep everything
    selective       only the attention core (softmax(q k^T) v and its dropout): the part
                    whose saved activations grow with the square of the sequence length

Built on `torch.utils.checkpoint` (non-reentrant). Dropout draws the same masks in the
recomputation: the default generators are restored by torch, and the named generators of
tensor-parallel regions are set back to their states at the first forward for the
recomputation, then returned to where they were.
"""

from __future__ import annotations

import contextlib
import types
from functools import partial
from typing import Any, Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint

from paratron.distributed.rng import RNGStates
from paratron.model.gpt import GPT


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


def recomputed(fn: Callable[..., Any], rng: RNGStates | None) -> Callable[..., Any]:
    """`fn` whose activations are recomputed in backward (plain when no gradient is being recorded)."""
    def run(*args: Any) -> Any:
        if not torch.is_grad_enabled():
            return fn(*args)
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=partial(_rng_contexts, rng))
    return run


def apply_recompute(model: GPT, granularity: str, method: str | None, num_layers: int | None,
                    rng: RNGStates | None) -> None:
    """Switch recomputation on in `model` (in place, on the meta device or not)."""
    if granularity == "selective":
        for block in model.layers:
            block.attention.core.forward = recomputed(block.attention.core.forward, rng)  # type: ignore[method-assign]
        return
    group = num_layers or 1
    plain = model.run_layers

    def run_layers(self: GPT, x: torch.Tensor, indices: range, rotary: Any = None, cache: Any = None,
                   start: int = 0) -> torch.Tensor:
        if cache is not None or not torch.is_grad_enabled():
            return plain(x, indices, rotary, cache, start)
        if method == "block":
            recompute = range(indices.start, min(indices.start + group, indices.stop))
            for i in indices:
                layer = partial(plain, indices=range(i, i + 1), rotary=rotary)
                x = recomputed(layer, rng)(x) if i in recompute else layer(x)
            return x
        for first in range(indices.start, indices.stop, group):
            layers = range(first, min(first + group, indices.stop))
            x = recomputed(partial(plain, indices=layers, rotary=rotary), rng)(x)
        return x

    model.run_layers = types.MethodType(run_layers, model)  # type: ignore[method-assign]
