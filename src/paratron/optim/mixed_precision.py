"""Mixed precision as in Megatron-LM: 16-bit weights for compute, fp32 for everything that
accumulates.

- The model's parameters are bf16 or fp16; forward and backward run in that type.
- Gradients are accumulated over micro-batches and reduced over data-parallel ranks in fp32
  "main gradients" (the gradient buffer of `parallel.data_parallel`, see `GradientReducer`).
- The optimizer steps fp32 master copies of the weights, with fp32 state, and writes the
  result back into the 16-bit parameters (`master_weights.py`).
- fp16 multiplies the loss by a scale before backward so that small gradients do not flush to
  zero, and divides it out of the fp32 gradients after. A gradient that overflowed anywhere (on
  any rank, in any shard) makes every rank skip the step; the scale then backs off
  (`LossScaler`). bf16 has fp32's exponent range and needs no scale.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from paratron.config.schema import TrainingConfig
from paratron.distributed import comm
from paratron.distributed.topology import RankGroup


class LossScaler:
    """The fp16 loss scale: static, or dynamic with Megatron-LM's rules.

    Dynamic: after an overflow the step is skipped and one unit of `hysteresis` is used up; when
    none is left the scale halves (never below `min_scale`). After `window` steps in a row
    without overflow the scale doubles and the hysteresis is refilled."""

    def __init__(
        self, initial: float, min_scale: float = 1.0, window: int = 1000, hysteresis: int = 2, dynamic: bool = True
    ) -> None:
        self.scale, self.min_scale, self.window, self.hysteresis = float(initial), float(min_scale), window, hysteresis
        self.dynamic = dynamic
        self.clean_steps = 0
        self.hysteresis_left = hysteresis

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self.clean_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
            return
        self.clean_steps += 1
        if self.clean_steps == self.window:
            self.clean_steps = 0
            self.hysteresis_left = self.hysteresis
            self.scale *= 2.0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps, self.hysteresis_left = int(state["clean_steps"]), int(state["hysteresis_left"])


def build_loss_scaler(config: TrainingConfig) -> LossScaler | None:
    """The run's loss scaler: fp16 only; static with --loss-scale, dynamic otherwise."""
    if config.precision != "fp16":
        return None
    if config.loss_scale is not None:
        return LossScaler(config.loss_scale, dynamic=False)
    return LossScaler(config.initial_loss_scale, config.min_loss_scale, config.loss_scale_window, config.hysteresis)


class Precision:
    """What a training step does differently per precision: scale the loss, then unscale the
    gradients and agree on overflows."""

    def __init__(self, precision: str, scaler: LossScaler | None = None, device: torch.device | str = "cpu") -> None:
        self.device, self.scaler = torch.device(device), scaler

    @property
    def loss_scale(self) -> float:
        """What `backward` multiplies the loss by (1 without a scaler)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.scaler.scale if self.scaler is not None else loss).backward()

    @torch.no_grad()
    def unscale(self, grads: list[torch.Tensor], group: RankGroup | None = None) -> bool:
        """Divide the loss scale out of `grads` (this rank's part of the fp32 gradients) and say
        whether any gradient of any rank of `group` (the ranks the gradients are spread over)
        overflowed. Always False without a scaler."""
        if self.scaler is None:
            return False
        device = grads[0].device if grads else self.device
        found = torch.zeros(1, device=device)
        if grads:
            inverse = torch.full((1,), 1.0 / self.scaler.scale, device=device)
            for same_type in _by_dtype(grads):
                torch._amp_foreach_non_finite_check_and_unscale_(same_type, found, inverse)
        comm.all_reduce(found, group or RankGroup.solo(), op=dist.ReduceOp.MAX)
        return bool(found.item())

    def update(self, overflow: bool) -> None:
        if self.scaler is not None:
            self.scaler.update(overflow)


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())
