"""Initialization: every weight drawn from (seed, its single-device name) alone.

The same seed gives the same initial weights at every layout (tensor, pipeline, expert, data
parallel, FSDP): a rank that holds part of a tensor draws just the blocks of rows that meet its
part (`init_rows`), the whole model draws every block (`init_weights`). Matrices and embeddings
follow Megatron-LM: N(0, --init-method-std), the projections that write into the residual stream
scaled by 1 / sqrt(2 x layers); norms start at 1, biases at 0, LoRA adapters as peft starts them.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch
from torch import nn

from paratron.config.schema import ModelConfig
from paratron.model.lora import init_adapter, is_adapter

VISION = "vision."
"""The prefix of the vision encoder's and projector's parameter names."""

INIT_BLOCK_ELEMENTS = 2**22
"""Weights are drawn in blocks of whole rows of dimension 0 of about this many elements (16 MiB in
fp32), each from its own generator: a rank that holds a slice of a tensor draws only the blocks that
meet its slice, one at a time, never the whole tensor."""


def _stable_seed(seed: int, name: str, block: int = 0) -> int:
    """A generator seed from (seed, name, block); block 0 keeps the seed of the name alone."""
    key = f"{seed}/{name}" if block == 0 else f"{seed}/{name}/{block}"
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_block_rows(name: str, shape: Sequence[int]) -> int:
    """Rows of dimension 0 in each initialization block of the single-device tensor `name` of
    `shape` (a 0-D tensor is one row; a LoRA adapter, small, is one block)."""
    rows = shape[0] if shape else 1
    if is_adapter(name):
        return max(1, rows)
    per_row = math.prod(shape[1:])
    return max(1, INIT_BLOCK_ELEMENTS // max(1, per_row))


def init_rows(name: str, shape: Sequence[int], rows: slice, out: torch.Tensor, config: ModelConfig, seed: int) -> None:
    """Write rows [rows.start, rows.stop) of dimension 0 of the single-device initialization of
    parameter `name` (of `shape`) into `out`, drawing only the blocks that meet them, one at a
    time: every layout, whatever part of the tensor it holds, gets the same values from
    (seed, name) alone.

    Matrices and embeddings ~ N(0, std); the projections that write into the residual stream
    (and the experts' output projections) use std / sqrt(2 x layers) (GPT-2/Megatron scaled
    init); norms start at 1 (at 0 with --apply-layernorm-1p, which applies 1 + weight), biases at 0;
    LoRA adapters as `model.lora.init_adapter` says.
    """
    shape = tuple(shape) or (1,)  # (a 0-D tensor: one row of one element)
    start, stop, _ = rows.indices(shape[0])
    with torch.no_grad():
        out = out.view(1) if out.dim() == 0 else out
        if name.endswith("bias"):
            out.zero_()
            return
        if name.endswith("norm.weight"):  # (1p: the scale applied is 1 + weight; the vision encoder's are plain)
            out.fill_(0.0 if config.apply_layernorm_1p and not name.startswith(VISION) else 1.0)
            return
        step = init_block_rows(name, shape)
        for block in range(start // step, -(-stop // step)):
            first, last = block * step, min((block + 1) * step, shape[0])
            lo, hi = max(first, start), min(last, stop)
            target = out[lo - start : hi - start]
            direct = (lo, hi) == (first, last) and target.is_contiguous()
            values = target if direct else out.new_empty((last - first, *shape[1:]))
            _draw(name, values, config, seed, block)
            if not direct:
                target.copy_(values[lo - first : hi - first])


def _draw(name: str, block: torch.Tensor, config: ModelConfig, seed: int, index: int) -> None:
    """Fill `block` (rows of dimension 0, all of the other dimensions) with its own generator."""
    generator = torch.Generator(device=block.device)
    generator.manual_seed(_stable_seed(seed, name, index))
    if init_adapter(name, block, generator):
        return
    std = config.init_method_std
    if name.endswith(("out_proj.weight", "experts.w_out")):
        std /= math.sqrt(2.0 * (config.vision_num_layers if name.startswith(VISION) else config.num_layers))
    block.normal_(0.0, std, generator=generator)


def init_parameter(name: str, param: torch.Tensor, config: ModelConfig, seed: int) -> None:
    """Initialize one whole (single-device) parameter from (seed, its name) alone: `init_rows`
    over all its rows, so every layout gets the same weights."""
    init_rows(name, tuple(param.shape), slice(None), param, config, seed)


def init_weights(model: nn.Module, config: ModelConfig, seed: int) -> None:
    """Initialize every parameter of a whole single-device model (in `named_parameters` order) and
    zero its buffers (the MoE router's expert bias and load counters)."""
    for name, param in model.named_parameters():
        init_parameter(name, param, config, seed)
    for buffer in model.buffers():
        buffer.zero_()
