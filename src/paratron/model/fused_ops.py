"""Elementwise work of a block as one kernel each: RMSNorm, rotary embeddings, SwiGLU (Megatron-LM's
--persist-layer-norm, --apply-rope-fusion and --bias-swiglu-fusion).

Eager PyTorch runs each of these as several kernels (RMSNorm: square, mean, rsqrt, two products;
rotary: slices, a negation, a concatenation, two products and a sum), each reading and writing the
whole activation; on a GPU they are bound by memory, not arithmetic. `FusibleOp` compiles the very
function the model runs eagerly with `torch.compile` (inductor, one graph, shapes dynamic so that no
sequence length or batch recompiles it), which generates one kernel forward and one backward: the
same formula, so the same numbers up to the order of floating-point operations.

Whether an op runs compiled is its setting's (`ModelConfig.apply_rope_fusion`, `bias_swiglu_fusion`,
`persist_layer_norm`): on, off, or unset, which means on where the tensors live on an accelerator and
off on the CPU, where inductor compiles C++ (tens of seconds per op) that a small run never earns
back. Inside a region that is being compiled already (--compile's blocks) the eager function is
traced into that region's graph, which fuses it there: nothing is compiled twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

BACKEND = "inductor"
"""torch.compile's backend for the fused ops (tests may choose aot_eager, which traces without generating code)."""


def fusion_wanted(setting: bool | None, device: torch.device) -> bool:
    """A fusion setting in effect on `device`: as set, or when unset, on everywhere but the CPU (and meta)."""
    if setting is not None:
        return setting
    return device.type not in ("cpu", "meta")


class FusibleOp:
    """A function of tensors, run eagerly or as one compiled kernel (compiled on first use, per backend)."""

    def __init__(self, eager: Callable[..., Any]) -> None:
        self.eager = eager
        self.compiled: dict[str, Callable[..., Any]] = {}
        self.__doc__ = eager.__doc__

    def fused(self) -> Callable[..., Any]:
        """The compiled function (compiled lazily: building a model compiles nothing)."""
        if BACKEND not in self.compiled:
            self.compiled[BACKEND] = torch.compile(self.eager, backend=BACKEND, fullgraph=True, dynamic=True)
        return self.compiled[BACKEND]

    def __call__(self, setting: bool | None, x: torch.Tensor, *args: Any) -> Any:
        """`eager(x, *args)`, compiled where `setting` is in effect on x's device and no outer compilation
        is tracing this call already."""
        if torch.compiler.is_compiling() or not fusion_wanted(setting, x.device):
            return self.eager(x, *args)
        return self.fused()(x, *args)
