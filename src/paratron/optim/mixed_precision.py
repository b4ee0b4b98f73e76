"""Mixed precision as in Megatron-LM: 16-bit weights for compute, fp32 for everything that
accumulates.

- The model's parameters are bf16 or fp16; forward and backward run in that type.
- Gradients are accumulated over micro-batches and reduced over data-parallel ranks in fp32
  "main gradients" (the gradient buffer of `parallel.data`, see `GradientReducer`).
- The optimizer steps fp32 master copies of the weights, with fp32 state, and writes the
  result back into the 16-bit parameters (`MasterWeightsOptimizer`).
- fp16 multiplies the loss by a scale before backward so that small gradients do not flush to
  zero, and divides it out of the fp32 gradients after. A gradient that overflowed anywhere (on
  any rank, in any shard) makes every rank skip the step; the scale then backs off
  (`LossScaler`). bf16 has fp32's exponent range and needs no scale.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratron.config.schema import OptimizerConfig, TrainingConfig
from paratron.distributed import comm

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class LossScaler:
    """The fp16 loss scale: static, or dynamic with Megatron-LM's rules.

    Dynamic: after an overflow the step is skipped and one unit of `hysteresis` is used up; when
    none is left the scale halves (never below `min_scale`). After `window` steps in a row
    without overflow the scale doubles and the hysteresis is refilled."""

    def __init__(self, initial: float, min_scale: float = 1.0, window: int = 1000, hysteresis: int = 2,
                 dynamic: bool = True) -> None:
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

    def __init__(self, precision: str, scaler: LossScaler | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.device, self.scaler = torch.device(device), scaler

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.scaler.scale if self.scaler is not None else loss).backward()

    @torch.no_grad()
    def unscale(self, grads: list[torch.Tensor], group: Any = None) -> bool:
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
        comm.all_reduce(found, group, op=dist.ReduceOp.MAX)
        return bool(found.item())

    def update(self, overflow: bool) -> None:
        if self.scaler is not None:
            self.scaler.update(overflow)


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


def make_inner_optimizer(groups: list[dict], config: OptimizerConfig) -> torch.optim.Optimizer:
    """The PyTorch optimizer that steps fp32 tensors, from parameter groups."""
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum)
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)


class MasterWeightsOptimizer:
    """Optimizer-shaped (param_groups, state, step, state_dict, load_state_dict) over fp32 master
    weights that stand for the model's parameters (or pieces of them).

    Subclasses fill `masters` (one fp32 tensor each, its `.grad` the fp32 main gradient) and
    `targets` (where each master's value goes after a step: a 16-bit parameter or a piece of one),
    and build `self.optimizer` over the masters; `model` is the data-parallel wrapper that owns
    the gradient buffer. A master that is the target itself (fp32
    training) needs no copy. Checkpoints carry master copies, which 16-bit weights cannot restore."""

    model: nn.Module
    masters: list[torch.Tensor]
    targets: list[torch.Tensor]
    optimizer: torch.optim.Optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the model's gradient buffer, which the masters' gradients are views of."""
        self.model.zero_grad_buffer()

    def _copies(self) -> bool:
        return any(m.data_ptr() != t.data_ptr() for m, t in zip(self.masters, self.targets))

    @torch.no_grad()
    def write_back(self) -> None:
        """Copy the masters into the model's parameters (rounding to their type)."""
        for master, target in zip(self.masters, self.targets):
            if master.data_ptr() != target.data_ptr():
                target.copy_(master)

    def step(self) -> None:
        self.optimizer.step()
        self.write_back()

    def state_dict(self) -> dict[str, Any]:
        state = self.optimizer.state_dict()
        if self._copies():
            state = {**state, "master_weights": [m.detach().clone() for m in self.masters]}
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        saved = state.pop("master_weights", None)
        self.optimizer.load_state_dict(state)
        if saved is not None and self._copies():
            for master, value in zip(self.masters, saved):
                master.copy_(value)
            self.write_back()


class MixedPrecisionOptimizer(MasterWeightsOptimizer):
    """fp32 masters for a model whose parameters are 16-bit and whose gradients sit in fp32
    buffers (`param.main_grad`, from the data-parallel wrapper); for ZeRO stage 0."""

    def __init__(self, model: nn.Module, config: OptimizerConfig) -> None:
        from paratron.optim.build import parameter_groups  # (build imports this module)

        self.model = model
        params = [p for p in model.parameters() if p.requires_grad]
        self.targets = params
        self.masters = [nn.Parameter(p.detach().float().clone()) for p in params]
        by_id = {id(p): m for p, m in zip(params, self.masters)}
        groups = [{**g, "params": [by_id[id(p)] for p in g["params"]]}
                  for g in parameter_groups(model, config.weight_decay)]
        self.optimizer = make_inner_optimizer(groups, config)
        self.prepare_grads()

    def prepare_grads(self) -> None:
        """Point each master's gradient at its parameter's fp32 main gradient."""
        for master, param in zip(self.masters, self.targets):
            master.grad = param.main_grad
